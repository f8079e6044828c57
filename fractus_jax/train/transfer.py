"""How far a transfer of many files to or from a store has gone, through fsspec's callbacks.

s3fs and gcsfs move each file of a `put` or `get` under a child callback branched from the
one the call was given, and report its bytes there (as increments, or as the bytes done so
far). `Transfer` adds up its children's bytes; with a `log` it says how far it is every
PROGRESS_SECONDS while bytes move (a pull: the caller waits inside the transfer), and
`words()` says it to a caller that waits on it from another thread (an upload).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from fsspec.callbacks import Callback

# A transfer waited for says how far it is this often.
PROGRESS_SECONDS = 10.0


class Transfer(Callback):
    """The bytes moved by one put or get of `total` bytes; `what` begins each progress line."""

    def __init__(self, total: int, what: str, log: Optional[Callable[[str], None]] = None):
        super().__init__()
        self.total, self.what, self.log = total, what, log
        self.moved = 0
        self.started = self._said = time.monotonic()

    def branched(self, path_1, path_2, **kwargs) -> Callback:
        return _FileBytes(self)

    def add(self, n: int) -> None:
        self.moved += n
        if self.log is not None and time.monotonic() - self._said >= PROGRESS_SECONDS:
            self._said = time.monotonic()
            self.log(self.words())

    def words(self) -> str:
        """'<what>: 3100.0 of 7800.0 MB (95 MB/s)'. A file sent again on a retry counts its
        bytes again: the figure stops at the total."""
        done = min(self.moved, self.total)
        rate = done / 1e6 / max(time.monotonic() - self.started, 1e-9)
        return f"{self.what}: {done / 1e6:.1f} of {self.total / 1e6:.1f} MB ({rate:.0f} MB/s)"


class _FileBytes(Callback):
    """One file's callback: each update's new bytes go to the transfer (s3fs reports
    increments, gcsfs's uploads the bytes done so far; `value` holds either as a total)."""

    def __init__(self, transfer: Transfer):
        super().__init__()
        self.transfer = transfer
        self._told = 0

    def call(self, *args, **kwargs) -> None:
        if self.value > self._told:
            self.transfer.add(self.value - self._told)
            self._told = self.value
