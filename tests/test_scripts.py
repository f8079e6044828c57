"""scripts/: the metrics plot, the GPU check, the dispatch table and the store-fault timer."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine_testing import SUBPROCESS_XLA_FLAGS

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


@pytest.mark.slow
def test_gpu_check_runs_end_to_end_on_a_cpu_with_the_tiny_config(tmp_path):
    """The GPU script's wiring (plan → batch → train → profile → attention, the files it
    writes) checked on a CPU, so that a first GPU run only measures."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "CONFIG": "tiny", "BATCHES": "8 4", "STEPS": "2",
           "ATTN_BATCH": "1", "ATTN_IMPLS": "chunkwise", "DISPATCH_CONFIG": "tiny", "GPU_CHECK_INSTALL": "0",
           # a CPU shared with other tests: every step may take 4× its GPU limit, within 15 minutes
           "LIMIT_SCALE": "4", "BUDGET_S": "900", "XLA_FLAGS": SUBPROCESS_XLA_FLAGS}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    files = sorted(p.name for p in out.iterdir())
    assert files == ["attention.json", "dispatch.json", "env.json", "log.txt", "plans.jsonl", "profile.json",
                     "raw.tgz", "train.json"], files
    plans = [json.loads(line) for line in (out / "plans.jsonl").read_text().splitlines()]
    assert len(plans) == 1 and plans[0]["per_device"]["total_bytes"] > 0   # CPU: the first batch is taken
    train = json.loads((out / "train.json").read_text())
    assert train["ids_per_s"] > 0 and train["ids_per_step"] == 8 * 16
    profile = json.loads((out / "profile.json").read_text())
    assert "attention" in profile["components"]
    assert json.loads((out / "attention.json").read_text())["ms"]["chunkwise"] > 0
    dispatch = json.loads((out / "dispatch.json").read_text())
    # tiny's E/K is 4: that capacity is timed once
    assert [d["dispatch"] for d in dispatch] == ["dropless (config)", "cf=E/K = cf=4", "cf=1.25"]
    assert all(d["ms_per_step"] > 0 for d in dispatch) and dispatch[0]["keep_rate"] == 1.0


