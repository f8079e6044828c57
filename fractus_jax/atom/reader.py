"""Reading an Atom corpus: memory-mapped, validated in chunks, inspected.

Accepted layouts (docs/spec.md §6): ``.u16`` and ``.i16`` (little-endian 16-bit
ids, one layout), ``.npy`` (a 1-D integer array) and ``.bin`` (little-endian
int32). A ``FILE.json`` index beside the file (written by the builder) is
checked against it: a corpus whose size disagrees with its index is refused.

A corpus is one such file or a set of them (shards) read as one stream, with no copy:
a directory (its files of those extensions, sorted by name), a glob pattern (its
matches, sorted by name) or a list file (``.list``: one shard path a line,
relative to the list's folder, in the order listed). ``open_corpus`` tells them apart.
"""
from __future__ import annotations

import bisect
import glob
import hashlib
import json
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from fractus_jax.atom.ids import BOS, BOUNDARIES, EOS, NAMES, PAD, VOCAB
from fractus_jax.urls import URL

FORMAT = "fractus-atom-corpus"
FORMAT_VERSION = 1
RAW_DTYPES = {".u16": "<u2", ".i16": "<i2", ".bin": "<i4"}
SUFFIXES = tuple(RAW_DTYPES) + (".npy",)
DEFAULT_CHUNK = 1 << 24  # ids per validation chunk (32 MiB of uint16)
LIST_SUFFIXES = (".list",)   # a list file: one shard path a line
GLOB_CHARS = "*?["


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
    if not path.exists() and not suffix:
        raise CorpusError(f"{path}: no such corpus file or directory")
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
        if "shards" in identity:
            return (f"{self.path} is one file; the record is of {len(identity['shards'])} shards read as one "
                    f"stream ({identity.get('path')})")
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
        return _stats(self.path, self.n_ids, self.histogram(chunk))


def _stats(path, n_ids: int, h: np.ndarray) -> dict:
    n_bytes = int(h[:PAD].sum())
    packets = int(h[list(BOUNDARIES)].sum())
    return {
        "path": str(path), "n_ids": n_ids, "n_docs": int(h[BOS]),
        "n_eos": int(h[EOS]), "n_pad": int(h[PAD]), "n_text_bytes": n_bytes,
        "bytes_per_id": n_bytes / n_ids if n_ids else 0.0,
        "packets": packets,
        "bytes_per_packet": n_bytes / packets if packets else 0.0,
        "boundaries": {NAMES[b]: int(h[b]) for b in BOUNDARIES},
    }


class JoinedIds:
    """Id arrays read as one, with no copy: len, and slices with step 1. A slice inside one
    piece is that piece's slice (a view of its memory map); one across pieces is a JoinedIds
    of the pieces' slices, which numpy reads whole with np.asarray (only what it covers)."""

    def __init__(self, pieces: Sequence):
        self.pieces = []
        for p in pieces:   # flat: a joined piece contributes its own pieces
            self.pieces.extend(p.pieces if isinstance(p, JoinedIds) else ([p] if len(p) else []))
        self.starts = np.cumsum([0] + [len(p) for p in self.pieces]).tolist()
        self.shape = (self.starts[-1],)
        self.dtype = np.result_type(*[p.dtype for p in self.pieces]) if self.pieces else np.dtype(np.int32)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("JoinedIds reads slices with step 1 only")
        start, stop, _ = key.indices(len(self))
        stop = max(start, stop)
        first = max(0, bisect.bisect_right(self.starts, start) - 1)
        out = []
        for i in range(first, len(self.pieces)):
            lo, hi = self.starts[i], self.starts[i + 1]
            if lo >= stop:
                break
            out.append(self.pieces[i][max(start, lo) - lo:min(stop, hi) - lo])
        if len(out) == 1:
            return out[0]
        return JoinedIds(out) if out else np.zeros(0, self.dtype)

    def __array__(self, dtype=None, copy=None):
        out = np.concatenate([np.asarray(p) for p in self.pieces]) if self.pieces else np.zeros(0, self.dtype)
        return out if dtype is None else out.astype(dtype, copy=False)


