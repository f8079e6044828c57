"""The trainer's refusals: what the command prints as one `error:` line (exit 2)."""
from __future__ import annotations


class TrainError(ValueError):
    """A refusal: the run cannot start as asked; nothing was written."""


class StalledError(TrainError):
    """The run stopped: too many steps in a row were skipped (their gradient norm not finite)."""
