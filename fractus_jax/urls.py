"""A path argument that is a URL (scheme://...): never taken as the local path its slashes
would collapse to ("s3:/runs/x"). Where a run is trained or read, s3:// and gs:// are served
(`train.store.workdir_arg`); everywhere else a path is this machine's (or a filesystem
mounted on every host), and a URL is refused."""
from __future__ import annotations

import argparse
import re

URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")   # scheme://rest
LOST_SLASH = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):/(?!/)(.*)$")   # scheme:/rest, a URL with a slash lost


def check_lost_slash(value: str) -> None:
    """A path that reads as a URL with one slash ("s3:/runs/x"): ValueError, never the local
    directory of that name (which its absolute path still names)."""
    m = LOST_SLASH.match(value)
    if m:
        raise ValueError(f"{value!r} reads as the URL {m.group(1)}://{m.group(2)} with a slash lost: write "
                         f"{m.group(1)}://{m.group(2)} (for a local directory of that name, give its absolute path)")


def local_path(value: str) -> str:
    """The argparse type of a path that must be local (an input or output file, a corpus, a
    new run directory written by grow or import, a stage): a URL is refused with exit 2."""
    try:
        check_lost_slash(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    m = URL.match(value)
    if m:
        raise argparse.ArgumentTypeError(
            f"{value!r} is a {m.group(1)}:// URL; this option takes a local path (or a filesystem mounted "
            "on every host): give a path")
    return value