def test_gpu_check_keeps_to_its_time_budget(tmp_path):
    """With no time left no step after the environment's starts, and the script still ends
    cleanly with what it has: the environment, the log and the raw outputs."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "CONFIG": "tiny", "BATCHES": "4", "BUDGET_S": "0",
           "GPU_CHECK_INSTALL": "0", "XLA_FLAGS": SUBPROCESS_XLA_FLAGS}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    files = {p.name for p in out.iterdir()}
    assert {"env.json", "log.txt", "raw.tgz"} <= files
    assert "train.json" not in files and "profile.json" not in files
    assert "plan at batch 4 failed: not started: BUDGET_S (0 s) is spent" in (out / "log.txt").read_text()


def _plot_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("plot_metrics", ROOT / "scripts" / "plot_metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plot_puts_the_probes_on_their_own_panels(tmp_path):
    """ar_ce (7-60 nats) beside the training CE (5.6 -> 3.2) would flatten the learning curve."""
    pytest.importorskip("matplotlib")
    rows = [{"step": 0, "init_ce": 5.6, "init_echo": 0.0, "ar_ce": 7.0, "ar_match": 0.0,
             "speech_unique_ids": 1, "speech_unique_bytes": 1, "lb_per_block": [0.5, 0.6]}]
    rows += [{"step": s, "ce_tf": 5.6 - 0.04 * s, "ema_tf": 5.6 - 0.02 * s, "ids_per_s_tf": 4000.0,
              "ids_per_s_wall": 4000.0, "lb": 0.5, "keep_rate": 0.8} for s in range(5, 65, 5)]
    rows[6].update(probe_ce=4.3, probe_echo=0.2, ar_ce=16.0, ar_match=0.2, speech_unique_ids=3, speech_unique_bytes=1)
    rows[12].update(probe_ce=3.6, probe_echo=0.25, ar_ce=60.0, ar_match=0.15, speech_unique_ids=2,
                    speech_unique_bytes=1, val_ce=3.4, val_bpb=3.9)
    legends = _plot_module().plot(rows, tmp_path / "m.png", "run")
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
    training = " ".join(legends["training"])
    assert "ce_tf" in training and "val_ce" in training and "val_bpb" in training
    assert "ar_ce" not in training and "probe_ce" not in training
    probe = " ".join(legends["probe_ce"])
    assert "ar_ce" in probe and "probe_ce" in probe and "init_ce" in probe
    assert "speech unique bytes" in " ".join(legends["speech"]) and "ar_match" in " ".join(legends["probe_rates"])
    # a run without probes: no probe panels
    legends = _plot_module().plot([r for r in rows if "ce_tf" in r and "ar_ce" not in r], tmp_path / "n.png", "run")
    assert list(legends) == ["training", "speed", "balance"]


def test_plot_without_matplotlib_names_the_extra(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "ce_tf": 5.0}) + "\n")
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "scripts" / "plot_metrics.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert 'pip install -e ".[plot]"' in out.stderr and not (tmp_path / "metrics.png").exists()
    # the extras' lists as pyproject.toml writes them (read by hand: tomllib is Python >= 3.11)
    text = (ROOT / "pyproject.toml").read_text()
    extras = {m.group(1): m.group(2) for m in re.finditer(r"(?m)^(\w+) = \[([^\]]*)\]", text)}
    assert '"matplotlib' in extras["plot"] and '"matplotlib' in extras["dev"], extras


def test_dispatch_table_trains_each_choice_and_prints_their_rows(corpus_file, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("dispatch_table", ROOT / "scripts" / "dispatch_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    sets = [f"corpus={corpus_file}", "val_fraction=0.1", "val_ids=600", "val_lanes=2"]
    assert table.main(["--config", "tiny", "--steps", "3", "--json"] + [a for s in sets for a in ("--set", s)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(" | ")[0] for ln in lines[3:7]] == ["| dropless", "| cf = 4", "| cf = 1.25", "| bigram counts "
                                                        "(add-one) of the training ids"], lines
    runs = json.loads(lines[-1])["runs"]
    assert [(r["dispatch"], r["steps"]) for r in runs] == [("dropless", 3), ("cf = 4", 3), ("cf = 1.25", 3)]
    keep = [r["keep_rate"] for r in runs]
    assert keep[0] == 1.0 and keep[2] < 1.0 and keep[2] <= keep[1], keep
    assert all(0 < r["val_bpb"] < 20 for r in runs)
    assert table.main(["--config", "tiny", "--steps", "1", "--set", f"corpus={corpus_file}"]) == 2
    assert "--steps must be >= 2" in capsys.readouterr().err


def test_store_faults_times_a_transfer_held_by_a_silent_store(tmp_path):
    """The fault timer's wiring (a local S3 server, the relay, the transfer in its thread, the
    line it prints) on a store that stops reading, given 3 s: the transfer is still held."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "store_faults.py"), "--scheme", "s3", "--fault",
                          "deaf", "--mib", "16", "--give-up", "3"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "s3 put, deaf: still waiting after 3 s\n", out.stdout


def test_store_faults_follows_a_run_upload_through_a_store_down_for_a_while(tmp_path):
    """--op upload: a step's upload as the trainer makes it, the store refusing connections for
    40 s from the step's first byte (well past one try's own retries: 7 s on an idle machine,
    over 10 s on a loaded one): the lines say a try failed, that the store is back, and that a
    later try committed the step."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "store_faults.py"), "--scheme", "s3", "--fault",
                          "cut", "--op", "upload", "--down", "40", "--mib", "1"], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = [re.sub(r"^ *\d+\.\d s  ", "", line) for line in out.stdout.splitlines()]
    lines = [line for line in lines if not line.startswith("waiting for the upload")]   # each 10 s of a try
    assert lines[0] == "the store cut: lifted in 40 s", lines
    assert lines[1].startswith("warning: the upload of step 1 to s3://faults/run failed ("), lines
    assert "the store is back" in lines, lines
    assert re.fullmatch(r"note: step 1 is uploaded to s3://faults/run \(try [2-9]\)", lines[-2]), lines
    assert lines[-1] == "step 1 committed: True", lines
