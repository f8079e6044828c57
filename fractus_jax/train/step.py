"""One training step, as one jitted function of (state, batch) with the state donated.

A step reads `accum` consecutive chunks per lane, (accum, B, C + 1) ids: inputs are
[:, :, :-1], targets [:, :, 1:]. The carry flows through the chunks; gradients are
averaged over them; one optimizer update follows (skipped, and counted, when the
gradient norm is not finite). With probability ss_rate a scheduled-sampling update
follows: the same chunks from the same starting carry, each input t ≥ 1 replaced with
probability ss_prob(t) by a sample of the teacher-forced prediction at t − 1, loss
0.5·CE + lb_coef·lb, applied to the parameters the first update produced.
A carry-reset schedule (carry_reset_every, carry_reset_prob; `reset_rows`) may first
replace some rows' carry by the initial one, as a BOS at the chunk's first position would.
All randomness derives from (seed, step), so a resumed run draws the same numbers.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from fractus_jax import model, sharding
from fractus_jax.atom.ids import FEAT_DIM
from fractus_jax.kernels.loss import sample_from_hidden
from fractus_jax.train.config import TrainConfig
from fractus_jax.train.objective import train_loss
from fractus_jax.train.state import learning_rate, make_optimizer

METRIC_NAMES = ("ce_tf", "lb", "grad_norm", "lr", "skipped", "keep_rate", "repeat_prob",
                "ce_ss", "ss_ran")


def accumulate(params, carry, inputs_AxBxC, targets_AxBxC, feats_A, cfg: TrainConfig, ce_weight=1.0):
    """Gradients averaged over consecutive chunks, the carry flowing through them.

    One chunk (accum = 1) runs without a loop; several run as one scan from a zero gradient
    sum (0 + g is exact, so the sum is the same as seeding it with the first chunk's). The
    carry enters each chunk detached, as in the PyTorch trainers; with bptt_chunks = K > 1
    it is differentiated across each group of K chunks (`accumulate_bptt`).
    """
    if cfg.bptt_chunks > 1:
        return accumulate_bptt(params, carry, inputs_AxBxC, targets_AxBxC, feats_A, cfg, ce_weight)
    grad_fn = jax.value_and_grad(train_loss, has_aux=True)
    n = inputs_AxBxC.shape[0]

    def chunk(carry, inputs, targets, feats):
        (_, (ce, lb, keep, rep, carry, h)), g = grad_fn(params, carry, inputs, targets, feats, cfg, ce_weight)
        return carry, g, (ce, lb, keep, rep, h)

    if n == 1:
        first = jax.tree.map(lambda a: a[0], feats_A)
        carry, grads, out = chunk(carry, inputs_AxBxC[0], targets_AxBxC[0], first)
        ce, lb, keep, rep, h = (a[None] for a in out)
    else:
        def micro(acc, xs):
            carry, gsum = acc
            carry, g, out = chunk(carry, *xs)
            return (carry, jax.tree.map(jnp.add, gsum, g)), out

        zeros = jax.tree.map(jnp.zeros_like, params)
        (carry, gsum), (ce, lb, keep, rep, h) = jax.lax.scan(
            micro, (carry, zeros), (inputs_AxBxC, targets_AxBxC, feats_A))
        grads = jax.tree.map(lambda g: g / n, gsum)
    return carry, grads, {"ce": ce.mean(), "lb": lb.mean(), "keep_rate": keep.mean(),
                          "repeat_prob": rep.mean()}, h


def accumulate_bptt(params, carry, inputs_AxBxC, targets_AxBxC, feats_A, cfg: TrainConfig, ce_weight=1.0):
    """`accumulate` with the gradient through the carry: the A chunks are cut into A/K groups
    of K = bptt_chunks; each group's loss is the sum of its chunks' losses with the carry
    flowing, differentiated, from chunk to chunk (backpropagation through time over K·C ids);
    the carry entering a group is detached. The gradient is the sum over groups divided by A,
    so it is the mean of the chunks' gradients when nothing flows through the carry. Each
    chunk is rematerialised (jax.checkpoint): a group's backward pass keeps K carries and
    recomputes one chunk's activations at a time."""
    A, K = inputs_AxBxC.shape[0], cfg.bptt_chunks
    chunk_loss = jax.checkpoint(functools.partial(train_loss, cfg=cfg, ce_weight=ce_weight, carry_grad=True))

    def group_loss(p, carry, inputs_KxBxC, targets_KxBxC, feats_K):
        def body(carry, xs):
            loss, (ce, lb, keep, rep, carry, h) = chunk_loss(p, carry, *xs)
            return carry, (loss, ce, lb, keep, rep, h)

        carry, (loss, *out) = jax.lax.scan(body, carry, (inputs_KxBxC, targets_KxBxC, feats_K))
        return loss.sum(), (carry, out)

    grad_fn = jax.value_and_grad(group_loss, has_aux=True)
    groups = lambda x: None if x is None else x.reshape((A // K, K) + x.shape[1:])  # noqa: E731

    def group(acc, xs):
        carry, gsum = acc
        (_, (carry, out)), g = grad_fn(params, jax.lax.stop_gradient(carry), *xs)
        return (carry, jax.tree.map(jnp.add, gsum, g)), out

    zeros = jax.tree.map(jnp.zeros_like, params)
    xs = (groups(inputs_AxBxC), groups(targets_AxBxC), jax.tree.map(groups, feats_A))
    (carry, gsum), (ce, lb, keep, rep, h) = jax.lax.scan(group, (carry, zeros), xs)
    grads = jax.tree.map(lambda g: g / A, gsum)
    h = h.reshape((A,) + h.shape[2:])
    return carry, grads, {"ce": ce.mean(), "lb": lb.mean(), "keep_rate": keep.mean(),
                          "repeat_prob": rep.mean()}, h


@jax.named_scope("optimizer")
def _apply(tx, params, opt_state, grads, lr):
    grad_norm = optax.tree.norm(grads)
    updates, new_opt = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, jax.tree.map(lambda u: lr * u, updates))
    ok = jnp.isfinite(grad_norm)
    keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
    return (jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_opt, opt_state),
            grad_norm, (~ok).astype(jnp.int32))


def ss_prob(cfg: TrainConfig, C: int):
    pos = jnp.arange(C, dtype=jnp.float32)
    return cfg.ss_p0 + (cfg.ss_p1 - cfg.ss_p0) * jnp.minimum(1.0, pos / max(1, cfg.ss_ramp))


def mix_inputs(cfg: TrainConfig, params, inputs_AxBxC, h_AxBxCxD, key):
    """Replace input t ≥ 1 with probability ss_prob(t) by a sample of the prediction at t−1."""
    A, B, C = inputs_AxBxC.shape
    k_sample, k_coin = jax.random.split(key)
    samples = jax.vmap(lambda h, k: sample_from_hidden(h, params["observe"], k, cfg.ss_temperature, cfg.ce_chunk))(
        h_AxBxCxD, jax.random.split(k_sample, A))
    predicted = jnp.concatenate([inputs_AxBxC[..., :1], samples[..., :-1]], axis=-1)
    coin = jax.random.uniform(k_coin, (A, B, C)) < ss_prob(cfg, C)
    replace = coin & (jnp.arange(C) >= 1)
    return jnp.where(replace, predicted, inputs_AxBxC)


RESET_STREAM = 0x5E7   # folded into the step's key: the reset draws, apart from ss's


def reset_rows(cfg: TrainConfig, step, key):
    """(B,) bool: the rows whose carry starts this step from the initial carry, or None
    when the config resets nothing (the step is then the program it was without resets).

    Every row on steps whose number is a multiple of carry_reset_every (> 0), and each row
    with probability carry_reset_prob, drawn from the step's key (a function of seed and
    step: a resumed run draws the same rows). docs/spec.md §6."""
    if not cfg.carry_reset_every and not cfg.carry_reset_prob:
        return None
    rows = jnp.zeros((cfg.batch_size,), bool)
    if cfg.carry_reset_every:
        rows = rows | (step % cfg.carry_reset_every == 0)
    if cfg.carry_reset_prob:
        draw = jax.random.uniform(jax.random.fold_in(key, RESET_STREAM), (cfg.batch_size,))
        rows = rows | (draw < cfg.carry_reset_prob)
    return rows


def make_train_step(cfg: TrainConfig):
    """step(state, batch) → (state, metrics); batch = {"ids": (A, B, C+1)[, "feats": (A, B, C, F)]}.

    One function per `cfg.for_programs()`: the step reads none of the run's other fields."""
    return _make_train_step(cfg.for_programs())


@functools.lru_cache(maxsize=8)
def _make_train_step(cfg: TrainConfig):
    def step(state, batch):
        params, opt_state, carry0 = state["params"], state["opt_state"], state["carry"]
        tx = make_optimizer(cfg, params)
        ids = batch["ids"]
        inputs, targets = ids[..., :-1], ids[..., 1:]
        feats = batch.get("feats")
        key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed), state["step"])
        lr = learning_rate(cfg, state["step"])
        reset = reset_rows(cfg, state["step"], key)
        if reset is not None:
            carry0 = model.reset_state_rows(carry0, reset)

        carry, grads, m, h = accumulate(params, carry0, inputs, targets, feats, cfg)
        params, opt_state, grad_norm, skipped = _apply(tx, params, opt_state, grads, lr)
        metrics = {"ce_tf": m["ce"], "lb": m["lb"], "keep_rate": m["keep_rate"],
                   "repeat_prob": m["repeat_prob"], "grad_norm": grad_norm, "lr": lr}

        if cfg.ss_rate > 0:
            k_gate, k_mix = jax.random.split(key)

            def with_ss(operand):
                p, o = operand
                mixed = mix_inputs(cfg, state["params"], inputs, h, k_mix)
                _, g, m_ss, _ = accumulate(p, carry0, mixed, targets, feats, cfg, ce_weight=0.5)
                p, o, _, sk = _apply(tx, p, o, g, lr)
                return p, o, m_ss["ce"], sk, jnp.ones((), jnp.int32)

            def without_ss(operand):
                p, o = operand
                return p, o, jnp.full((), jnp.nan, m["ce"].dtype), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)

            run_ss = jax.random.uniform(k_gate) < cfg.ss_rate
            params, opt_state, ce_ss, skipped_ss, ss_ran = jax.lax.cond(run_ss, with_ss, without_ss,
                                                                        (params, opt_state))
            skipped = skipped + skipped_ss
        else:
            ce_ss, ss_ran = jnp.full((), jnp.nan, m["ce"].dtype), jnp.zeros((), jnp.int32)
        metrics.update(ce_ss=ce_ss, ss_ran=ss_ran, skipped=skipped)
        new_state = {"params": params, "opt_state": opt_state, "carry": carry,
                     "step": state["step"] + 1, "skipped": state["skipped"] + skipped}
        return new_state, metrics

    return step


