"""Building an Atom corpus from text files (docs/spec.md §6's flat id file).

The output is little-endian uint16 ids, one closed document (BOS ... EOS) after
another, plus ``FILE.json``: n_ids, n_docs, the sources (path, size, mtime, and
where their ids lie), the boundary histogram and the format version.

Incremental: sources already in the index are skipped, new ones appended.
Atomic: ids are written to ``FILE.tmp`` (for an append, a copy of the old ids
first), synced and renamed over FILE; then the index likewise. A crash leaves
either the old corpus, or new ids with the old index, which the reader refuses
(size mismatch) and the next build repairs by truncating back to the index.
"""
from __future__ import annotations

import gzip
import fcntl
import hashlib
import json
import os
import sys
import sysconfig
import zlib
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from fractus_jax.atom.ids import BOUNDARIES, NAMES, VOCAB
from fractus_jax.atom.reader import (
    FORMAT, FORMAT_VERSION, CorpusError, index_path, open_corpus, read_index,
)
from fractus_jax.atom.stream import StreamEncoder, encode_batch, encode_bytes

TEXT_SUFFIXES = (".txt", ".md", ".py")
SOURCE_SUFFIXES = TEXT_SUFFIXES + (".jsonl",)
OUT_SUFFIXES = (".u16", ".i16")
WHOLE_LIMIT = 16 << 20  # text files up to this size are encoded in one call
BLOCK = 8 << 20  # larger ones are streamed in blocks of this size
BATCH_BYTES = 4 << 20  # jsonl records are encoded in batches of about this size


def source_kind(path: Path) -> Optional[str]:
    """``".txt"``/``".md"``/``".py"``/``".jsonl"`` (also under ``.gz``), else None."""
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    suffix = os.path.splitext(name)[1]
    return suffix if suffix in SOURCE_SUFFIXES else None


def expand_sources(paths: Iterable) -> list:
    """Files named, and the supported files under directories named (recursive,
    sorted, hidden entries skipped), without duplicates, in order."""
    out, seen = [], set()
    for p in map(Path, paths):
        if not p.exists():
            raise CorpusError(f"{p}: no such source file or directory")
        if p.is_dir():
            found = []
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                found += [Path(root) / f for f in sorted(files)
                          if not f.startswith(".") and source_kind(Path(f))]
            files = found
        elif source_kind(p) is None:
            raise CorpusError(f"{p}: unsupported source type (expected "
                              f"{', '.join(SOURCE_SUFFIXES)} or one of these .gz)")
        else:
            files = [p]
        for f in files:
            key = str(f.resolve())
            if key not in seen:
                seen.add(key)
                out.append(f)
    return out


def _open(path: Path):
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def encode_source(path: Path, field: str = "text") -> Iterator[tuple]:
    """(ids, n_docs) pieces of a source, in order. A text file is one document;
    a .jsonl file one document per record (its ``field``). Empty documents are
    skipped. Raises CorpusError naming the file (and line) on bad input."""
    kind = source_kind(path)
    try:
        with _open(path) as f:
            if kind == ".jsonl":
                yield from _encode_jsonl(path, f, field)
                return
            data = f.read(WHOLE_LIMIT + 1)
            if len(data) <= WHOLE_LIMIT:
                if data:
                    yield encode_bytes(data, np.uint16), 1
                return
            enc = StreamEncoder()
            while data:
                yield enc.feed(data), 0
                data = f.read(BLOCK)
            yield enc.finish(), 1
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise CorpusError(f"{path}: corrupt gzip data ({e})") from None
    except OSError as e:
        raise CorpusError(f"{path}: {e.strerror or e}") from None


