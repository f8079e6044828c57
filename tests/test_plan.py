"""Planning a run, without training: the held-out split and the checks a resume must pass
(a config that cannot continue the checkpoint is refused with the field named)."""
import numpy as np
import pytest

from fractus_jax.atom.corpus import open_corpus
from fractus_jax.train import config as cfg_lib
from fractus_jax.train import plan as plan_lib
from fractus_jax.train.errors import TrainError


def tiny(*overrides):
    return cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), list(overrides))


def write_ids(path, ids):
    np.asarray(ids, "<u2").tofile(path)
    return open_corpus(path)


def test_the_held_out_part_is_the_corpus_end(tmp_path):
    corpus = write_ids(tmp_path / "c.u16", np.arange(1001) % 250)
    train, val = plan_lib.split_corpus(corpus, 0.1)
    assert (train.n_ids, train.held) == (901, (901, 1001)) and (val.start, val.n_ids) == (901, 100)
    np.testing.assert_array_equal(train.ids, corpus.ids[:901])
    np.testing.assert_array_equal(val.ids, corpus.ids[901:])
    assert val.describe() == {"path": str((tmp_path / "c.u16").resolve()), "start": 901, "n_ids": 100}
    train, val = plan_lib.split_corpus(corpus, 0.0)
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
])
def test_a_resume_that_would_change_the_run_is_refused(overrides, words, tmp_path):
    cfg = tiny()
    plan_lib.check_resume(cfg, tmp_path, manifest_of(cfg))   # the same config continues
    with pytest.raises(TrainError) as e:
        plan_lib.check_resume(tiny(*overrides), tmp_path, manifest_of(cfg))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_a_run_from_before_held_out_splits_held_out_nothing(tmp_path):
    cfg = tiny()
    old = manifest_of(cfg)
    del old["config"]["val_fraction"]
    plan_lib.check_resume(cfg, tmp_path, old)
    with pytest.raises(TrainError, match=r"a run from before held-out splits"):
        plan_lib.check_resume(tiny("val_fraction=0.1"), tmp_path, old)