def batch_shardings(cfg: TrainConfig, mesh) -> dict:
    """The step's batch layout on the mesh, rows split over the data axes: "ids"
    (A, B, C+1), and "feats" (A, B, C, F) when the config feeds the atom features. The
    trainer, the benchmarks and the planner all take it from here, so that they compile
    the same program."""
    out = {"ids": sharding.batch_sharding(mesh, 3, batch_dim=1)}
    if cfg.feats and cfg.model.is_atom:
        out["feats"] = sharding.batch_sharding(mesh, 4, batch_dim=1)
    return out


def abstract_batch(cfg: TrainConfig, shardings: dict) -> dict:
    """ShapeDtypeStructs of a batch with `batch_shardings`' layout (ahead-of-time lowering)."""
    A, B, C = cfg.accum, cfg.batch_size, cfg.seq_len
    shapes = {"ids": ((A, B, C + 1), jnp.int32), "feats": ((A, B, C, FEAT_DIM), jnp.float32)}
    return {k: jax.ShapeDtypeStruct(*shapes[k], sharding=sh) for k, sh in shardings.items()}


def jit_train_step(cfg: TrainConfig, state_shardings, batch_shardings):
    """The step jitted with its shardings and the state donated (updated in place).

    make_train_step is memoised on the config's `for_programs()`, so a second trainer in
    the same process with that config reuses the compiled step instead of recompiling.
    """
    return jax.jit(make_train_step(cfg), in_shardings=(state_shardings, batch_shardings),
                   out_shardings=(state_shardings, None), donate_argnums=(0,))
