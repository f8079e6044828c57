"""A corpus that grows under a run: the builder appends, the run resumes where it stopped
(bit-exact to the end of its pass) and its lanes are cut over the grown corpus at the next
pass; a corpus whose existing ids changed is refused; the held-out range stays put."""
import json
import os

import jax
import numpy as np
import pytest

from fractus_jax.atom.corpus import build_corpus, open_corpus
from fractus_jax.eval.__main__ import _UserError, held_out_ids
from fractus_jax.eval.__main__ import main as eval_main
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import config as cfg_lib
from fractus_jax.train import loop
from fractus_jax.train import prepare as prepare_lib
from fractus_jax.train import state as state_lib
from fractus_jax.train.errors import TrainError

A_TEXT = "def add(x, y):\n    return x + y\n\n" * 4      # ~200 ids: lanes of 3 steps (tiny: 4 x 16)
B_TEXT = "The lanes are cut again when they wrap. " * 8    # ~400 more: lanes of 9 steps


def sources(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(A_TEXT)
    b.write_text(B_TEXT)
    return a, b


def build(srcs, out, force=False):
    build_corpus(srcs, out, force=force, progress=False, log=lambda m: None)
    return out


def tiny(corpus, *overrides):
    return cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), [f"corpus={corpus}", *overrides])


def train(cfg, workdir, log=lambda m: None):
    return loop.run(prepare_lib.prepare(cfg, workdir, progress=False), progress=False, log=log)


def params_at(workdir, cfg, step):
    ck = ckpt_lib.RunCheckpointer(workdir, read_only=True)
    try:
        state, _ = ck.restore(state_lib.abstract_train_state(cfg), step)
    finally:
        ck.close()
    return state["params"]


