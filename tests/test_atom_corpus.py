"""Atom corpora: the builder (incremental, atomic), the memory-mapped reader and
its validation, the default stdlib corpus, and the command line."""
import fcntl
import gzip
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fractus_jax import atom
from fractus_jax.atom import build as B
from fractus_jax.atom import stream
from fractus_jax.atom.__main__ import main
from fractus_jax.atom.corpus import (
    CorpusError, build_corpus, build_default_corpus, index_path, open_corpus,
)

ROOT = Path(__file__).resolve().parents[1]


def quiet(msg):
    pass


def make_sources(d: Path):
    (d / "docs").mkdir(parents=True)
    (d / "docs" / "a.txt").write_text("Bonjour, le monde 2026!\n", "utf-8")
    (d / "docs" / "b.md").write_bytes(b"# Title\r\n\tcaf\xc3\xa9 \xff raw\n")
    (d / "docs" / "c.py").write_text("def f(x):\n    return x + 1\n", "utf-8")
    (d / "docs" / "skip.bin").write_bytes(b"\x00\x01")  # not a source type: skipped
    (d / "docs" / "empty.txt").write_text("")  # no document
    with open(d / "docs" / "d.jsonl", "w") as f:
        f.write(json.dumps({"text": "first record"}) + "\n\n")
        f.write(json.dumps({"text": "second 😀", "id": 2}) + "\n")
    with gzip.open(d / "docs" / "e.txt.gz", "wb") as f:
        f.write("gzipped text 42\n".encode())


def expected_ids(d: Path):
    docs = [(d / "docs" / "a.txt").read_bytes(), (d / "docs" / "b.md").read_bytes(),
            (d / "docs" / "c.py").read_bytes(), "first record".encode(),
            "second 😀".encode(), b"gzipped text 42\n"]
    return np.concatenate([atom.encode_bytes(x) for x in docs])


def test_build_read_validate_stats(tmp_path):
    make_sources(tmp_path)
    out = tmp_path / "c.u16"
    index = build_corpus([tmp_path / "docs"], out, progress=False, log=quiet)
    c = open_corpus(out)
    assert c.ids.tolist() == expected_ids(tmp_path).tolist()
    assert out.stat().st_size == 2 * len(c)
    assert np.fromfile(out, "<u2").tolist() == c.ids.tolist()  # little-endian uint16
    assert index["n_docs"] == 6 and index["n_ids"] == len(c) == c.n_ids
    assert index["version"] == 1 and index["format"] == "fractus-atom-corpus"
    assert [Path(s["path"]).name for s in index["sources"]] == [
        "a.txt", "b.md", "c.py", "d.jsonl", "e.txt.gz", "empty.txt"]
    assert all(set(s) >= {"path", "size", "mtime", "n_ids", "offset"} for s in index["sources"])
    c.validate(chunk=5)
    st = c.stats(chunk=7)
    assert st["n_docs"] == 6 and st["boundaries"] == index["boundaries"]
    assert st["boundaries"]["punctuation"] == int((c.ids == 260).sum())
    assert 0 < st["bytes_per_id"] < 1
    assert json.loads(index_path(out).read_text())["n_ids"] == len(c)


def test_reader_api(tmp_path):
    ids = atom.encode("hello world 123")
    p = tmp_path / "x.u16"
    ids.astype("<u2").tofile(p)
    c = open_corpus(p)
    assert isinstance(c.ids, np.ndarray) and not c.ids.flags.writeable
    with pytest.raises(ValueError):
        c.ids[0] = 1
    part = c.ids[2:6]
    assert isinstance(part, np.ndarray) and part.tolist() == ids[2:6].tolist()
    assert c.read(1, 3).dtype == np.int32 and c.read(1, 3).tolist() == ids[1:4].tolist()
    ident = c.identity()
    assert set(ident) == {"path", "n_ids", "size", "mtime", "sha256"}
    assert ident["n_ids"] == ids.size and ident["size"] == 2 * ids.size
    assert ident["sha256"] == hashlib.sha256(ids.astype("<u2").tobytes()).hexdigest()
    assert c.sha256(0, 3) == [hashlib.sha256(b"").hexdigest(), hashlib.sha256(ids[:3].astype("<u2").tobytes()).hexdigest()]
    assert c.path == p and repr(c).startswith("Corpus(")


