"""The benchmark CLI runs and reports what it promises (no speed is asserted: timings vary)."""
import json

import pytest

from fractus_jax import config, hostmem
from fractus_jax.bench.__main__ import main
from fractus_jax.bench.train import dispatch_choices


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
    # XLA's FLOP count only for the loop-free kernel: a scan's body would be counted once.
    assert set(result["gflop"]) == {"chunkwise"} and result["gflop"]["chunkwise"] > 0
    assert result["flops_per_s"]["chunkwise"] == pytest.approx(
        1e9 * result["gflop"]["chunkwise"] / (result["ms"]["chunkwise"] / 1e3))
    assert result["peak_flops_per_s"] > 0


def test_dispatcher_rejects_an_unknown_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        main(["no-such-benchmark"])
    assert e.value.code != 0
    assert "attention" in capsys.readouterr().err


def test_train_bench_reports_ids_per_s_and_mfu(capsys):
    rc = main(["train", "--config", "tiny", "--steps", "2", "--warmup", "1", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["ids_per_s"] > 0 and r["flops_per_id"] > 0
    assert r["achieved_flops_per_s"] == pytest.approx(r["ids_per_s"] * r["flops_per_id"])
    # CPU devices share the host's cores: the peak is counted once per host.
    assert r["peak_scope"] == "host" and r["peak_units"] == 1
    assert r["peak_flops_per_s"] >= r["peak_median_flops_per_s"] > 0
    assert r["mfu"] == pytest.approx(r["achieved_flops_per_s"] / r["peak_flops_per_s"])
    assert 0 < r["mfu"] < 1
    assert 0 < r["mfu_paired"] < 1
    assert "sampled between the steps" in r["peak_kind"]
    assert r["allocator"] in ("glibc", "tcmalloc", "jemalloc", "mimalloc", "unknown")
    assert r["page_faults_per_step"] >= 0
    assert r["malloc_hugetlb"] is hostmem.hugetlb_tunable()
    assert (r["row_streams"], r["moe_group_rows"]) == (1, 1)    # tiny's schedule, as configured
    assert r["kernels"] == "cpu"                                  # "auto" on a CPU backend


def test_train_bench_times_plain_against_cpu_kernels(capsys):
    rc = main(["train", "--config", "tiny", "--steps", "1", "--warmup", "0", "--kernels", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [k["name"] for k in r["kernel_forms"]] == ["plain", "cpu"]
    assert r["kernel_forms"][0]["ratio"] == 1.0 and all(k["ms_per_step"] > 0 for k in r["kernel_forms"])


def test_paired_mfu_pairs_each_round_with_the_peak_sampled_after_it():
    from fractus_jax.bench.train import ROUND_STEPS, _paired_mfu
    # round 0 in a slow phase (steps 4 s, matmul 2 s), round 1 in a fast one (2 s, 1 s):
    # the ratio is 0.5 in both, whatever the run's best matmul says.
    steps = [4.0] * ROUND_STEPS + [2.0] * ROUND_STEPS
    assert _paired_mfu(steps, [[2.0, 3.0], [1.0, 1.5]], step_flops=1.0, peak_flops=1.0) == pytest.approx(0.5)
    # the samples swapped: ratios 0.25 and 1, median 0.625
    assert _paired_mfu(steps, [[1.0], [2.0]], 1.0, 1.0) == pytest.approx(0.625)
    # a last, shorter round counts (ratios 1 and 2); no rounds gives None
    assert _paired_mfu([1.0] * (ROUND_STEPS + 1), [[1.0], [2.0]], 1.0, 1.0) == pytest.approx(1.5)
    assert _paired_mfu([1.0], [], 1.0, 1.0) is None


def test_profile_classifies_op_sources():
    from fractus_jax.bench.profile import classify
    assert classify("jit(step)/transpose(jvp())/while/body/closed_call/moe/enf,efr->enr/dot_general") == (
        "moe", "backward", "matmul")
    assert classify("jit(step)/jvp()/closed_call/attention/jit(_where)/select_n") == (
        "attention", "forward", "elementwise")
    assert classify("jit(step)/transpose(jvp(loss))/while/body/closed_call/checkpoint/mul") == (
        "loss", "backward", "elementwise")
    # The innermost scope wins; a name merely containing a scope's letters does not count.
    assert classify("jit(step)/jvp()/moe/layernorm/transpose")[0] == "layernorm"
    assert classify("jit(step)/jvp()/moe_extra/add")[0] == "other"
    assert classify("jit(step)/concatenate")[2] == "data movement"


def test_profile_kinds_come_from_the_compiled_opcodes():
    from fractus_jax.bench.profile import classify, instruction_kinds, instruction_sources
    hlo = """HloModule jit_step

%fused_computation.1 (param_0: f32[4,8], param_1: f32[8,2]) -> f32[4,2] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  %param_1 = f32[8,2]{1,0} parameter(1)
  ROOT %dot.9 = f32[4,2]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_computation.2 (param_0.1: f32[4,2]) -> f32[2,4] {
  %param_0.1 = f32[4,2]{1,0} parameter(0)
  %exp.1 = f32[4,2]{1,0} exponential(%param_0.1)
  ROOT %transpose.1 = f32[2,4]{0,1} transpose(%exp.1), dimensions={1,0}
}

ENTRY %main.5 (p0: f32[4,8], p1: f32[8,2]) -> (f32[2,4], f32[8,4]) {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[8,2]{1,0} parameter(1)
  %ynn_fusion = f32[4,2]{1,0} fusion(%p0, %p1), kind=kCustom, calls=%fused_computation.1, metadata={op_name="jit(step)/jvp()/moe/dot_general"}
  %dot.3 = f32[8,4]{1,0} dot(%p1, %ynn_fusion), lhs_contracting_dims={1}, rhs_contracting_dims={1}, metadata={op_name="jit(step)/transpose(jvp())/moe/transpose"}
  %copy_fusion = f32[2,4]{0,1} fusion(%ynn_fusion), kind=kLoop, calls=%fused_computation.2, metadata={op_name="jit(step)/jvp()/moe/exp"}
  ROOT %tuple.4 = (f32[2,4]{0,1}, f32[8,4]{1,0}) tuple(%copy_fusion, %dot.3)
}
"""
    kinds = instruction_kinds(hlo)
    sources = instruction_sources(hlo)
    # JAX names the backward's dot by its transpose rule; the opcode says matmul.
    assert classify(sources["dot.3"])[2] == "data movement"
    assert kinds["dot.3"] == "matmul"
    assert kinds["ynn_fusion"] == "matmul"                 # a fusion wrapping a dot
    assert kinds["copy_fusion"] == "data movement"         # the root of its computation
    assert classify(sources["copy_fusion"])[2] == "elementwise"
    assert kinds["tuple.4"] == "elementwise" and kinds["p0"] == "elementwise"


def test_profile_of_the_train_step_covers_every_component(capsys, tmp_path):
    # A sequence length of its own: an executable of this program cached by an older version
    # (persistent caches key without metadata) cannot stand in for it.
    rc = main(["profile", "--config", "tiny", "--set", "seq_len=24", "--steps", "1", "--warmup", "1", "--json",
               "--trace", str(tmp_path / "trace")])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    r = json.loads(lines[-1])
    # the trace kept: TensorBoard's profile plugin reads the xplane, Perfetto the JSON
    runs = list((tmp_path / "trace" / "plugins" / "profile").iterdir())
    assert len(runs) == 1 and list(runs[0].glob("*.xplane.pb")) and list(runs[0].glob("*.trace.json.gz"))
    assert r["trace"].startswith(str(runs[0])) and any(line.startswith("trace: ") for line in lines)
    parts = r["components"]
    for name in ("attention", "kuramoto", "moe", "layernorm", "loss", "optimizer"):
        assert name in parts, name
    for name in ("attention", "kuramoto", "moe", "layernorm", "loss"):
        assert parts[name]["backward"] > 0, name      # the gradient ran through each
    assert parts["optimizer"]["backward"] == 0
    total = sum(v["forward"] + v["backward"] for v in parts.values())
    assert total == pytest.approx(r["op_ms_per_step"], rel=1e-6)
    assert sum(r["kinds"].values()) == pytest.approx(r["op_ms_per_step"], rel=1e-6)
    assert r["threads_busy"] and all(0 < b <= 1.0 for b in r["threads_busy"])
    assert any(line.startswith("attention") for line in lines[:-1])


def test_profile_counts_a_loop_body_once_not_its_loop_too():
    from fractus_jax.bench.profile import summarize
    sources = {"while.1": "jit(step)/jvp()/while", "fusion.2": "jit(step)/jvp()/attention/mul",
               "dot.3": "jit(step)/transpose(jvp())/moe/dot_general"}
    events = [  # the loop spans its two body operations on thread 7; another op on thread 8
        {"ph": "X", "name": "while.1", "ts": 0, "dur": 100, "pid": 1, "tid": 7},
        {"ph": "X", "name": "fusion.2", "ts": 10, "dur": 30, "pid": 1, "tid": 7},
        {"ph": "X", "name": "fusion.2", "ts": 50, "dur": 40, "pid": 1, "tid": 7},
        {"ph": "X", "name": "dot.3", "ts": 20, "dur": 60, "pid": 1, "tid": 8},
        {"ph": "X", "name": "not-an-instruction", "ts": 0, "dur": 500, "pid": 1, "tid": 7},
    ]
    r = summarize(events, sources, n_steps=1)
    assert r["op_ms_per_step"] == pytest.approx(0.130)       # 30 + 40 + 60 µs
    assert r["components"]["attention"]["forward"] == pytest.approx(0.070)
    assert r["components"]["moe"]["backward"] == pytest.approx(0.060)
    assert "other" not in r["components"]                    # the loop itself is not counted
    assert r["span_ms_per_step"] == pytest.approx(0.080)     # from 10 to 90 µs
    assert sorted(r["threads_busy"]) == pytest.approx([0.75, 70 / 80])


def test_dispatch_choices_that_are_one_setting_are_timed_once():
    assert list(dispatch_choices(config.tiny())) == ["dropless (config)", "cf=E/K = cf=4", "cf=1.25"]   # E/K = 4
    assert list(dispatch_choices(config.tiny(n_experts=16))) == ["dropless (config)", "cf=E/K", "cf=4", "cf=1.25"]
    assert dispatch_choices(config.tiny(capacity_factor=1.25)) == {
        "cf=1.25 (config)": {}, "dropless": {"capacity_factor": None}, "cf=E/K = cf=4": {"capacity_factor": 4.0}}
