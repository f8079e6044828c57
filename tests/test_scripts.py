"""scripts/: the metrics plot."""
import json
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
