"""scripts/: the metrics plot and the GPU check."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_plot_metrics_draws_a_png_and_names_bad_input(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"step": s, "ce_tf": 5.6 - 0.1 * s, "ema_tf": 5.6 - 0.05 * s, "ids_per_s_tf": 1000.0 + s,
             "ids_per_s_wall": 900.0 + s, "lb": 0.5, "keep_rate": 0.8} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    script = str(ROOT / "scripts" / "plot_metrics.py")
    out = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    png = tmp_path / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
    out = subprocess.run([sys.executable, script, str(tmp_path / "bad")], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "metrics.jsonl:2" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, script, str(tmp_path / "nope")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "error:" in out.stderr


def test_gpu_check_runs_end_to_end_on_a_cpu_with_the_tiny_config(tmp_path):
    """The GPU script has never had a GPU: its wiring (plan → batch → train → profile →
    attention, the files it brings back) is checked here so the first GPU minutes count."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "CONFIG": "tiny", "BATCHES": "8 4", "STEPS": "2",
           "ATTN_BATCH": "1", "ATTN_IMPLS": "chunkwise", "GPU_CHECK_INSTALL": "0",
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"), "XLA_FLAGS": ""}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    files = sorted(p.name for p in out.iterdir())
    assert files == ["attention.json", "env.json", "log.txt", "plans.jsonl", "profile.json",
                     "raw.tgz", "train.json"], files
    assert len(files) <= 8          # the device tool brings back 8 files at most
    plans = [json.loads(line) for line in (out / "plans.jsonl").read_text().splitlines()]
    assert len(plans) == 1 and plans[0]["per_device"]["total_bytes"] > 0   # CPU: the first batch is taken
    train = json.loads((out / "train.json").read_text())
    assert train["ids_per_s"] > 0 and train["ids_per_step"] == 8 * 16
    profile = json.loads((out / "profile.json").read_text())
    assert "attention" in profile["components"]
    assert json.loads((out / "attention.json").read_text())["ms"]["chunkwise"] > 0


def test_gpu_check_keeps_to_its_time_budget(tmp_path):
    """With no time left every step is cut short, and the script still ends cleanly with
    what it has: the environment, the log and the raw outputs."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "CONFIG": "tiny", "BATCHES": "4", "BUDGET_S": "0",
           "GPU_CHECK_INSTALL": "0", "XLA_FLAGS": ""}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    files = {p.name for p in out.iterdir()}
    assert {"env.json", "log.txt", "raw.tgz"} <= files
    assert "train.json" not in files and "profile.json" not in files   # cut at 1 s: no result