@pytest.mark.parametrize("suffix,dtype", [(".i16", "<i2"), (".bin", "<i4"), (".npy", None)])
def test_other_layouts(tmp_path, suffix, dtype):
    ids = atom.encode("other layouts 42")
    p = tmp_path / f"x{suffix}"
    if dtype is None:
        np.save(p, ids.astype(np.int32))
    else:
        ids.astype(dtype).tofile(p)
    c = open_corpus(p)
    c.validate()
    assert c.ids.tolist() == ids.tolist()


def test_validate_names_file_offset_and_value(tmp_path):
    ids = atom.encode("a b c d e f g h").astype(np.int64)
    ids[13] = 300
    p = tmp_path / "bad.u16"
    ids.astype("<u2").tofile(p)
    c = open_corpus(p)
    with pytest.raises(CorpusError, match=r"bad\.u16: id 300 at offset 13") as e:
        c.validate(chunk=4)  # found in a later chunk: offsets are global
    assert isinstance(e.value, ValueError)
    neg = tmp_path / "neg.i16"
    np.array([257, 97, -5, 258], "<i2").tofile(neg)
    with pytest.raises(CorpusError, match="id -5 at offset 2"):
        open_corpus(neg).validate()
    pad = tmp_path / "pad.u16"
    np.array([257, 97, 256, 258], "<u2").tofile(pad)
    with pytest.raises(CorpusError, match="PAD"):
        open_corpus(pad).validate()
    open_corpus(pad).validate(allow_pad=True)
    # another vocab: only the range is checked (PAD is an ordinary id there)
    open_corpus(pad).validate(vocab=300)
    with pytest.raises(CorpusError, match=r"id 300 at offset 13 is outside 0-299"):
        c.validate(chunk=4, vocab=300)
    with pytest.raises(CorpusError, match=r"id 257 at offset 0 is outside 0-99"):
        open_corpus(pad).validate(vocab=100)
    # histogram counts PAD and validates the range in the same pass
    assert open_corpus(pad).histogram(chunk=3)[[97, 256, 257, 258]].tolist() == [1, 1, 1, 1]
    with pytest.raises(CorpusError, match=r"bad\.u16: id 300 at offset 13 is outside the Atom"):
        c.histogram(chunk=4)
    big = tmp_path / "big.npy"  # a dtype np.bincount cannot take as is
    np.save(big, np.array([257, 97, 265, 258], np.uint64))
    assert open_corpus(big).histogram()[[97, 257, 258, 265]].tolist() == [1, 1, 1, 1]


def test_reader_refusals(tmp_path):
    odd = tmp_path / "odd.u16"
    odd.write_bytes(b"\x01\x01\x01")
    with pytest.raises(CorpusError, match="odd.u16.*odd-length"):
        open_corpus(odd)
    with pytest.raises(CorpusError, match="no such corpus file"):
        open_corpus(tmp_path / "missing.u16")
    with pytest.raises(CorpusError, match="unknown corpus extension"):
        open_corpus(tmp_path / "x.txt")
    two_d = tmp_path / "m.npy"
    np.save(two_d, np.zeros((2, 2), np.int32))
    with pytest.raises(CorpusError, match="1-D integer"):
        open_corpus(two_d)
    junk = tmp_path / "j.npy"
    junk.write_bytes(b"not numpy")
    with pytest.raises(CorpusError, match="j.npy"):
        open_corpus(junk)
    short = tmp_path / "s.bin"
    short.write_bytes(b"\x00" * 6)
    with pytest.raises(CorpusError, match="s.bin"):
        open_corpus(short)
    empty = tmp_path / "e.u16"
    empty.write_bytes(b"")
    assert len(open_corpus(empty)) == 0


def test_build_is_incremental(tmp_path):
    make_sources(tmp_path)
    out = tmp_path / "c.u16"
    first = build_corpus([tmp_path / "docs" / "a.txt"], out, progress=False, log=quiet)
    before = open_corpus(out).ids.tolist()
    second = build_corpus([tmp_path / "docs"], out, progress=False, log=quiet)
    after = open_corpus(out).ids.tolist()
    assert after[:len(before)] == before  # appended, the old ids untouched
    assert after == expected_ids(tmp_path).tolist()  # a.txt not added twice
    assert second["n_docs"] == 6 and first["n_docs"] == 1
    mtime = out.stat().st_mtime_ns
    third = build_corpus([tmp_path / "docs"], out, progress=False, log=quiet)
    assert third == second and out.stat().st_mtime_ns == mtime  # nothing to do
    (tmp_path / "docs" / "f.txt").write_text("new file\n")
    fourth = build_corpus([tmp_path / "docs"], out, progress=False, log=quiet)
    assert fourth["n_docs"] == 7
    assert open_corpus(out).ids.tolist() == after + atom.encode("new file\n").tolist()


