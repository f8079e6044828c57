"""Reading an Atom corpus: memory-mapped, validated in chunks, inspected.

Accepted layouts (docs/spec.md §6): ``.u16`` and ``.i16`` (little-endian 16-bit
ids, one layout), ``.npy`` (a 1-D integer array) and ``.bin`` (little-endian
int32). A ``FILE.json`` index beside the file (written by the builder) is
checked against it: a corpus whose size disagrees with its index is refused.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import numpy as np

from fractus_jax.atom.ids import BOS, BOUNDARIES, EOS, NAMES, PAD, VOCAB

FORMAT = "fractus-atom-corpus"
FORMAT_VERSION = 1
RAW_DTYPES = {".u16": "<u2", ".i16": "<i2", ".bin": "<i4"}
SUFFIXES = tuple(RAW_DTYPES) + (".npy",)
DEFAULT_CHUNK = 1 << 24  # ids per validation chunk (32 MiB of uint16)


class CorpusError(ValueError):
    """A corpus (or a source for one) that cannot be used; the message names the file."""


def index_path(path) -> Path:
    """The builder's index for ``path``: ``FILE.json`` beside it."""
    return Path(str(path) + ".json")


def read_index(path) -> Optional[dict]:
    """The index beside ``path``, or None if there is none."""
    ip = index_path(path)
    if not ip.exists():
        return None
    try:
        index = json.loads(ip.read_text("utf-8"))
    except (OSError, ValueError) as e:
        raise CorpusError(f"{ip}: unreadable corpus index ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CorpusError(f"{ip}: not a {FORMAT} index")
    if index.get("version") != FORMAT_VERSION:
        raise CorpusError(f"{ip}: index format version {index.get('version')!r}, "
                          f"this reader knows version {FORMAT_VERSION}")
    return index


def _map(path: Path) -> np.ndarray:
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise CorpusError(f"{path}: unknown corpus extension {path.suffix!r} "
                          f"(expected one of {', '.join(SUFFIXES)})")
    if not path.exists():
        raise CorpusError(f"{path}: no such corpus file")
    if not path.is_file():
        raise CorpusError(f"{path}: not a file")
    if suffix == ".npy":
        try:
            ids = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise CorpusError(f"{path}: unreadable .npy file ({e})") from None
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise CorpusError(f"{path}: expected a 1-D integer array, "
                              f"got shape {ids.shape} dtype {ids.dtype}")
        return ids
    dtype = np.dtype(RAW_DTYPES[suffix])
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise CorpusError(f"{path}: {size} bytes is not a whole number of "
                          f"{dtype.itemsize}-byte ids (a truncated or odd-length file)")
    if size == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


class Corpus:
    """A memory-mapped id file. ``ids`` is a read-only 1-D integer array view
    (slicing reads only the slice); nothing is read whole."""

    def __init__(self, path):
        self.path = Path(path)
        mm = _map(self.path)
        self.ids = mm.view(np.ndarray) if isinstance(mm, np.memmap) else mm
        self.ids.flags.writeable = False
        self.n_ids = int(self.ids.shape[0])
        self._stat = self.path.stat()   # of the file mapped (a build replaces the file by rename)
        self.index = read_index(self.path)
        self._digests = {0: hashlib.sha256().hexdigest()}
        if self.index is not None and self.index.get("n_ids") != self.n_ids:
            raise CorpusError(
                f"{self.path}: holds {self.n_ids} ids but its index "
                f"{index_path(self.path).name} says {self.index.get('n_ids')} "
                "(an interrupted build? re-run the same build command to repair it)")

    def __len__(self) -> int:
        return self.n_ids

    def __repr__(self) -> str:
        return f"Corpus({str(self.path)!r}, n_ids={self.n_ids})"

    def identity(self) -> dict:
        """What a checkpoint manifest records about the corpus it trained on: where it is,
        its length, and the sha256 of its ids (`sha256`), which tells whether a corpus that
        grew since still begins with them (`prefix_change`)."""
        st = self._stat
        return {"path": str(self.path.resolve()), "n_ids": self.n_ids,
                "size": int(st.st_size), "mtime": float(st.st_mtime), "sha256": self.sha256(self.n_ids)[0]}

    def sha256(self, *counts: int) -> list[str]:
        """The sha256 of the first n ids (as little-endian bytes of the file's id width) for
        each n of counts, in one pass over the ids; remembered."""
        want = sorted({n for n in counts if n not in self._digests})
        if want and (want[0] < 0 or want[-1] > self.n_ids):
            raise CorpusError(f"{self.path}: no first {want[-1] if want[-1] > self.n_ids else want[0]} ids "
                              f"(it holds {self.n_ids})")
        h, done = hashlib.sha256(), 0
        for n in want:
            while done < n:
                end = min(n, done + DEFAULT_CHUNK)
                h.update(np.ascontiguousarray(self.ids[done:end], self.ids.dtype.newbyteorder("<")).tobytes())
                done = end
            self._digests[n] = h.hexdigest()
        return [self._digests[n] for n in counts]

    def prefix_change(self, identity: dict) -> Optional[str]:
        """None when this corpus begins with the ids of a corpus that `identity` recorded
        (the same ones, or those followed by more: a corpus grows by appending); else what
        differs. A record without `sha256` (written before corpora could grow) matches a
        corpus of its length only."""
        n = identity.get("n_ids")
        if n is None:
            return None
        if self.n_ids < n:
            return f"{self.path} has {self.n_ids} ids, fewer than the {n} recorded"
        if "sha256" not in identity:
            if self.n_ids != n:
                return (f"{self.path} has {self.n_ids} ids, the record has {n} and no digest of them "
                        "(written before corpora could grow) to tell whether they begin this corpus")
            return None
        if self.sha256(n)[0] != identity["sha256"]:
            what = "its ids differ from" if self.n_ids == n else f"its first {n} ids differ from"
            return (f"{self.path}: {what} the {n} recorded (sha256 {self.sha256(n)[0][:12]}..., "
                    f"recorded {identity['sha256'][:12]}...)")
        return None

    def read(self, offset: int, count: int) -> np.ndarray:
        """``count`` ids from ``offset`` (fewer at the end), as a small int32 array."""
        if offset < 0 or offset > self.n_ids:
            raise CorpusError(f"{self.path}: offset {offset} outside 0..{self.n_ids}")
        return np.asarray(self.ids[offset:offset + max(0, count)], np.int32)

    def chunks(self, chunk: int = DEFAULT_CHUNK):
        """(offset, int64 array) pieces covering the corpus in order."""
        if chunk <= 0:
            raise ValueError("chunk must be positive")
        for off in range(0, self.n_ids, chunk):
            yield off, np.asarray(self.ids[off:off + chunk], np.int64)

    def _check(self, off: int, c: np.ndarray, vocab: int, allow_pad: bool) -> None:
        """Raise CorpusError at the first id of chunk ``c`` (at ``off``) outside
        0..vocab-1, or, for the Atom vocab without ``allow_pad``, equal to PAD."""
        refuse_pad = vocab == VOCAB and not allow_pad
        if c.size == 0:
            return
        lo, hi = c.min(), c.max()  # native dtype: no widening copy
        if lo >= 0 and hi < vocab and not (refuse_pad and lo <= PAD <= hi and (c == PAD).any()):
            return
        bad = (c >= vocab) if c.dtype.kind == "u" else (c < 0) | (c >= vocab)
        if refuse_pad:
            bad |= c == PAD
        i = int(np.argmax(bad))
        v = int(c[i])
        if vocab != VOCAB:
            what = f"outside 0-{vocab - 1}"
        elif v == PAD:
            what = "PAD (256), which never appears in a stream"
        else:
            what = f"outside the Atom alphabet 0-{VOCAB - 1}"
        raise CorpusError(f"{self.path}: id {v} at offset {off + i} is {what}")

    def validate(self, chunk: int = DEFAULT_CHUNK, allow_pad: bool = False,
                 vocab: int = VOCAB) -> None:
        """Check every id is in 0..vocab-1 (default the Atom alphabet 0-265),
        streaming ``chunk`` ids at a time. For the Atom vocab, unless
        ``allow_pad``, PAD is refused too (it never appears in a stream); for any
        other vocab only the range is checked. Raises CorpusError naming the
        file, the first offending offset and its value."""
        if chunk <= 0:
            raise ValueError("chunk must be positive")
        for off in range(0, self.n_ids, chunk):
            self._check(off, np.asarray(self.ids[off:off + chunk]), vocab, allow_pad)

    def histogram(self, chunk: int = DEFAULT_CHUNK) -> np.ndarray:
        """Count of every id 0-265, validating on the way (one pass, native dtype)."""
        if chunk <= 0:
            raise ValueError("chunk must be positive")
        counts = np.zeros(VOCAB, np.int64)
        for off in range(0, self.n_ids, chunk):
            c = np.asarray(self.ids[off:off + chunk])
            self._check(off, c, VOCAB, allow_pad=True)
            if not np.can_cast(c.dtype, np.intp):  # e.g. a uint64 .npy (values checked above)
                c = c.astype(np.intp)
            counts += np.bincount(c, minlength=VOCAB)
        return counts

    def stats(self, chunk: int = DEFAULT_CHUNK) -> dict:
        """Boundary histogram, documents, bytes per id."""
        h = self.histogram(chunk)
        n_bytes = int(h[:PAD].sum())
        packets = int(h[list(BOUNDARIES)].sum())
        return {
            "path": str(self.path), "n_ids": self.n_ids, "n_docs": int(h[BOS]),
            "n_eos": int(h[EOS]), "n_pad": int(h[PAD]), "n_text_bytes": n_bytes,
            "bytes_per_id": n_bytes / self.n_ids if self.n_ids else 0.0,
            "packets": packets,
            "bytes_per_packet": n_bytes / packets if packets else 0.0,
            "boundaries": {NAMES[b]: int(h[b]) for b in BOUNDARIES},
        }


def open_corpus(path) -> Corpus:
    """Open a corpus file for reading (memory-mapped). Raises CorpusError."""
    try:
        return Corpus(path)
    except OSError as e:
        raise CorpusError(f"{path}: {e.strerror or e}") from None