def assert_same(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def metrics(workdir):
    return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_resumes_across_an_append_and_reads_the_new_text_from_the_next_pass(tmp_path):
    # Every run reads one corpus file, rebuilt or appended to between them: the runs to step
    # 7 share one config, so the trainer compiles their step once.
    a, b = sources(tmp_path)
    grows = build([a], tmp_path / "grows.u16")
    n_a = open_corpus(grows).n_ids
    cfg = tiny(grows, "max_steps=7", "save_every=3")
    assert prepare_lib.steps_per_pass(n_a, cfg) == 3

    # the reference: corpus A throughout
    train(cfg, tmp_path / "straight")
    # two steps on A; B is appended; the same command resumes to step 7
    train(tiny(grows, "max_steps=2", "save_every=2"), tmp_path / "split")
    build([a, b], grows)
    n_ab = open_corpus(grows).n_ids
    assert prepare_lib.steps_per_pass(n_ab, cfg) == 9
    logs = []
    train(cfg, tmp_path / "split", log=logs.append)

    # the pass that was under way ends as it would have on A: bit-exact to its last step
    assert_same(params_at(tmp_path / "split", cfg, 3), params_at(tmp_path / "straight", cfg, 3))
    straight, split = metrics(tmp_path / "straight"), metrics(tmp_path / "split")
    assert [m["ce_tf"] for m in split[:3]] == [m["ce_tf"] for m in straight[:3]]
    # then the lanes are cut over A and B: step 4 reads other ids than A's second pass
    assert split[3]["ce_tf"] != straight[3]["ce_tf"]
    assert any(f"note: pass 1 from step 4: the lanes are cut over {n_ab} ids (the last pass: {n_a}" in line
               for line in logs), logs
    manifest = ckpt_lib.read_manifest(tmp_path / "split")
    assert manifest["passes"] == [{"pass": 0, "first_step": 1, "n_ids": n_a, "corpus_ids": n_a},
                                  {"pass": 1, "first_step": 4, "n_ids": n_ab, "corpus_ids": n_ab}]
    assert manifest["train_ids"] == n_ab and manifest["corpus"]["n_ids"] == n_ab
    assert manifest["corpus"]["sha256"] == open_corpus(grows).identity()["sha256"]
    assert manifest["start_token_next"] == 4 * 16   # steps 4-7 at offsets 0-48 of the longer lanes
    reference = ckpt_lib.read_manifest(tmp_path / "straight")
    assert reference["start_token_next"] == 16 and [p["first_step"] for p in reference["passes"]] == [1, 4, 7]
    assert reference["corpus"]["n_ids"] == n_a

    # a run that lives while the builder appends reads the new text from its next pass too
    build([a], grows, force=True)   # A alone again
    assert open_corpus(grows).n_ids == n_a
    appended = []

    def append_once(_message):
        if not appended:
            appended.append(build([a, b], grows))

    train(cfg, tmp_path / "living", log=append_once)
    assert appended
    assert_same(params_at(tmp_path / "living", cfg, 7), params_at(tmp_path / "split", cfg, 7))
    assert ckpt_lib.read_manifest(tmp_path / "living")["passes"] == manifest["passes"]

    # a corpus whose existing ids changed is refused, naming the file; nothing is written
    build([b, a], grows, force=True)
    before = sorted(p.name for p in (tmp_path / "split").rglob("*"))
    with pytest.raises(TrainError, match=r"split: the corpus is not the one the checkpoint at step 7 trained on.*"
                                         r"grows\.u16: its ids differ from the \d+ recorded"):
        prepare_lib.prepare(tiny(grows, "max_steps=9"), tmp_path / "split", progress=False)
    assert sorted(p.name for p in (tmp_path / "split").rglob("*")) == before


def write_ids(path, ids):
    """Write by rename, as the builder does: a corpus already open keeps the ids it mapped."""
    tmp = path.with_name(path.name + ".tmp")
    np.asarray(ids, "<u2").tofile(tmp)
    os.replace(tmp, path)
    return open_corpus(path)


def test_a_changed_or_shorter_corpus_is_refused_and_an_old_record_resumes_as_before(tmp_path):
    ids = np.arange(400) % 250
    recorded = write_ids(tmp_path / "a.u16", ids).identity()
    manifest = {"step": 5, "corpus": recorded}
    assert set(recorded) == {"path", "n_ids", "size", "mtime", "sha256"}
    prepare_lib.check_corpus(tmp_path, manifest, write_ids(tmp_path / "a.u16", ids))
    prepare_lib.check_corpus(tmp_path, manifest, write_ids(tmp_path / "a.u16", np.r_[ids, [1, 2, 3]]))
    changed = ids.copy()
    changed[7] = 9
    for bad, words in ((np.r_[changed, [1, 2, 3]], "its first 400 ids differ from the 400 recorded"),
                       (changed, "its ids differ from the 400 recorded"),
                       (ids[:-1], "has 399 ids, fewer than the 400 recorded")):
        with pytest.raises(TrainError, match="a.u16") as e:
            prepare_lib.check_corpus(tmp_path, manifest, write_ids(tmp_path / "a.u16", bad))
        assert words in str(e.value) and "step 5" in str(e.value)
    # a record from before corpora could grow (no sha256): its length must match, as it had to
    old = {"step": 5, "corpus": {k: v for k, v in recorded.items() if k != "sha256"}}
    prepare_lib.check_corpus(tmp_path, old, write_ids(tmp_path / "a.u16", ids))
    with pytest.raises(TrainError, match="has 403 ids, the record has 400 and no digest"):
        prepare_lib.check_corpus(tmp_path, old, write_ids(tmp_path / "a.u16", np.r_[ids, [1, 2, 3]]))


def test_the_held_out_range_stays_where_the_run_started_when_the_corpus_grows(tmp_path):
    ids = np.arange(1000) % 250
    corpus = write_ids(tmp_path / "a.u16", ids)
    train, val = prepare_lib.split_corpus(corpus, 0.1)
    assert (train.n_ids, train.held, val.start, val.n_ids) == (900, (900, 1000), 900, 100)
    meta = {"step": 3, "corpus": corpus.identity(), "train_ids": train.n_ids, "held_out": val.describe()}
    grown = write_ids(tmp_path / "a.u16", np.r_[ids, 1000 + np.arange(300) % 10])
    train, val = prepare_lib.resumed_parts(meta, grown, 0.1)
    # the pass under way reads what it read; the held-out ids are the same ones
    assert train.n_ids == 900 and (val.start, val.n_ids) == (900, 100)
    np.testing.assert_array_equal(train.ids, ids[:900])
    np.testing.assert_array_equal(val.ids, ids[900:])
    # the next pass reads the training stream of the grown corpus: around the held-out range
    nxt = prepare_lib.next_pass_part(train, 2000, log=None, reopen=False)
    assert nxt.n_ids == 1200 and nxt.available() == 1200
    lanes = np.asarray(nxt.ids[0:1200])
    np.testing.assert_array_equal(lanes, np.r_[ids[:900], 1000 + np.arange(300) % 10])
    np.testing.assert_array_equal(np.asarray(nxt.ids[890:910]), np.r_[ids[890:900], 1000 + np.arange(10)])
    # a run from before the ranges were recorded held out the end of its corpus as it was
    old = {"step": 3, "corpus": {"n_ids": 1000}, "train_ids": 900}
    train, val = prepare_lib.resumed_parts(old, grown, 0.1)
    assert (train.n_ids, train.held, val.start, val.n_ids) == (900, (900, 1000), 900, 100)


def test_a_new_pass_keeps_the_open_corpus_when_the_file_changed_otherwise(tmp_path):
    ids = np.arange(400) % 250
    train, _ = prepare_lib.split_corpus(write_ids(tmp_path / "a.u16", ids), 0.0)
    logs = []
    assert prepare_lib.next_pass_part(train, 266, logs.append).corpus is train.corpus and not logs   # unchanged
    write_ids(tmp_path / "a.u16", np.r_[ids[::-1], ids])   # rebuilt, not appended to
    nxt = prepare_lib.next_pass_part(train, 266, logs.append)
    assert nxt.corpus is train.corpus and nxt.n_ids == 400
    assert len(logs) == 1 and logs[0].startswith("warning: the next pass reads") and "differ" in logs[0]
    write_ids(tmp_path / "a.u16", np.r_[ids, [300]])   # appended, with an id outside the vocabulary
    nxt = prepare_lib.next_pass_part(train, 266, logs.append)
    assert nxt.n_ids == 400 and "id 300 at offset 400" in logs[-1]
    write_ids(tmp_path / "a.u16", np.r_[ids, [5, 6]])
    nxt = prepare_lib.next_pass_part(train, 266, logs.append)
    assert nxt.n_ids == 402 and nxt.corpus is not train.corpus and len(logs) == 2


def test_eval_scores_the_runs_held_out_range_on_the_grown_corpus(tmp_path):
    ids = np.arange(1000) % 250
    corpus = write_ids(tmp_path / "a.u16", ids)
    train, val = prepare_lib.split_corpus(corpus, 0.1)
    cfg = cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), [f"corpus={tmp_path / 'a.u16'}", "val_fraction=0.1"])
    meta = {"corpus": corpus.identity(), "train_ids": train.n_ids, "held_out": val.describe()}
    write_ids(tmp_path / "a.u16", np.r_[ids, np.arange(500) % 7])
    got, where = held_out_ids(tmp_path, meta, cfg, None)
    np.testing.assert_array_equal(np.asarray(got), ids[900:])
    assert "100 ids held out" in where
    write_ids(tmp_path / "a.u16", np.r_[ids[1:], np.arange(500) % 7])
    with pytest.raises(_UserError, match="its first 1000 ids differ from the 1000 recorded"):
        held_out_ids(tmp_path, meta, cfg, None)