def test_build_failure_leaves_old_corpus(tmp_path):
    make_sources(tmp_path)
    out = tmp_path / "c.u16"
    build_corpus([tmp_path / "docs" / "a.txt"], out, progress=False, log=quiet)
    old_ids, old_index = out.read_bytes(), index_path(out).read_text()
    (tmp_path / "docs" / "bad.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(CorpusError, match=r"bad\.jsonl:2"):
        build_corpus([tmp_path / "docs"], out, progress=False, log=quiet)
    assert out.read_bytes() == old_ids and index_path(out).read_text() == old_index
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.u16", "c.u16.json", "docs"]


def test_crash_between_data_and_index_is_detected_and_repaired(tmp_path, monkeypatch):
    make_sources(tmp_path)
    out = tmp_path / "c.u16"
    build_corpus([tmp_path / "docs" / "a.txt"], out, progress=False, log=quiet)

    def crash(path, obj):
        raise KeyboardInterrupt("power cut")
    monkeypatch.setattr(B, "_write_json", crash)
    with pytest.raises(KeyboardInterrupt):
        build_corpus([tmp_path / "docs"], out, progress=False, log=quiet)
    monkeypatch.undo()
    with pytest.raises(CorpusError, match="index.*interrupted build"):
        open_corpus(out)  # new ids, old index: does not look whole
    build_corpus([tmp_path / "docs"], out, progress=False, log=quiet)  # repairs
    assert open_corpus(out).ids.tolist() == expected_ids(tmp_path).tolist()


def test_builder_errors(tmp_path):
    make_sources(tmp_path)
    with pytest.raises(CorpusError, match="must end in .u16"):
        build_corpus([tmp_path / "docs"], tmp_path / "c.bin", progress=False, log=quiet)
    with pytest.raises(CorpusError, match="nope.txt: no such source"):
        build_corpus([tmp_path / "nope.txt"], tmp_path / "c.u16", progress=False, log=quiet)
    with pytest.raises(CorpusError, match="skip.bin: unsupported source type"):
        build_corpus([tmp_path / "docs" / "skip.bin"], tmp_path / "c.u16", progress=False,
                     log=quiet)
    bad_gz = tmp_path / "bad.txt.gz"
    bad_gz.write_bytes(gzip.compress(b"hello world " * 100)[:-30])
    with pytest.raises(CorpusError, match="bad.txt.gz: corrupt gzip"):
        build_corpus([bad_gz], tmp_path / "c.u16", progress=False, log=quiet)
    not_gz = tmp_path / "fake.md.gz"
    not_gz.write_bytes(b"plain text")
    with pytest.raises(CorpusError, match="fake.md.gz"):
        build_corpus([not_gz], tmp_path / "c.u16", progress=False, log=quiet)
    nofield = tmp_path / "n.jsonl"
    nofield.write_text('{"body": "x"}\n')
    with pytest.raises(CorpusError, match=r"n\.jsonl:1: expected an object"):
        build_corpus([nofield], tmp_path / "c.u16", progress=False, log=quiet)
    assert not (tmp_path / "c.u16").exists()
    stray = tmp_path / "stray.u16"
    stray.write_bytes(b"\x01\x01")
    with pytest.raises(CorpusError, match="without an index"):
        build_corpus([tmp_path / "docs"], stray, progress=False, log=quiet)


def test_large_file_is_streamed(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "WHOLE_LIMIT", 1000)
    monkeypatch.setattr(B, "BLOCK", 777)
    text = ("Un texte long, écrit 12345 fois sans fin; " * 300 + "x" * 70 + "中" * 50).encode()
    src = tmp_path / "big.txt"
    src.write_bytes(text)
    out = tmp_path / "big.i16"
    build_corpus([src], out, progress=False, log=quiet)
    assert open_corpus(out).ids.tolist() == atom.encode_bytes(text).tolist()


def test_default_corpus_is_cached_and_deterministic(tmp_path):
    a = build_default_corpus(tmp_path / "a", max_bytes=400_000, progress=False)
    b = build_default_corpus(tmp_path / "b", max_bytes=400_000, progress=False)
    assert a.name == b.name and a.read_bytes() == b.read_bytes()
    c = open_corpus(a)
    c.validate()
    assert len(c) > 400_000 and c.stats()["n_docs"] == c.index["n_docs"] > 1
    mtime = a.stat().st_mtime_ns
    assert build_default_corpus(tmp_path / "a", max_bytes=400_000, progress=False) == a
    assert a.stat().st_mtime_ns == mtime  # reused, not rebuilt
    paths = [s["path"] for s in c.index["sources"]]
    assert paths == sorted(paths) and len(paths) > 1
    assert not any("site-packages" in p for p in paths)


def test_default_corpus_builders_take_turns(tmp_path):
    """Processes that start together on a fresh cache (a run's processes on one machine)
    build the default corpus one at a time: while one holds the cache's lock, another
    writes nothing, then reuses the finished corpus."""
    cache = tmp_path / "cache"
    want = build_default_corpus(tmp_path / "fresh", max_bytes=400_000, progress=False)
    cache.mkdir()
    code = ("import sys; from fractus_jax.atom.corpus import build_default_corpus; "
            "print(build_default_corpus(sys.argv[1], max_bytes=400_000, progress=False))")
    with open(cache / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        child = subprocess.Popen([sys.executable, "-c", code, str(cache)], stdout=subprocess.PIPE, text=True)
        time.sleep(3)
        assert child.poll() is None and sorted(p.name for p in cache.iterdir()) == [".lock"]
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0 and Path(out.strip()).name == want.name
    assert Path(out.strip()).read_bytes() == want.read_bytes()


def test_cli_commands(tmp_path, capsys):
    make_sources(tmp_path)
    out = tmp_path / "c.u16"
    assert main(["build", "--src", str(tmp_path / "docs"), "--out", str(out), "--quiet"]) == 0
    assert main(["stats", str(out), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["n_docs"] == 6
    assert main(["decode", str(out), "--offset", "0", "--count", "32"]) == 0
    assert capsys.readouterr().out == "Bonjour, le monde 2026!\n\n"
    assert main(["decode", str(out), "--offset", "0", "--count", "4", "--markers"]) == 0
    assert capsys.readouterr().out == "⟨BOS⟩Bon\n"
    assert main(["validate", str(out)]) == 0
    assert main(["encode", "abc123def"]) == 0
    assert capsys.readouterr().out.split()[-4:] == ["101", "102", "264", "258"]
    bad = tmp_path / "bad.u16"
    np.array([257, 300], "<u2").tofile(bad)
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "id 300 at offset 1" in err and str(bad) in err


def test_cli_build_field_and_encode_open(tmp_path, capsys):
    """`build --field NAME` reads that field of each .jsonl record (a record without it is
    refused, naming the file); `encode --open` prints the open (prompt) form: no EOS after
    the text, and the last packet left open."""
    src = tmp_path / "docs.jsonl"
    src.write_text(json.dumps({"body": "Hello world", "text": "other"}) + "\n" + json.dumps({"body": "Bye"}) + "\n")
    out = tmp_path / "c.u16"
    assert main(["build", "--src", str(src), "--out", str(out), "--field", "body", "--quiet"]) == 0
    capsys.readouterr()
    ids = np.fromfile(out, "<u2")
    assert stream.decode(ids) == "Hello worldBye"                   # the body fields, not "text"
    assert ids.tolist() == stream.encode("Hello world").tolist() + stream.encode("Bye").tolist()
    assert main(["build", "--src", str(src), "--out", str(tmp_path / "d.u16"), "--field", "title", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"{src}:1:" in err and "'title'" in err
    assert main(["encode", "abc123def", "--open"]) == 0
    opened = [int(x) for x in capsys.readouterr().out.split()]
    assert opened == stream.encode_open("abc123def").tolist() == [257, 97, 98, 99, 262, 49, 50, 51, 262, 100, 101, 102]
    assert main(["encode", "abc123def"]) == 0
    assert [int(x) for x in capsys.readouterr().out.split()][-2:] == [264, 258]   # closed: a boundary, then EOS


def test_cli_subprocess_no_traceback(tmp_path):
    odd = tmp_path / "odd.u16"
    odd.write_bytes(b"\x00\x01\x02")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "fractus_jax.atom", "stats", str(odd)],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and str(odd) in r.stderr
    assert "Traceback" not in r.stderr


def test_bench_reports_speed(capsys):
    from fractus_jax.atom.bench import bench_encode, sample_text
    res = bench_encode(mb=0.3, json=True, repeat=1)
    printed = json.loads(capsys.readouterr().out)
    assert printed == res and res["bulk_mb_s"] > 0 and res["docs_mb_s"] > 0
    assert 1.0 < res["ids_per_byte"] < 2.0
    assert sample_text(0.1) == sample_text(0.1)