def _encode_jsonl(path: Path, f, field: str) -> Iterator[tuple]:
    batch, size = [], 0
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise CorpusError(f"{path}:{lineno}: not a JSON line ({e})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get(field), str):
            raise CorpusError(f"{path}:{lineno}: expected an object with a string "
                              f"{field!r} field")
        text = rec[field].encode("utf-8", "surrogatepass")
        if text:
            batch.append(text)
            size += len(text)
        if size >= BATCH_BYTES:
            yield encode_batch(batch), len(batch)
            batch, size = [], 0
    if batch:
        yield encode_batch(batch), len(batch)


def _fresh_index() -> dict:
    return {"format": FORMAT, "version": FORMAT_VERSION, "dtype": "<u2", "vocab": VOCAB,
            "n_ids": 0, "n_docs": 0, "n_text_bytes": 0,
            "boundaries": {NAMES[b]: 0 for b in BOUNDARIES}, "sources": []}


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _progress(total: int, enabled: bool, desc: str):
    from tqdm import tqdm   # loaded only when a corpus is built
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def build_corpus(sources: Sequence, out, *, field: str = "text", force: bool = False,
                 progress: bool = True, log: Callable[[str], None] = None) -> dict:
    """Encode ``sources`` (files or directories) into the corpus ``out`` (.u16 or
    .i16) and its index ``out.json``; appends to an existing corpus, skipping
    sources already in its index (``force``: rebuild from scratch). Returns the
    index."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    out = Path(out)
    if out.suffix.lower() not in OUT_SUFFIXES:
        raise CorpusError(f"{out}: the output must end in .u16 or .i16")
    files = expand_sources(sources)
    ip = index_path(out)
    index = None if force else read_index(out)
    if index is None:
        if out.exists() and not force:
            raise CorpusError(f"{out}: exists without an index {ip.name}; refusing to "
                              "append to it (use --force to rebuild)")
        index = _fresh_index()
    elif not out.exists():
        raise CorpusError(f"{out}: missing, but its index {ip.name} exists "
                          "(use --force to rebuild)")
    new = _new_sources(files, {s["path"]: s for s in index["sources"]}, log, "use --force to rebuild")
    if not new:
        log(f"{out}: up to date ({index['n_ids']} ids, {index['n_docs']} documents)")
        return index
    tmp = out.with_name(out.name + ".tmp")
    keep = index["n_ids"] * 2
    if keep:
        if out.stat().st_size < keep:
            raise CorpusError(f"{out}: shorter than its index says ({out.stat().st_size} "
                              f"bytes, expected {keep}); use --force to rebuild")
        with open(out, "rb") as src, open(tmp, "wb") as dst:
            _copy_prefix(src, dst, keep)
    total = sum(f.stat().st_size for f in new)
    try:
        with open(tmp, "ab" if keep else "wb") as dst, \
                _progress(total, progress, f"encoding {len(new)} files") as bar:
            _encode_into(dst, new, index, field, bar)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)
    _write_json(ip, index)
    log(f"{out}: {index['n_ids']} ids, {index['n_docs']} documents "
        f"({len(new)} sources added)")
    return index


def _new_sources(files: Sequence[Path], known: dict, log, why: str) -> list:
    """The files not among `known` (index entries by absolute path); one whose size or mtime
    changed since it was added is reported, not added again (`why`)."""
    new = []
    for f in files:
        old, st = known.get(str(f.resolve())), f.stat()
        if old is None:
            new.append(f)
        elif (old["size"], old["mtime"]) != (st.st_size, st.st_mtime):
            log(f"warning: {f} changed since it was added; not re-added ({why})")
    return new


def _encode_into(dst, files: Sequence[Path], index: dict, field: str, bar) -> None:
    """Append the ids of `files` to the open file `dst` (synced), recording them in `index`."""
    counts = np.zeros(VOCAB, np.int64)
    for f in files:
        st = f.stat()
        entry = {"path": str(f.resolve()), "size": int(st.st_size),
                 "mtime": float(st.st_mtime), "offset": index["n_ids"],
                 "n_ids": 0, "n_docs": 0}
        for ids, docs in encode_source(f, field):
            dst.write(ids.astype("<u2", copy=False).tobytes())
            counts += np.bincount(ids, minlength=VOCAB)
            entry["n_ids"] += int(ids.size)
            entry["n_docs"] += docs
        index["n_ids"] += entry["n_ids"]
        index["n_docs"] += entry["n_docs"]
        index["sources"].append(entry)
        bar.update(st.st_size)
    dst.flush()
    os.fsync(dst.fileno())
    index["n_text_bytes"] += int(counts[:256].sum())
    for b in BOUNDARIES:
        index["boundaries"][NAMES[b]] += int(counts[b])


SHARD_PREFIX = "shard-"
SHARD_BYTES = 256 << 20   # source bytes per shard written by build_shards


def shard_number(path: Path) -> Optional[int]:
    """N of a shard `shard-N.u16` that build_shards wrote, else None."""
    stem = path.name[:-len(".u16")] if path.name.endswith(".u16") else ""
    digits = stem[len(SHARD_PREFIX):]
    return int(digits) if stem.startswith(SHARD_PREFIX) and digits.isdigit() else None


def build_shards(sources: Sequence, out_dir, *, field: str = "text", shard_bytes: int = SHARD_BYTES,
                 progress: bool = True, log: Callable[[str], None] = None) -> list[Path]:
    """Encode the ``sources`` not yet in the directory ``out_dir`` into new shards after its
    last one (``shard-000000.u16``, ``shard-000001.u16``, ...: sorted by name, they are the
    stream in build order, so a run reading the directory takes them in as appended text),
    about ``shard_bytes`` of source text each. Each shard is written whole to ``.tmp``, its
    index ``.u16.json`` written, then the shard renamed into place: a shard file exists only
    complete and indexed. A build killed before a rename leaves a ``.tmp`` and perhaps an
    index with no shard: both are removed by the next build, which encodes their sources
    again. Returns the new shards."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise CorpusError(f"{out_dir}: exists and is not a directory")
    if shard_bytes <= 0:
        raise CorpusError(f"shard size must be positive, got {shard_bytes}")
    files = expand_sources(sources)
    out_dir.mkdir(parents=True, exist_ok=True)
    known, last = {}, -1
    for p in sorted(out_dir.iterdir()):
        if p.name.startswith(SHARD_PREFIX) and p.name.endswith(".tmp"):
            p.unlink()   # a shard or index being written when a build stopped
            continue
        if p.name.endswith(".json") and shard_number(p.with_name(p.name[:-5])) is not None \
                and not p.with_name(p.name[:-5]).exists():
            p.unlink()   # an index whose shard was never renamed into place
            continue
        n = shard_number(p)
        if n is None:
            continue
        last = max(last, n)
        index = read_index(p)
        if index is None:
            raise CorpusError(f"{p}: a shard without its index {index_path(p).name}; move it away "
                              "to encode its sources again")
        open_corpus(p)   # the shard agrees with its index
        known.update({s["path"]: s for s in index["sources"]})
    new = _new_sources(files, known, log, "a shard, once written, never changes")
    if not new:
        log(f"{out_dir}: up to date ({last + 1} shards)")
        return []
    groups, size = [[]], 0
    for f in new:
        if groups[-1] and size + f.stat().st_size > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(f)
        size += f.stat().st_size
    written = []
    with _progress(sum(f.stat().st_size for f in new), progress, f"encoding {len(new)} files") as bar:
        for files_k in groups:
            last += 1
            shard = out_dir / f"{SHARD_PREFIX}{last:06d}.u16"
            tmp = shard.with_name(shard.name + ".tmp")
            index = _fresh_index()
            try:
                with open(tmp, "wb") as dst:
                    _encode_into(dst, files_k, index, field, bar)
                _write_json(index_path(shard), index)
                os.replace(tmp, shard)
            except BaseException:
                tmp.unlink(missing_ok=True)
                index_path(shard).unlink(missing_ok=True)
                raise
            written.append(shard)
    _sync_dir(out_dir)
    log(f"{out_dir}: {len(written)} shards added ({len(new)} sources), {last + 1} in all")
    return written


def _sync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _copy_prefix(src, dst, nbytes: int) -> None:
    left = nbytes
    while left:
        buf = src.read(min(left, 16 << 20))
        if not buf:
            raise CorpusError(f"{src.name}: ended early while copying")
        dst.write(buf)
        left -= len(buf)


def default_sources(max_bytes: int = 32 << 20) -> list:
    """Text every Python install ships: the standard library's ``.py`` files and
    any ``.txt``/``.md`` docs under it (site-packages skipped), sorted by path,
    UTF-8 text only (test data that is not text is skipped), until ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    candidates = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip and not d.startswith(".")]
        candidates += [Path(dirpath) / n for n in files if Path(n).suffix in TEXT_SUFFIXES]
    candidates.sort(key=lambda p: p.relative_to(root).as_posix())
    picked, total = [], 0
    for p in candidates:
        if total >= max_bytes:
            break
        if p.is_symlink() or not p.is_file():
            continue
        try:
            data = p.read_bytes()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if data and b"\0" not in data:
            picked.append((p, len(data)))
            total += len(data)
    return picked


def build_default_corpus(cache_dir, max_bytes: int = 32 << 20, progress: bool = True) -> Path:
    """An Atom corpus of the standard library's own text (no download), built once
    into ``cache_dir`` and reused: its name carries a key of the Python version,
    the chosen files (path and size) and ``max_bytes``. Deterministic."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    picked = default_sources(max_bytes)
    if not picked:
        raise CorpusError(f"{sysconfig.get_paths()['stdlib']}: no standard-library text found")
    root = Path(sysconfig.get_paths()["stdlib"])
    desc = {"python": sys.version, "format": FORMAT_VERSION, "max_bytes": max_bytes,
            "files": [[str(p.relative_to(root)), n] for p, n in picked]}
    key = hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]
    out = cache / f"stdlib-py{sys.version_info[0]}{sys.version_info[1]}-{key}.u16"
    # One builder at a time: the processes of a run started together on one machine (or two
    # runs) would otherwise write the same FILE.tmp at once. The others wait, then reuse it.
    with open(cache / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if open_corpus(out).n_ids > 0 and read_index(out) is not None:
                return out
        except CorpusError:
            pass
        build_corpus([p for p, _ in picked], out, force=True, progress=progress,
                     log=(lambda m: print(m, file=sys.stderr)) if progress else (lambda m: None))
    return out
