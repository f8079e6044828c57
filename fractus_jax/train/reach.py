"""Which parameters the training loss reaches: those whose gradient is not structurally zero.

PyTorch's optimizers skip a parameter whose `.grad` is None (no weight decay, no moment
update, no state entry): one autograd never reached from the loss. The JAX analogue is
read from the loss's linearization: `jax.linearize` drops the tangents that are symbolic
zeros (stop_gradient, integer paths, leaves the loss never reads), and a dependence pass
over the linear jaxpr (into scan, cond, pjit, remat and custom-derivative bodies) says
which tangent inputs reach the loss's tangent output. Only public APIs: jax.make_jaxpr,
jax.linearize and the jaxpr's equations.
"""
from __future__ import annotations

import functools

import jax
from jax.extend import core as jex

from fractus_jax import model
from fractus_jax.atom.ids import FEAT_DIM
from fractus_jax.train.config import TrainConfig
from fractus_jax.train.objective import LOSS_FIELDS, train_loss


def _closed(j):
    return j.jaxpr if hasattr(j, "jaxpr") and hasattr(j, "consts") else j


def _sub_jaxprs(eqn):
    return [_closed(v) for v in eqn.params.values() if isinstance(v, (jex.Jaxpr, jex.ClosedJaxpr))] + \
           [_closed(b) for v in eqn.params.values() if isinstance(v, (tuple, list))
            for b in v if isinstance(b, (jex.Jaxpr, jex.ClosedJaxpr))]


def _flows(jaxpr, live_in: list[bool]) -> list[bool]:
    """live_out[i]: outvar i depends on some invar marked in live_in."""
    live = {v for v, on in zip(jaxpr.invars, live_in) if on}
    dep = lambda a: not isinstance(a, jex.Literal) and a in live  # noqa: E731
    for eqn in jaxpr.eqns:
        ins = [dep(a) for a in eqn.invars]
        if not any(ins):
            continue
        outs = _eqn_flows(eqn, ins)
        live.update(v for v, on in zip(eqn.outvars, outs) if on)
    return [dep(v) for v in jaxpr.outvars]


def _eqn_flows(eqn, ins: list[bool]) -> list[bool]:
    name, n_out = eqn.primitive.name, len(eqn.outvars)
    if name == "scan":
        body = _closed(eqn.params["jaxpr"])
        nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
        consts, carry, xs = ins[:nc], list(ins[nc:nc + nk]), ins[nc + nk:]
        while True:   # the carry's dependence, to a fixpoint
            out = _flows(body, consts + carry + xs)
            new = [a or b for a, b in zip(carry, out[:nk])]
            if new == carry:
                return new + out[nk:]
            carry = new
    if name == "cond":
        outs = [False] * n_out
        for branch in eqn.params["branches"]:
            outs = [a or b for a, b in zip(outs, _flows(_closed(branch), ins[1:]))]
        if ins[0]:
            outs = [True] * n_out
        return outs
    subs = [j for j in _sub_jaxprs(eqn) if len(j.invars) == len(ins) and len(j.outvars) == n_out]
    if subs and name != "while":
        return _flows(subs[0], ins)   # pjit, closed_call, remat, custom_jvp_call, custom_vjp_call ...
    return [True] * n_out            # a primitive: every output depends on every input


def reached(fn, params, *args):
    """A tree like params: True where the gradient of scalar fn(params, *args) is not
    structurally zero. params and args may be ShapeDtypeStructs (nothing is computed)."""
    def linear(p, t, *a):
        _, f_jvp = jax.linearize(lambda q: fn(q, *a), p)
        return f_jvp(t)

    closed = jax.make_jaxpr(linear)(params, params, *args)
    n = len(jax.tree_util.tree_leaves(params))
    n_in = len(closed.jaxpr.invars)
    flags = []
    for i in range(n):
        live_in = [False] * n_in
        live_in[n + i] = True
        flags.append(any(_flows(closed.jaxpr, live_in)))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), flags)


def loss_reach(cfg: TrainConfig):
    """reached() of the trainer's loss (`objective.train_loss`, as the step calls it for cfg), on the
    abstract parameters of cfg's model: a tree of bools like the parameters."""
    return _loss_reach(TrainConfig(model=cfg.model, execution=cfg.execution, **{k: getattr(cfg, k) for k in LOSS_FIELDS}))


@functools.lru_cache(maxsize=16)
def _loss_reach(cfg: TrainConfig):
    abstract = jax.eval_shape(lambda: model.init_params(cfg.model, jax.random.PRNGKey(0)))
    carry = jax.eval_shape(lambda: model.init_state(cfg.model, cfg.batch_size))
    ids = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len), jax.numpy.int32)
    feats = (jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len, FEAT_DIM), jax.numpy.float32)
             if cfg.feats and cfg.model.is_atom else None)

    def loss(p, carry, inputs, targets, feats):
        return train_loss(p, carry, inputs, targets, feats, cfg, 1.0, carry_grad=cfg.bptt_chunks > 1)[0]

    return reached(loss, abstract, carry, ids, ids, feats)
