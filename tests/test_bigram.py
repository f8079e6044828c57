"""The bigram count baseline (fractus_jax.bigram): counts, the formula, the denominator."""
import json
import math

import numpy as np
import pytest

from fractus_jax import bigram
from fractus_jax.atom import encode
from fractus_jax.atom.ids import BOS, EOS, VOCAB
from fractus_jax.eval.bigram.__main__ import main as bigram_cli
from fractus_jax.lanes import lane_targets


def test_counts_every_adjacent_pair_once_across_blocks():
    ids = np.array([1, 2, 1, 2, 1, 3, 0, 1], np.uint16)
    counts = bigram.fit(ids, 4, block=3)   # pairs straddle the blocks
    want = np.zeros((4, 4), np.int64)
    for a, b in zip(ids[:-1], ids[1:]):
        want[a, b] += 1
    np.testing.assert_array_equal(counts, want)
    np.testing.assert_array_equal(bigram.fit(ids, 4), want)
    assert counts.sum() == len(ids) - 1
    with pytest.raises(ValueError, match="outside"):
        bigram.fit(np.array([0, 5]), 4)


def test_the_held_out_score_is_add_alpha_nats_over_the_byte_ids():
    train = encode("é日é日 abc")
    counts = bigram.fit(train, VOCAB)
    # "é" is 2 UTF-8 bytes and "日" 3: five byte ids; BOS, the boundary and EOS count none.
    held = np.array([BOS, 0xC3, 0xA9, 260, 0xE6, 0x97, 0xA5, EOS], np.int32)
    out = bigram.score(counts, held, lanes=1, chunk=7, alpha=0.5)
    assert out["n_ids"] == 7 and out["n_bytes"] == 5
    row = counts.sum(1)
    want = -sum(math.log((counts[a, b] + 0.5) / (row[a] + 0.5 * VOCAB)) for a, b in zip(held[:-1], held[1:]))
    assert out["nats"] == pytest.approx(want, rel=1e-12)
    assert out["bpb"] == pytest.approx(want / math.log(2) / 5, rel=1e-12)
    assert out["ce"] == pytest.approx(want / 7, rel=1e-12)
    assert counts[0xC3, 0xA9] == 2 and counts[0xA5, EOS] == 0   # seen and unseen pairs both scored


def test_lanes_score_the_targets_eval_scores():
    ids = np.arange(2 * 11) % VOCAB
    prev, targets = bigram.lane_pairs(ids, lanes=2, chunk=4)
    np.testing.assert_array_equal(targets, lane_targets(ids, 2, 4))
    np.testing.assert_array_equal(prev[:, 1:], targets[:, :-1])
    np.testing.assert_array_equal(prev[:, 0], [0, 11])    # each lane's first id


def test_the_command_scores_the_configs_held_out_slice(corpus_file, capsys):
    sets = ["--set", f"corpus={corpus_file}", "--set", "val_fraction=0.1", "--set", "val_ids=600",
            "--set", "val_lanes=2", "--set", "seq_len=32"]
    assert bigram_cli(["--config", "tiny", *sets, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ids = np.fromfile(corpus_file, "<u2")
    n_val = int(len(ids) * 0.1)
    counts = bigram.fit(ids[:len(ids) - n_val], VOCAB)
    want = bigram.score(counts, ids[len(ids) - n_val:][:600], 2, 32)
    assert out["nats"] == pytest.approx(want["nats"], rel=1e-12) and out["n_bytes"] == want["n_bytes"]
    assert 0 < out["bpb"] < 8   # the sources' bigrams beat a uniform byte
    assert bigram_cli(["--config", "tiny", "--set", f"corpus={corpus_file}", "--json"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert bigram_cli(["--config", "tiny", *sets, "--alpha", "0"]) == 2
