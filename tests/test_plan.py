"""Planning a run, without training: the held-out split and the checks a resume must pass
(a config that cannot continue the checkpoint is refused with the field named)."""
import numpy as np
import pytest

from fractus_jax.atom.corpus import open_corpus
from fractus_jax.lanes import lane_layout
from fractus_jax.train import config as cfg_lib
from fractus_jax.train import prepare as prepare_lib
from fractus_jax.train.errors import TrainError
from fractus_jax.train.progress import held_out_line


def tiny(*overrides):
    return cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), list(overrides))


def write_ids(path, ids):
    np.asarray(ids, "<u2").tofile(path)
    return open_corpus(path)


def test_the_held_out_part_is_the_corpus_end(tmp_path):
    corpus = write_ids(tmp_path / "c.u16", np.arange(1001) % 250)
    train, val = prepare_lib.split_corpus(corpus, 0.1)
    assert (train.n_ids, train.held) == (901, (901, 1001)) and (val.start, val.n_ids) == (901, 100)
    np.testing.assert_array_equal(train.ids, corpus.ids[:901])
    np.testing.assert_array_equal(val.ids, corpus.ids[901:])
    assert val.describe() == {"path": str((tmp_path / "c.u16").resolve()), "start": 901, "n_ids": 100}
    train, val = prepare_lib.split_corpus(corpus, 0.0)
    assert train.n_ids == 1001 and train.held is None and val is None


def manifest_of(cfg, **changes):
    meta = {"step": 6, "start_token_next": 96, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
            "accum": cfg.accum, "config": cfg.to_dict()}
    meta.update(changes)
    return meta


@pytest.mark.parametrize("overrides, words", [
    (["batch_size=8"], ["batch_size was 4 and is now 8"]),
    (["seq_len=32"], ["seq_len was 16 and is now 32"]),
    (["model.n_layers=3"], ["the model differs", "n_layers"]),
    (["val_fraction=0.1"], ["val_fraction was 0 and is now 0.1"]),
    (["start_token=0"], ["start_token=0 would restart the data", "resume at 96"]),
    (["model.carry_decay=0.9,0.96", "model.learn_carry_decay=true"],
     ["learn_carry_decay was false and is now true", "holds no attn.decay_logit"]),
])
def test_a_resume_that_would_change_the_run_is_refused(overrides, words, tmp_path):
    cfg = tiny()
    prepare_lib.check_resume(cfg, tmp_path, manifest_of(cfg))   # the same config continues
    with pytest.raises(TrainError) as e:
        prepare_lib.check_resume(tiny(*overrides), tmp_path, manifest_of(cfg))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_a_run_from_before_held_out_splits_held_out_nothing(tmp_path):
    cfg = tiny()
    old = manifest_of(cfg)
    del old["config"]["val_fraction"]
    prepare_lib.check_resume(cfg, tmp_path, old)
    with pytest.raises(TrainError, match=r"a run from before held-out splits"):
        prepare_lib.check_resume(tiny("val_fraction=0.1"), tmp_path, old)


def test_a_run_that_held_out_nothing_keeps_its_lanes_under_a_config_that_holds_out(tmp_path):
    # atom_1b's config holds out a part since runs began that held out none: such a run
    # resumed with the config file keeps its lanes over the whole corpus and scores nothing
    cfg = tiny()
    old = manifest_of(cfg)
    del old["config"]["val_fraction"]   # a run from before held-out splits
    holds_out = tiny("val_fraction=0.01", "eval_every=3")
    for manifest in (old, manifest_of(cfg)):
        kept, note = prepare_lib.keep_no_split(holds_out, tmp_path, manifest)
        assert (kept.val_fraction, kept.eval_every) == (0.0, 0) and "began without a held-out part" in note
        assert "val_fraction=0.01 is not applied" in note and "scores nothing" in note
        prepare_lib.check_resume(kept, tmp_path, manifest)
        # a val_corpus still scores; a val_fraction the user sets is refused, as any change of the lanes
        kept, _ = prepare_lib.keep_no_split(tiny("val_corpus=held.u16", "eval_every=3"), tmp_path, manifest)
        assert kept.eval_every == 3
        same, note = prepare_lib.keep_no_split(holds_out, tmp_path, manifest, explicit={"val_fraction"})
        assert same is holds_out and note is None
        with pytest.raises(TrainError, match="val_fraction was 0"):
            prepare_lib.check_resume(same, tmp_path, manifest)
    # a run that held out a part keeps it
    split = tiny("val_fraction=0.01")
    assert prepare_lib.keep_no_split(holds_out, tmp_path, manifest_of(split)) == (holds_out, None)
    assert cfg_lib.override_fields(["val_fraction=0.1", "BATCH=8", "model.n_layers = 3"]) >= {
        "val_fraction", "model.n_layers"}


@pytest.mark.parametrize("name", ["atom_1b", "parent_1b"])
def test_the_main_jobs_hold_out_a_slice_and_score_it(name):
    cfg = cfg_lib.load_config(name)
    assert 0 < cfg.val_fraction <= 0.01 and cfg.eval_every > 0 and not cfg.conflicts()
    lane_len, n_chunks = lane_layout(cfg.val_ids, cfg.val_lanes, cfg.seq_len)
    assert n_chunks * cfg.seq_len * cfg.val_lanes >= cfg.val_ids // 2


def test_the_progress_shows_the_held_out_figures():
    line = held_out_line({"step": 1000, "val_ce": 1.0, "val_bpb": 2.5, "val_bpb_warm": 2.25,
                          "val_bpb_no_carry": 3.0, "val_ce_warm": 0.9, "val_ce_no_carry": 1.2})
    assert line == "step 1000: held-out val_bpb 2.5000 (the carry as trained), warm 2.2500, fresh 3.0000"
    assert held_out_line({"step": 5, "val_ce": 4.0, "val_bpb": None}) == \
        "step 5: held-out val_ce 4.0000 (the carry as trained)"