class ShardedCorpus:
    """Shards read as one stream in a stated order (the module's docstring): the same reading
    API as Corpus (`ids`, `read`, `validate`, `identity`, `prefix_change`, ...), each shard
    memory-mapped, nothing copied. Its identity records every shard (name, length, sha256);
    it continues a record whose shards it begins with, in order, the last of them perhaps
    grown: shards that sort after the last are text appended to the stream."""

    def __init__(self, spec, paths: Sequence[Path], root: Path):
        self.path = spec
        self.root = root
        self.shards = [Corpus(p) for p in paths]
        self.names = [shard_name(p, root) for p in paths]
        self.ids = JoinedIds([c.ids for c in self.shards])
        self.n_ids = len(self.ids)
        self.starts = np.cumsum([0] + [c.n_ids for c in self.shards]).tolist()
        self.index = None

    def __len__(self) -> int:
        return self.n_ids

    def __repr__(self) -> str:
        return f"ShardedCorpus({str(self.path)!r}, shards={len(self.shards)}, n_ids={self.n_ids})"

    def identity(self) -> dict:
        shards = []
        for name, c in zip(self.names, self.shards):
            rec = c.identity()
            shards.append({"name": name, "n_ids": rec["n_ids"], "size": rec["size"], "mtime": rec["mtime"],
                           "sha256": rec["sha256"]})
        return {"path": spec_string(self.path), "n_ids": self.n_ids, "shards": shards}

    def prefix_change(self, identity: dict) -> Optional[str]:
        recorded = identity.get("shards")
        if recorded is None:
            if identity.get("n_ids") is None:
                return None
            return (f"{self.path} is a set of {len(self.shards)} shards; the record is of one file "
                    f"({identity.get('path')})")
        names = [r["name"] for r in recorded]
        missing = [n for n in names if n not in self.names]
        if missing:
            return (f"{len(missing)} recorded shard(s) of {self.path} are gone: "
                    f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if self.names[:len(names)] != names:
            new = [n for n in self.names[:self.names.index(names[-1])] if n not in names]
            if new:
                return (f"new shard(s) sort before the recorded ones in {self.path}: "
                        f"{', '.join(new[:5])}{' ...' if len(new) > 5 else ''} (a shard may only be added after "
                        f"the last one the run read, {names[-1]})")
            return f"the shards of {self.path} are in another order than the recorded one"
        for k, rec in enumerate(recorded):
            c, n = self.shards[k], int(rec["n_ids"])
            if k < len(recorded) - 1 and c.n_ids != n:   # only the last shard may have grown
                return f"shard {c.path} has {c.n_ids} ids, the record has {n}"
            why = c.prefix_change({"n_ids": n, "sha256": rec["sha256"]})
            if why is not None:
                return f"shard {why}"
        return None

    def locate(self, offset: int) -> tuple[int, int]:
        """(shard index, offset inside it) of a stream offset."""
        k = max(0, bisect.bisect_right(self.starts, offset) - 1)
        k = min(k, len(self.shards) - 1)
        return k, offset - self.starts[k]

    def read(self, offset: int, count: int) -> np.ndarray:
        if offset < 0 or offset > self.n_ids:
            raise CorpusError(f"{self.path}: offset {offset} outside 0..{self.n_ids}")
        return np.asarray(self.ids[offset:offset + max(0, count)], np.int32)

    def chunks(self, chunk: int = DEFAULT_CHUNK):
        if chunk <= 0:
            raise ValueError("chunk must be positive")
        for off in range(0, self.n_ids, chunk):
            yield off, np.asarray(self.ids[off:off + chunk], np.int64)

    def validate(self, chunk: int = DEFAULT_CHUNK, allow_pad: bool = False, vocab: int = VOCAB) -> None:
        """Corpus.validate of each shard: an error names the shard and the offset inside it."""
        for c in self.shards:
            c.validate(chunk, allow_pad, vocab)

    def histogram(self, chunk: int = DEFAULT_CHUNK) -> np.ndarray:
        return sum((c.histogram(chunk) for c in self.shards), np.zeros(VOCAB, np.int64))

    def stats(self, chunk: int = DEFAULT_CHUNK) -> dict:
        return {**_stats(self.path, self.n_ids, self.histogram(chunk)), "shards": len(self.shards)}


def shard_name(path: Path, root: Path) -> str:
    """A shard's name in a record: its path relative to the set's folder."""
    try:
        return Path(os.path.relpath(path, root)).as_posix()
    except ValueError:   # another drive
        return Path(path).as_posix()


def spec_string(spec) -> str:
    """A shard set's spec as recorded: absolute, so a resume from another folder finds it."""
    return os.path.abspath(os.path.expanduser(str(spec)))


def is_glob(spec) -> bool:
    return any(ch in str(spec) for ch in GLOB_CHARS) and not Path(spec).exists()


def shard_paths(spec) -> tuple[list[Path], Path]:
    """(the shard files of a directory, glob or list file, in the stream's order; the folder
    their names are relative to). Raises CorpusError naming the spec."""
    spec_s = os.path.expanduser(str(spec))
    if is_glob(spec_s):
        base = spec_s
        while any(ch in base for ch in GLOB_CHARS):
            base = os.path.dirname(base)
        root = Path(base or ".")
        paths = [Path(p) for p in glob.glob(spec_s, recursive=True)
                 if Path(p).is_file() and Path(p).suffix.lower() in SUFFIXES]
        paths.sort(key=lambda p: shard_name(p, root))
        what = f"no corpus file ({', '.join(SUFFIXES)}) matches {spec_s}"
    elif Path(spec_s).is_dir():
        root = Path(spec_s)
        paths = sorted(p for p in root.iterdir() if p.is_file() and p.suffix.lower() in SUFFIXES
                       and not p.name.startswith("."))
        what = f"{spec_s}: a directory with no corpus file ({', '.join(SUFFIXES)})"
    else:
        root = Path(spec_s).parent
        try:
            lines = Path(spec_s).read_text("utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise CorpusError(f"{spec_s}: unreadable shard list ({e})") from None
        paths, seen = [], set()
        for number, line in enumerate(lines, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            p = Path(os.path.expanduser(line))
            p = p if p.is_absolute() else root / p
            if p.resolve() in seen:
                raise CorpusError(f"{spec_s}, line {number}: {line} is listed twice")
            seen.add(p.resolve())
            paths.append(p)
        what = f"{spec_s}: a shard list naming no file"
    if not paths:
        raise CorpusError(what)
    return paths, root


def is_shard_set(path) -> bool:
    """Whether `path` names a set of shards (a directory, a glob, a list file), not one file."""
    p = Path(os.path.expanduser(str(path)))
    return p.is_dir() or is_glob(p) or p.suffix.lower() in LIST_SUFFIXES


def open_corpus(path):
    """Open a corpus for reading (memory-mapped): a file (Corpus) or a set of shards
    (ShardedCorpus). Raises CorpusError, for a URL too (a corpus is read from this machine)."""
    m = URL.match(str(path))
    if m:
        raise CorpusError(f"{path}: a {m.group(1)}:// URL; a corpus is read from this machine's disk (or a "
                          "filesystem mounted on every host): copy it here first and give its path")
    try:
        if is_shard_set(path):
            paths, root = shard_paths(path)
            return ShardedCorpus(path, paths, root)
        return Corpus(path)
    except OSError as e:
        raise CorpusError(f"{path}: {e.strerror or e}") from None