def test_the_eval_command_on_a_grown_corpus_scores_what_the_run_logged(tmp_path, capsys):
    a, b = sources(tmp_path)
    grows = build([a, b], tmp_path / "grows.u16")
    held = ["val_fraction=0.25", "eval_every=2", "val_ids=64", "val_lanes=2"]
    train(tiny(grows, "max_steps=2", "save_every=2", *held), tmp_path / "run")
    logged = [m for m in metrics(tmp_path / "run") if "val_ce" in m][-1]
    start = ckpt_lib.read_manifest(tmp_path / "run")["held_out"]["start"]
    c = tmp_path / "c.txt"
    c.write_text("Appended after the run: its held-out range is now mid-corpus. " * 4)
    build([a, b, c], grows)
    argv = ["--ckpt", str(tmp_path / "run"), "--ids", "64", "--lanes", "2", "--json", "--no-progress"]
    assert eval_main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["step"] == 2
    for key in ("ce", "bpb", "ce_no_carry", "bpb_no_carry"):
        assert abs(out[key] - logged[f"val_{key}"]) <= 1e-5, key
    # the same ids: scoring the new end of the corpus instead gives another CE
    assert start < open_corpus(grows).n_ids * 0.75
    write_ids(tmp_path / "end.u16", np.asarray(open_corpus(grows).ids[-64:]))
    assert eval_main([*argv, "--corpus", str(tmp_path / "end.u16")]) == 0
    assert abs(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ce"] - logged["val_ce"]) > 1e-4
    # an earlier id changed: the held-out range is no longer the run's text
    build([b, a], grows, force=True)
    assert eval_main(argv) == 2
    assert "pass --corpus FILE" in capsys.readouterr().err
