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


def _init(cfg: TrainConfig, key):
    params = model.init_params(cfg.model, key)
    tx = make_optimizer(cfg, params)
    return {
        "params": params,
        "opt_state": tx.init(params),
        "carry": model.init_state(cfg.model, cfg.batch_size),
        "step": jnp.zeros((), jnp.int32),
        "skipped": jnp.zeros((), jnp.int32),
    }


def abstract_train_state(cfg: TrainConfig):
    return jax.eval_shape(lambda: _init(cfg, jax.random.PRNGKey(0)))


def train_state_shardings(cfg: TrainConfig, mesh, abstract=None):
    abstract = abstract if abstract is not None else abstract_train_state(cfg)
    p_shard = sharding.param_shardings(abstract["params"], mesh)
    rep = sharding.replicated(mesh)
    return {"params": p_shard, "opt_state": _like_params(abstract["opt_state"], abstract["params"], p_shard, rep),
            "carry": sharding.state_shardings(abstract["carry"], mesh), "step": rep, "skipped": rep}


def _dict_keys(path) -> tuple:
    return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def _like_params(opt_state, params, param_shardings, default):
    """Each optimizer leaf that mirrors a parameter (a moment) is sharded like it."""
    table = {_dict_keys(path): (leaf.shape, s) for (path, leaf), s in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree_util.tree_leaves(param_shardings))}

    def pick(path, leaf):
        keys = _dict_keys(path)
        for i in range(len(keys)):
            shape, s = table.get(keys[i:], (None, None))
            if shape == leaf.shape:
                return s
        return default

    return jax.tree_util.tree_map_with_path(pick, opt_state)


@functools.lru_cache(maxsize=8)
def _init_fn(cfg: TrainConfig):
    return functools.partial(_init, cfg)  # one function per config: jit reuses its compilation


def create_train_state(cfg: TrainConfig, mesh, key):
    shardings = train_state_shardings(cfg, mesh)
    return jax.jit(_init_fn(cfg.for_programs()), out_shardings=shardings)(key), shardings


def with_params(cfg: TrainConfig, state, params):
    """A fresh state (zero moments) around given parameters: a run started from weights."""
    tx = make_optimizer(cfg, params)
    return {**state, "params": params, "opt_state": tx.init(params)}
