"""A corpus of shards: a directory, a glob or a list file read as one stream with no copy,
recorded shard by shard; shards added after the last are taken in at the next pass, and a
shard that changed, vanished or was inserted before others is refused, naming it."""
import json

import jax
import numpy as np
import pytest

from fractus_jax.atom import build as build_lib
from fractus_jax.atom.__main__ import main as atom_main
from fractus_jax.atom.corpus import CorpusError, JoinedIds, build_corpus, build_shards, open_corpus
from fractus_jax.lanes import LaneReader
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import prepare as prepare_lib
from fractus_jax.train.errors import TrainError
from test_corpus_growth import metrics, params_at, tiny, train

N_SHARDS = 120


def write_shards(folder, ids, cuts, name="part-{:04d}.u16"):
    """ids cut at `cuts` into shards named in stream order; returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, piece in enumerate(np.split(ids, cuts)):
        path = folder / name.format(k)
        piece.astype("<u2").tofile(path)
        paths.append(path)
    return paths


def random_cuts(rng, n, count):
    """count - 1 cut points in 0..n, with repeats (empty shards) and both ends."""
    cuts = np.sort(rng.integers(0, n + 1, count - 3))
    return np.concatenate([[0], cuts, [n]])


@pytest.fixture
def stream(tmp_path):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, 30_000).astype(np.int64)
    ids[rng.random(ids.size) < 0.2] = 259   # boundaries, so the stats see packets
    one = tmp_path / "one.u16"
    ids.astype("<u2").tofile(one)
    write_shards(tmp_path / "shards", ids, random_cuts(rng, ids.size, N_SHARDS))
    return ids, one, tmp_path / "shards"


def test_shards_read_as_the_one_file_of_their_ids(stream, tmp_path):
    ids, one, folder = stream
    (tmp_path / "all.list").write_text("# the shards, in order\n" + "\n".join(
        f"shards/{p.name}" for p in sorted(folder.iterdir())) + "\n")
    for spec in (folder, str(folder / "part-*.u16"), tmp_path / "all.list"):
        c = open_corpus(spec)
        assert len(c.shards) == N_SHARDS and c.n_ids == ids.size
        rng = np.random.default_rng(1)
        for start in [0, ids.size - 5, ids.size, *rng.integers(0, ids.size, 50)]:
            n = int(rng.integers(0, 3000))
            np.testing.assert_array_equal(np.asarray(c.ids[start:start + n]), ids[start:start + n])
            np.testing.assert_array_equal(c.read(int(start), n), ids[start:start + n])
        assert c.stats() == {**open_corpus(one).stats(), "path": str(spec), "shards": N_SHARDS}
        assert np.concatenate([x for _, x in c.chunks(777)]).tolist() == ids.tolist()


def test_lanes_over_shards_and_their_held_out_end_equal_the_one_files(stream):
    ids, one, folder = stream
    for val_fraction in (0.0, 0.07):
        (train_a, val_a), (train_b, val_b) = (prepare_lib.split_corpus(open_corpus(p), val_fraction)
                                              for p in (one, folder))
        assert train_a.n_ids == train_b.n_ids
        if val_fraction:
            np.testing.assert_array_equal(np.asarray(val_b.ids), np.asarray(val_a.ids))
            # the held-out range in the middle of a grown stream: the lanes read around it
            train_a, train_b = (prepare_lib.TrainPart(t.corpus, t.n_ids - 4000, (t.n_ids - 9000, t.n_ids - 5000))
                                for t in (train_a, train_b))
        a, b = (LaneReader(t.ids, 8, 16, accum=2) for t in (train_a, train_b))
        pos = 0
        for _ in range(a.lane_len // 32 + 3):   # through a wrap
            (xa, pa, ca), (xb, pb, cb) = a.read(pos, left=5), b.read(pos, left=5)
            np.testing.assert_array_equal(xa, xb)
            np.testing.assert_array_equal(ca, cb)
            assert pa == pb
            pos = pa


def test_joined_ids_slices_nest_without_copies():
    a, b, c = np.arange(10), np.arange(10, 15), np.arange(15, 40)
    j = JoinedIds([a, JoinedIds([b, np.arange(0)]), c])
    whole = np.arange(40)
    assert len(j.pieces) == 3 and len(j) == 40
    for s in range(0, 41, 3):
        for e in range(s, 41, 4):
            np.testing.assert_array_equal(np.asarray(j[s:e]), whole[s:e])
            np.testing.assert_array_equal(np.asarray(j[s:e][1:-1]), whole[s:e][1:-1])
    assert np.shares_memory(j[11:14], b)   # a slice inside one piece is that piece's view
    with pytest.raises(TypeError):
        j[::2]


def test_a_grown_shard_set_continues_its_record_and_a_changed_one_is_named(stream, tmp_path):
    ids, one, folder = stream
    record = open_corpus(folder).identity()
    names = [s["name"] for s in record["shards"]]
    assert len(names) == N_SHARDS and names == sorted(names)
    assert all(set(s) == {"name", "n_ids", "size", "mtime", "sha256"} for s in record["shards"])
    assert open_corpus(folder).prefix_change(record) is None
    # shards after the last, and text appended to the last: the same stream, grown
    (folder / "part-9000.u16").write_bytes(np.arange(7, dtype="<u2").tobytes())
    with open(folder / names[-1], "ab") as f:
        f.write(np.arange(3, dtype="<u2").tobytes())
    assert open_corpus(folder).prefix_change(record) is None
    # a shard inserted before the last one read
    (folder / "part-0000b.u16").write_bytes(np.arange(7, dtype="<u2").tobytes())
    why = open_corpus(folder).prefix_change(record)
    assert "part-0000b.u16" in why and "sort before" in why
    (folder / "part-0000b.u16").unlink()
    # a shard whose ids changed (same length)
    k = next(i for i, s in enumerate(record["shards"][:-1]) if s["n_ids"] > 0)
    changed = np.fromfile(folder / names[k], "<u2")
    changed[0] ^= 1
    changed.tofile(folder / names[k])
    why = open_corpus(folder).prefix_change(record)
    assert names[k] in why and "ids differ" in why
    # a shard that vanished
    (folder / names[k]).unlink()
    why = open_corpus(folder).prefix_change(record)
    assert names[k] in why and "gone" in why
    # one file is not a shard set's record, nor the reverse
    assert "shards" in open_corpus(one).prefix_change(record)
    assert "one file" in open_corpus(folder).prefix_change(open_corpus(one).identity())


def test_bad_shard_sets_are_refused_naming_the_file(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="empty: a directory with no corpus file"):
        open_corpus(tmp_path / "empty")
    with pytest.raises(CorpusError, match="no corpus file .* matches"):
        open_corpus(tmp_path / "nothing" / "*.u16")
    (tmp_path / "s").mkdir()
    np.arange(5, dtype="<u2").tofile(tmp_path / "s" / "a.u16")
    (tmp_path / "s" / "b.u16").write_bytes(b"\0\0\0")   # an odd length: cut off
    with pytest.raises(CorpusError, match=r"b\.u16: 3 bytes is not a whole number"):
        open_corpus(tmp_path / "s")
    (tmp_path / "s" / "b.u16").write_bytes(np.array([1, 256], "<u2").tobytes())
    with pytest.raises(CorpusError, match=r"b\.u16: id 256 at offset 1 is PAD"):
        open_corpus(tmp_path / "s").validate()
    (tmp_path / "twice.list").write_text("s/a.u16\ns/a.u16\n")
    with pytest.raises(CorpusError, match=r"twice\.list, line 2: s/a\.u16 is listed twice"):
        open_corpus(tmp_path / "twice.list")
    (tmp_path / "missing.list").write_text("s/a.u16\ns/zzz.u16\n")
    with pytest.raises(CorpusError, match=r"zzz\.u16: no such corpus file"):
        open_corpus(tmp_path / "missing.list")
    # the command line: exit 2, the file named, no traceback
    assert atom_main(["validate", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert "b.u16: id 256 at offset 1" in err and "Traceback" not in err
    (tmp_path / "s" / "b.u16").unlink()
    assert atom_main(["validate", str(tmp_path / "s")]) == 0
    assert "ok, 5 ids in 1 shards" in capsys.readouterr().out
    assert atom_main(["stats", "--json", str(tmp_path / "s")]) == 0
    assert json.loads(capsys.readouterr().out)["shards"] == 1


TEXTS = ["def add(x, y):\n    return x + y\n", "The lanes are cut again when they wrap.\n",
         "import os\nprint(os.getcwd())\n", "# a comment\n" * 3, "Shards grow by new files.\n"]


def test_build_writes_new_sources_as_new_shards_after_the_last(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    files = []
    for k, text in enumerate(TEXTS):
        files.append(src / f"{k}.txt")
        files[-1].write_text(text * 20)
    quiet = dict(progress=False, log=lambda m: None)
    first = build_shards(files[:3], tmp_path / "out", shard_bytes=1500, **quiet)
    assert [p.name for p in first] == ["shard-000000.u16", "shard-000001.u16"]
    assert build_shards(files[:3], tmp_path / "out", **quiet) == []   # up to date
    record = open_corpus(tmp_path / "out").identity()
    # a build killed inside the next shard leaves the shards before it whole, no partial shard
    calls = []

    def dies_on_the_second_file(path, field="text"):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        yield from build_lib.encode_source.__wrapped__(path, field)

    real = build_lib.encode_source
    dies_on_the_second_file.__wrapped__ = real
    build_lib.encode_source = dies_on_the_second_file
    try:
        with pytest.raises(KeyboardInterrupt):
            build_shards(files, tmp_path / "out", shard_bytes=1, **quiet)
    finally:
        build_lib.encode_source = real
    after_kill = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert not any(n.endswith(".tmp") for n in after_kill)
    assert open_corpus(tmp_path / "out").prefix_change(record) is None
    # the next build finishes the job: the stream is the one file of all sources in order
    build_shards(files, tmp_path / "out", shard_bytes=1, **quiet)
    one = build_corpus(files, tmp_path / "one.u16", **quiet)
    got = open_corpus(tmp_path / "out")
    assert open_corpus(tmp_path / "out").prefix_change(record) is None
    np.testing.assert_array_equal(np.asarray(got.ids), np.asarray(open_corpus(tmp_path / "one.u16").ids))
    assert got.n_ids == one["n_ids"] and [c.path.name for c in got.shards[2:]] == ["shard-000002.u16", "shard-000003.u16"]


def test_the_trainer_reads_a_shard_directory_as_the_one_file_and_takes_new_shards_in(tmp_path):
    # ~200 ids of text in 101 shards (tiny: 4 lanes x 16, 3 steps a pass), then more shards
    a = build_corpus([_text(tmp_path, "a.txt", "def add(x, y):\n    return x + y\n\n" * 4)], tmp_path / "a.u16", progress=False, log=lambda m: None)
    ids_a = np.asarray(open_corpus(tmp_path / "a.u16").ids)
    rng = np.random.default_rng(2)
    folder = tmp_path / "shards"
    write_shards(folder, ids_a, random_cuts(rng, ids_a.size, 101))
    cfg_file, cfg_dir = tiny(tmp_path / "a.u16", "max_steps=7", "save_every=3"), tiny(folder, "max_steps=7", "save_every=3")
    assert prepare_lib.steps_per_pass(a["n_ids"], cfg_dir) == 3
    train(cfg_file, tmp_path / "file")
    train(tiny(folder, "max_steps=2", "save_every=2"), tmp_path / "dir")
    # while the run is stopped, more text arrives as new shards after the last
    ids_b = np.asarray(open_corpus(build_corpus([_text(tmp_path, "b.txt", TEXTS[1] * 10)], tmp_path / "b.u16",
                                                progress=False, log=lambda m: None) and tmp_path / "b.u16").ids)
    write_shards(folder, ids_b, [ids_b.size // 2], name="part-9{:03d}.u16")
    logs = []
    train(cfg_dir, tmp_path / "dir", log=logs.append)
    # the pass under way ends as on the one file, bit-exact; then the lanes are cut anew
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
                 params_at(tmp_path / "dir", cfg_dir, 3), params_at(tmp_path / "file", cfg_file, 3))
    by_file, by_dir = metrics(tmp_path / "file"), metrics(tmp_path / "dir")
    assert [m["ce_tf"] for m in by_dir[:3]] == [m["ce_tf"] for m in by_file[:3]]
    n_ab = ids_a.size + ids_b.size
    assert any(f"the lanes are cut over {n_ab} ids" in line for line in logs), logs
    manifest = ckpt_lib.read_manifest(tmp_path / "dir")
    assert len(manifest["corpus"]["shards"]) == 103 and manifest["corpus"]["n_ids"] == n_ab
    # a shard inserted before the last one read: refused, naming it, nothing written
    (folder / "part-0000a.u16").write_bytes(np.array([5, 6], "<u2").tobytes())
    before = sorted(p.name for p in (tmp_path / "dir").rglob("*"))
    with pytest.raises(TrainError, match=r"part-0000a\.u16 \(a shard may only be added after"):
        prepare_lib.prepare(tiny(folder, "max_steps=9"), tmp_path / "dir", progress=False)
    assert sorted(p.name for p in (tmp_path / "dir").rglob("*")) == before


def _text(folder, name, text):
    path = folder / name
    path.write_text(text)
    return path
