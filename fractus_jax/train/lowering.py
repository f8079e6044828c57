"""The main job's programs lowered for a platform this process need not have (`jax.export`):
the sharded train step, the decode loop and the held-out scorer, on abstract arrays
(nothing is allocated, no device of that platform is needed). A CPU machine lowers the
GPU's programs this way, so what a GPU would run is checked where no GPU is
(tests/test_lowering.py): "auto" kernels are resolved for the platform lowered for
(`Execution.for_platform`), not for this process's backend.

`parse(exported)` reads back what the checks need from the module's text: each argument's
name, sharding and donation, each product's operand and result types, and custom calls.
"""
from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import export

from fractus_jax import decode, model, sharding
from fractus_jax.scoring import score_chunk
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import state as state_lib
from fractus_jax.train.config import TrainConfig, resolve_for_mesh
from fractus_jax.train.step import abstract_batch, batch_shardings, jit_train_step


def for_platform(cfg: TrainConfig, platform: str) -> TrainConfig:
    """cfg as a `platform` machine runs it: the mesh's dispatch slices, "auto" kernels resolved."""
    cfg = resolve_for_mesh(cfg)
    return dataclasses.replace(cfg, execution=cfg.execution.for_platform(platform))


def train_step(cfg: TrainConfig, platform: str) -> export.Exported:
    """The trainer's step (shardings on cfg's mesh, the state donated) lowered for `platform`."""
    cfg = for_platform(cfg, platform)
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
    abstract = state_lib.abstract_train_state(cfg)
    shardings = state_lib.train_state_shardings(cfg, mesh, abstract)
    batch_shard = batch_shardings(cfg, mesh)
    step = jit_train_step(cfg, shardings, batch_shard)
    return export.export(step, platforms=(platform,))(ckpt_lib.abstract_with_shardings(abstract, shardings),
                                                      abstract_batch(cfg, batch_shard))


def _abstract_params(cfg: TrainConfig):
    return jax.eval_shape(lambda: model.init_params(cfg.model, jax.random.PRNGKey(0)))


def decode_loop(cfg: TrainConfig, platform: str, rows: int = 1, prompt_len: int = 16, max_new: int = 64,
                mode: str = "step") -> export.Exported:
    """`decode.decode_ids` (the whole loop, sampled at temperature 0.8) lowered for `platform`."""
    ex = for_platform(cfg, platform).execution.for_inference()
    prompt = jax.ShapeDtypeStruct((rows, prompt_len), jnp.int32)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    return export.export(decode.decode_ids, platforms=(platform,))(
        _abstract_params(cfg), cfg.model.for_inference(), prompt, max_new, mode, cfg.seq_len, 0.8, 0, key, ex=ex)


def scorer(cfg: TrainConfig, platform: str) -> export.Exported:
    """`eval.score_chunk` (one chunk of the held-out lanes, the carry streamed and from zero)
    lowered for `platform`, at cfg's val_lanes and seq_len."""
    ex = for_platform(cfg, platform).execution.for_inference()
    engine = cfg.model.for_inference()
    B, C = cfg.val_lanes, cfg.seq_len
    carry = jax.eval_shape(lambda: model.init_state(engine, B))
    feats = (jax.ShapeDtypeStruct((B, C, engine.atom_feat_dim), jnp.float32) if cfg.feats else None)
    return export.export(score_chunk, platforms=(platform,))(
        _abstract_params(cfg), carry, jax.ShapeDtypeStruct((B,), jnp.bool_),
        jax.ShapeDtypeStruct((B, C + 1), jnp.int32), feats, engine, ex=ex)


class Argument(NamedTuple):
    name: str            # the argument's path, as jax names it ("state['params']['observe']")
    type: str            # "tensor<16x1280xf32>"
    sharding: str        # the Shardy annotation, "[{}, {\"fsdp\"}]", or "" when none
    donated: bool        # aliased to an output (updated in place)


class Module(NamedTuple):
    arguments: list[Argument]
    products: list[tuple[str, str]]     # (operand types, result type) of every dot_general
    custom_calls: set[str]              # custom-call targets
    ops: set[str]                       # the StableHLO operations used


def dot_products(text: str) -> list[tuple[str, str]]:
    """(operand types, result type) of every stablehlo.dot_general in a StableHLO text."""
    return [m.groups() for m in re.finditer(r"stablehlo\.dot_general.*?:\s*\((.*?)\)\s*->\s*(tensor<[^>]*>)", text)]


def parse(exported: export.Exported) -> Module:
    """What a check reads from an exported program's StableHLO text."""
    text = exported.mlir_module()
    main = text[text.index("func.func public @main("):]
    signature = main[:main.index("\n")]
    signature = signature[:signature.index(") -> (")] if ") -> (" in signature else signature
    arguments = []
    for piece in re.split(r"%arg\d+: ", signature)[1:]:
        typ = re.match(r"tensor<[^>]*>", piece)
        shard = re.search(r"#sdy\.sharding<@\w+, (\[[^>]*\])>", piece)
        name = re.search(r'loc\("([^"]*)"\)', piece)
        arguments.append(Argument(name.group(1) if name else "", typ.group(0) if typ else "",
                                  shard.group(1) if shard else "", "tf.aliasing_output" in piece))
    return Module(arguments, dot_products(text), set(re.findall(r"custom_call @([\w.]+)", text)),
                  set(re.findall(r"stablehlo\.(\w+)", text)))
