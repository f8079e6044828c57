"""The GPU's and TPU's programs, checked on this CPU: atom_1b's sharded train step on an
8-device mesh (bfloat16, remat, kernels "auto"), its decode loop and its held-out scorer,
lowered by `jax.export` for CUDA and for TPU (fractus_jax/train/lowering.py), against what
docs/engine.md and docs/sharding.md promise: the state donated, no host callbacks, the plain
kernel forms chosen for the platform lowered for, bfloat16 products with float32 sums, and
each leaf's sharding. Each check has a control that it catches."""
import re

import pytest

from fractus_jax.train import config as cfg_lib
from fractus_jax.train import lowering

PLATFORMS = ("cuda", "tpu")
# atom_1b as the main job runs it: one host of 8 GPUs, fsdp over them (its config holds
# bfloat16 and remat; kernels stay "auto", resolved for the platform lowered for).
MAIN_JOB = ["mesh.data=1", "mesh.fsdp=8"]
FSDP = '{"fsdp"}'
ROWS = '{"data", "fsdp"}'


def atom_1b(*more):
    return cfg_lib.apply_overrides(cfg_lib.load_config("atom_1b"), [*MAIN_JOB, *more])


@pytest.fixture(scope="module")
def steps():
    """{platform: the parsed train step}, and the CPU's for the controls."""
    return {p: lowering.parse(lowering.train_step(atom_1b(), p)) for p in (*PLATFORMS, "cpu")}


def _dims(argument):
    """The per-dimension mesh axes of an argument's sharding: ['{}', '{"fsdp"}', ...]."""
    return re.findall(r"\{[^}]*\}", argument.sharding)


def _by_name(module, pattern):
    found = [a for a in module.arguments if re.search(pattern, a.name)]
    assert found, pattern
    return found


def _plain_forms(module) -> bool:
    """The plain kernels compute sin and cos as operations; the CPU forms (kernels/trig.py)
    as polynomials, with no sine in the program."""
    return {"sine", "cosine"} <= module.ops


@pytest.mark.devices(8)
@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_main_jobs_step_donates_its_state_and_calls_no_host(steps, platform):
    m = steps[platform]
    state = [a for a in m.arguments if a.name.startswith("state")]
    batch = [a for a in m.arguments if a.name.startswith("batch")]
    assert len(state) > 80 and batch
    assert all(a.donated for a in state), [a.name for a in state if not a.donated]
    assert not any(a.donated for a in batch)
    assert not [c for c in m.custom_calls if "callback" in c.lower()], m.custom_calls
    assert _plain_forms(m), "the CPU kernel forms in a program lowered for " + platform
    # the control: lowered for the CPU, "auto" takes the CPU forms
    assert not _plain_forms(steps["cpu"])


@pytest.mark.devices(8)
@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_main_jobs_products_are_bfloat16_with_float32_sums(steps, platform):
    """docs/engine.md, Numerics: every product with a weight has bfloat16 operands and a
    float32 result; the MoE combine over the K = 2 chosen experts is the one bfloat16 sum."""
    m = steps[platform]
    low = [(ins, out) for ins, out in m.products if "bf16" in ins]
    combine = [(ins, out) for ins, out in low if "x2xbf16>" in ins + out]
    weights = [d for d in low if d not in combine]
    assert len(weights) >= 18 and len(combine) == 3, (len(weights), combine)
    assert all(ins.count("bf16") == 2 for ins, _ in low)
    assert all(out.endswith("xf32>") for _, out in weights), [d for d in weights if not d[1].endswith("xf32>")]
    # the control: in float32 no product is bfloat16
    f32 = lowering.parse(lowering.train_step(atom_1b("execution.compute_dtype=float32"), platform))
    assert not [d for d in f32.products if "bf16" in "".join(d)]


@pytest.mark.devices(8)
@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_main_jobs_shardings_are_the_documented_ones(steps, platform):
    """docs/sharding.md: rows (the batch and every carried leaf) over data × fsdp; the big
    matrices' d_model dimension and every MoE tensor's expert axis over fsdp; each optimizer
    moment sharded as its parameter; what is small replicated."""
    m = steps[platform]
    ids, = _by_name(m, r"^batch\['ids'\]$")
    assert _dims(ids) == ["{}", ROWS, "{}"]                       # (accum, rows, C + 1)
    # (the carried phase is not an input: the next chunk does not read it, docs/spec.md §4)
    for leaf, row_axis in (("thought", 0), ("S", 1), ("z", 1)):
        carry, = _by_name(m, rf"^state\['carry'\]\['{leaf}'\]$")
        assert _dims(carry)[row_axis] == ROWS, (leaf, carry.sharding)
    expected = {r"\['observe'\]$": ["{}", FSDP],                  # (vocab, d_model)
                r"\['blocks'\]\['attn'\]\['w_qkv'\]$": ["{}", "{}", FSDP, "{}"],
                r"\['blocks'\]\['attn'\]\['w_out'\]$": ["{}", FSDP, "{}"],
                r"\['blocks'\]\['moe'\]\['U1'\]$": ["{}", FSDP, "{}", "{}"],
                r"\['blocks'\]\['moe'\]\['V2'\]$": ["{}", FSDP, "{}", "{}"],
                r"\['blocks'\]\['moe'\]\['b2'\]$": ["{}", FSDP, "{}"],
                r"\['blocks'\]\['norm_attn'\]\['weight'\]$": ["{}", "{}"]}
    for pattern, dims in expected.items():
        found = _by_name(m, pattern)
        params = [a for a in found if a.name.startswith("state['params']")]
        moments = [a for a in found if ".mu[" in a.name or ".nu[" in a.name]
        assert len(params) == 1 and len(moments) == 2, (pattern, [a.name for a in found])
        for a in (*params, *moments):
            assert _dims(a) == dims, (a.name, a.sharding, dims)
    # the control: on 2 x 4 the rows still span both axes, the weights only fsdp
    other = lowering.parse(lowering.train_step(atom_1b("mesh.data=2", "mesh.fsdp=4"), platform))
    w_out = next(a for a in other.arguments if a.name == "state['params']['blocks']['attn']['w_out']")
    ids2 = next(a for a in other.arguments if a.name == "batch['ids']")
    assert _dims(w_out) == ["{}", FSDP, "{}"] and _dims(ids2) == ["{}", ROWS, "{}"]
    assert steps["cpu"].arguments and all(a.sharding == b.sharding for a, b in zip(m.arguments, steps["cpu"].arguments))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_decode_loop_and_the_scorer_lower_with_the_plain_forms_and_no_host_calls(platform):
    cfg = atom_1b()
    for name, program in (("decode", lowering.decode_loop), ("scorer", lowering.scorer)):
        m = lowering.parse(program(cfg, platform))
        assert m.products and not [c for c in m.custom_calls if "callback" in c.lower()], (name, m.custom_calls)
        assert _plain_forms(m), (name, platform)
        if name == "decode":
            assert "while" in m.ops          # the whole loop is one program: no host round trip per id
    assert not _plain_forms(lowering.parse(lowering.scorer(cfg, "cpu")))   # the control
