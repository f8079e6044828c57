"""The benchmark CLI runs and reports what it promises (no speed is asserted: timings vary)."""
import json

import pytest

from fractus_jax.bench.__main__ import main


def test_attention_bench_reports_json(capsys):
    rc = main(["attention", "--batch", "1", "--repeats", "1",
               "--impl", "chunkwise", "--impl", "position_scan", "--json"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["default"] == "chunkwise"
    assert set(result["ms"]) == {"chunkwise", "position_scan"}
    assert all(ms > 0 for ms in result["ms"].values())
    assert result["batch"] == 1 and result["shape"]["G"] == 40
    assert result["speedup_vs_torch_einsum"] == {}          # torch_einsum was not asked for
    # Both kernels computed the same loss on the same inputs (float32 rounding apart).
    losses = result["loss"]
    assert losses["chunkwise"] == pytest.approx(losses["position_scan"], rel=1e-4)
    assert any("chunkwise" in line for line in lines[:-1])   # the readable table came first


def test_dispatcher_rejects_an_unknown_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        main(["no-such-benchmark"])
    assert e.value.code != 0
    assert "attention" in capsys.readouterr().err
