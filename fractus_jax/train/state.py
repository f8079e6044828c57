"""The train state: parameters, optimizer moments, carried state and counters.

Built the way large runs need: the abstract state (`jax.eval_shape`, nothing allocated)
gives the shardings, then one jitted init writes every array straight into its shards.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from fractus_jax import model, sharding
from fractus_jax.train import reach
from fractus_jax.train.config import TrainConfig


def _warmup(cfg: TrainConfig, step):
    return cfg.lr * jnp.minimum(1.0, (step + 1) / max(1, cfg.warmup_steps))


def lr_schedule(cfg: TrainConfig):
    """The learning rate as a function of the trainer's step (the one the checkpoint stores,
    so a resumed run continues the same curve).

    Linear warmup to cfg.lr over warmup_steps steps, written by hand (see docs/training.md:
    optax.linear_schedule rounds differently), then "constant" (that expression alone,
    bit for bit the schedule of runs before schedules), or optax's "cosine" / "linear"
    decay from lr to lr_floor over decay_steps steps, joined at the end of warmup, and
    lr_floor after it."""
    if cfg.lr_schedule == "constant":
        return functools.partial(_warmup, cfg)
    if cfg.lr_schedule == "cosine":
        decay = optax.cosine_decay_schedule(cfg.lr, cfg.decay_steps, alpha=cfg.lr_floor / cfg.lr)
    elif cfg.lr_schedule == "linear":
        decay = optax.linear_schedule(cfg.lr, cfg.lr_floor, cfg.decay_steps)
    else:
        raise ValueError(f"unknown lr_schedule {cfg.lr_schedule!r}")
    return optax.join_schedules([functools.partial(_warmup, cfg), decay], [cfg.warmup_steps])


def learning_rate(cfg: TrainConfig, step):
    """The step's learning rate (`lr_schedule`)."""
    return lr_schedule(cfg)(step)


def optimizer_labels(cfg: TrainConfig, params, step_unreached=None):
    """"train" for the parameters the optimizer steps, "frozen" for those it leaves alone.

    Frozen: the buffers (level offsets, expert phases: not parameters in PyTorch), and the
    parameters the training loss does not reach (`reach.loss_reach`, derived from the loss
    itself: the confidence and salience heads, `atom_feat` when no features are fed), as
    PyTorch's optimizers skip a parameter whose .grad is None. A loss that reaches a leaf
    trains it; cfg.step_unreached (or the argument) steps every parameter, as runs before
    this did (weight decay and moments on the unreached ones too)."""
    step_unreached = cfg.step_unreached if step_unreached is None else step_unreached
    trainable = model.trainable_mask(params)
    if not step_unreached:
        trainable = jax.tree.map(lambda t, r: t and r, trainable, reach.loss_reach(cfg))
    return jax.tree.map(lambda t: "train" if t else "frozen", trainable)


def make_optimizer(cfg: TrainConfig, params, step_unreached=None) -> optax.GradientTransformation:
    """The update direction at unit learning rate; the step scales it by learning_rate().

    The schedule follows the trainer's step, not the optimizer's update count, so a
    scheduled-sampling step (two updates) does not warm up twice as fast. Unit-rate AdamW
    times lr is exactly AdamW at lr (weight decay included), likewise SGD with momentum.
    The "frozen" leaves (`optimizer_labels`) get a zero update, no decay and no moments
    (their moment leaves are optax.MaskedNode).
    """
    if cfg.optimizer == "adamw":
        inner = optax.adamw(1.0, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    else:
        inner = optax.sgd(1.0, momentum=cfg.momentum)
    train = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), inner)
    labels = optimizer_labels(cfg, params, step_unreached)
    return optax.multi_transform({"train": train, "frozen": optax.set_to_zero()}, labels)


def _around(cfg: TrainConfig, params):
    """Step 0 of a run around `params`: zero moments, the initial carry."""
    tx = make_optimizer(cfg, params)
    return {
        "params": params,
        "opt_state": tx.init(params),
        "carry": model.init_state(cfg.model, cfg.batch_size),
        "step": jnp.zeros((), jnp.int32),
        "skipped": jnp.zeros((), jnp.int32),
    }


def _init(cfg: TrainConfig, key):
    return _around(cfg, model.init_params(cfg.model, key))


def abstract_train_state(cfg: TrainConfig):
    return jax.eval_shape(lambda: _init(cfg, jax.random.PRNGKey(0)))


def train_state_shardings(cfg: TrainConfig, mesh, abstract=None):
    abstract = abstract if abstract is not None else abstract_train_state(cfg)
    p_shard = sharding.param_shardings(abstract["params"], mesh)
    rep = sharding.replicated(mesh)
    return {"params": p_shard, "opt_state": _moments_like_params(cfg, abstract, p_shard, rep),
            "carry": sharding.state_shardings(abstract["carry"], mesh), "step": rep, "skipped": rep}


def _masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)


def _moments_like_params(cfg: TrainConfig, abstract, param_shardings, default):
    """The optimizer state's shardings: each leaf that mirrors a parameter (a moment) is
    sharded like it (optax.tree_map_params), the others (counts) `default`; the frozen
    leaves' moments are optax.MaskedNode and stay so."""
    tx = make_optimizer(cfg, abstract["params"])
    mapped = optax.tree_map_params(tx, lambda _, s: s, abstract["opt_state"], param_shardings,
                                   transform_non_params=lambda _: default, is_leaf=_masked)
    return jax.tree.map(lambda a, m: a if _masked(a) else m, abstract["opt_state"], mapped, is_leaf=_masked)


@functools.lru_cache(maxsize=8)
def _init_fn(cfg: TrainConfig):
    return functools.partial(_init, cfg)  # one function per config: jit reuses its compilation


def create_train_state(cfg: TrainConfig, mesh, key, shardings=None):
    """(state, shardings): the fresh state written straight into its shards (`shardings`, or
    those of cfg on mesh)."""
    shardings = train_state_shardings(cfg, mesh) if shardings is None else shardings
    return jax.jit(_init_fn(cfg.for_programs()), out_shardings=shardings)(key), shardings


def state_around(cfg: TrainConfig, params, shardings):
    """Step 0 of a run that starts from given parameters (`init_from`): zero moments and the
    initial carry, written into `shardings` without initialising parameters to replace."""
    return jax.jit(functools.partial(_around, cfg.for_programs()), out_shardings=shardings,
                   donate_argnums=0)(params)
