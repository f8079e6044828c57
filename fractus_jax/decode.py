"""The pure, jit-compiled decode core (docs/spec.md §4 "Decoding"): three modes, one chunk forward.

`decode_ids` runs the whole decode loop inside one `lax.while_loop` (no host round trip
per id) on a batch of equal-length prompts and is usable from inside a jitted trainer
probe. Every mode calls `model.forward_hidden`, the same chunk forward training uses:

* ``step``: prefill the prompt as one chunk from a zero state; the first id comes from
  the prefill's last position; then each id is fed back as a chunk of C = 1, carrying
  the state.
* ``window``: each step re-runs the last W ids (fewer while fewer exist) as one chunk
  from a ZERO state (a sliding stateless window: re-running overlapping windows on a
  carried state would absorb the same ids twice).
* ``chunk``: the function a run that streamed its carry in chunks of C = ``window`` ids
  trained: the ids (prompt, then the generated ones) are cut into chunks of C from the
  first, each chunk starts from the carry the chunk before it left, and each id comes from
  the chunk so far (fewer than C ids) run from that carry. The engine's carry is the mean
  of its levels' states at every chunk's end, so the chunk length is part of the function:
  step mode (C = 1) computes another one. Atom engines only (the parent routes a chunk by
  its last position, which the chunk so far does not hold yet).

Static shapes: the window is always W wide. While fewer than W ids exist it is padded on
the LEFT with ``pad_id``. That padding is invisible when every prompt starts with the
engine's BOS (every ``atom.encode_open`` prompt does): a BOS zeroes the state entering
it, the thought is zero anyway (zero state), and every other part of the block is per
position (parent routing reads the LAST position, which is real). The same argument lets
`generate` left-pad prompts of different lengths into one batch. It holds with exact
MoE routing (``capacity_factor=None``); with a capacity, pad positions and other rows
compete for expert slots, exactly as they would in a training chunk.

Packet features: an engine that feeds them (`EngineConfig.feeds_features`) gets them in
modes "chunk" and "window", computed on the host (`jax.pure_callback` on
`atom.features.atom_features`) for each chunk or window, with the FEATURE_CONTEXT ids before
it as context when the text holds that many, as the trainer's loader does; mode "step"
(one id a chunk) is refused for such an engine.

Stop: a row is done after it emits ``eos_id`` (the EOS is kept as its last id); later
positions hold ``pad_id`` with confidence 0, and the loop ends early once all rows are
done. Temperature ``None`` or 0 is greedy (argmax, no ban on repeats); otherwise ids
are sampled from softmax(logits / T), restricted to the ``top_k`` best where top_k > 0.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from fractus_jax import model
from fractus_jax.atom.features import FEATURE_CONTEXT, atom_features
from fractus_jax.atom.ids import EOS as EOS_ID
from fractus_jax.atom.ids import FEAT_DIM
from fractus_jax.atom.ids import PAD as PAD_ID
from fractus_jax.config import EngineConfig, Execution
from fractus_jax.dtypes import accum_dtype

MODES = ("step", "window", "chunk")


def check_decode_args(cfg: EngineConfig, max_new: int, mode: str, window: int,
                      temperature: Optional[float], top_k: int) -> None:
    """The argument checks of `decode_ids` (host side, before tracing); ValueError on misuse."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if int(max_new) < 1:
        raise ValueError(f"max_new must be >= 1, got {max_new}")
    if mode in ("window", "chunk") and int(window) < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if mode == "step" and cfg.feeds_features:
        raise ValueError("mode 'step' cannot feed packet features (the engine takes them at boundary ids, from "
                         "the packet each closes): decode this engine in mode 'chunk' or 'window'")
    if mode == "chunk" and not cfg.is_atom:
        raise ValueError("mode 'chunk' decodes Atom engines only: the parent routes a chunk by its last "
                         "position, which a chunk decoded so far does not hold yet")
    if temperature is not None and not float(temperature) >= 0.0:
        raise ValueError(f"temperature must be >= 0 (0 or None: greedy), got {temperature}")
    if int(top_k) < 0 or int(top_k) > cfg.vocab_size:
        raise ValueError(f"top_k must be in 0..{cfg.vocab_size} (0: no cut), got {top_k}")


def speech_counts(ids) -> tuple[int, int]:
    """(distinct ids, distinct byte values among ids < 256) of generated ids: the speech
    gate's two counts, for `generate` and the trainer's probe alike. A model that emits
    only one boundary id scores (1, 0)."""
    a = np.asarray(ids, np.int64).reshape(-1)
    return int(np.unique(a).size), int(np.unique(a[a < 256]).size)


def select_ids(logits_BxV, key, temperature: Optional[float], top_k: int):
    """Greedy argmax (temperature None/0) or a sample from softmax(logits/T), top-k cut."""
    if temperature is None or float(temperature) == 0.0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits = logits_BxV.astype(jnp.float32) / float(temperature)
    if top_k:
        kth = jax.lax.top_k(logits, int(top_k))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _host_features(ids_BxC, left_BxF, n_left):
    """atom_features of ids with the last n_left ids of left as their context (none: 0)."""
    n = int(n_left)
    left = np.asarray(left_BxF)[:, left_BxF.shape[1] - n:] if n else None
    return atom_features(np.asarray(ids_BxC), left=left).astype(np.float32)


def host_features(ids_BxC, left_BxF, n_left):
    """`atom_features` from inside a jitted function: (B, C, FEAT_DIM) float32 of ids_BxC,
    the last n_left (traced) ids of left_BxF their context."""
    B, C = ids_BxC.shape
    return jax.pure_callback(_host_features, jax.ShapeDtypeStruct((B, C, FEAT_DIM), jnp.float32),
                             ids_BxC, left_BxF, n_left)


def features(cfg: EngineConfig, seq_BxT, start, chunk_BxC, text_start=0):
    """The packet features (B, C, FEAT_DIM) of chunk = seq[:, start:start + C], with the
    FEATURE_CONTEXT ids before it as context when the text (which begins at seq[:,
    text_start]) holds that many, computed on the host as the loader computes them; None for
    an engine that takes none."""
    if not cfg.feeds_features:
        return None
    left = jax.lax.dynamic_slice(seq_BxT, (jnp.int32(0), jnp.maximum(start - FEATURE_CONTEXT, 0)),
                                 (seq_BxT.shape[0], FEATURE_CONTEXT))
    return host_features(chunk_BxC, left, jnp.where(start - text_start >= FEATURE_CONTEXT, FEATURE_CONTEXT, 0))


def _last(params, cfg, ex, state, ids_BxC, feats=None):
    """One chunk forward; (logits at the last position (B, V), confidence there (B,), new state)."""
    h, _, new_state = model.forward_hidden(params, state, ids_BxC, cfg, feats, ex=ex)
    h_last = h[:, -1]
    logits = model.logits_from_hidden(params, h_last[:, None])[:, 0]
    return logits, model.confidence(params, h_last), new_state


@partial(jax.jit, static_argnames=("cfg", "max_new", "mode", "window", "temperature", "top_k",
                                   "eos_id", "pad_id", "ex"))
def decode_ids(params, cfg: EngineConfig, prompt_ids_BxP, max_new: int, mode: str = "step",
               window: int = 64, temperature: Optional[float] = None, top_k: int = 0, key=None,
               eos_id: int = EOS_ID, pad_id: int = PAD_ID, ex: Execution = Execution()):
    """Decode up to ``max_new`` ids after each prompt row; returns (ids_BxN, confidence_BxN, n_valid_B).

    ids are int32 with ``pad_id`` after a row's EOS; confidence is float32,
    sigmoid(confidence_head(h_last)) of the call that produced each id (0 after EOS);
    n_valid counts each row's generated ids, its EOS included. ``window`` is the window of
    mode "window" and the chunk length of mode "chunk". All of cfg, max_new, mode, window,
    temperature, top_k, ex are static.
    """
    check_decode_args(cfg, max_new, mode, window, temperature, top_k)
    prompt = jnp.asarray(prompt_ids_BxP, jnp.int32)
    B, P = prompt.shape
    if P < 1:
        raise ValueError("decode_ids needs prompts of at least one id")
    N = int(max_new)
    if key is None:
        key = jax.random.PRNGKey(0)
    zero = model.init_state(cfg, B, accum_dtype(params["observe"].dtype))

    def emit(i, logits, conf, carry_out):
        """Pick id i from logits, write it and its confidence; update done / n_valid."""
        ids, confs, done, n_valid = carry_out
        new = select_ids(logits, jax.random.fold_in(key, i), temperature, top_k)
        new = jnp.where(done, pad_id, new)
        conf = jnp.where(done, 0.0, conf.astype(jnp.float32))
        at = (jnp.int32(0), jnp.asarray(i, jnp.int32))
        ids = jax.lax.dynamic_update_slice(ids, new[:, None], at)
        confs = jax.lax.dynamic_update_slice(confs, conf[:, None], at)
        n_valid = n_valid + (~done).astype(jnp.int32)
        done = done | (new == eos_id)
        return new, (ids, confs, done, n_valid)

    out0 = (jnp.full((B, N), pad_id, jnp.int32), jnp.zeros((B, N), jnp.float32),
            jnp.zeros((B,), bool), jnp.zeros((B,), jnp.int32))

    def cond(c):
        return (c[0] < N) & ~jnp.all(c[-1][2])

    if mode == "step":
        logits, conf, state = _last(params, cfg, ex, zero, prompt)
        last, out = emit(0, logits, conf, out0)

        def body(c):
            i, state, last, out = c
            logits, conf, state = _last(params, cfg, ex, state, last[:, None])
            last, out = emit(i, logits, conf, out)
            return i + 1, state, last, out

        _, _, _, out = jax.lax.while_loop(cond, body, (jnp.int32(1), state, last, out))
    elif mode == "chunk":
        C = int(window)
        # The prompt's whole chunks before the one its last id is in, from the zero carry.
        full = (P - 1) // C

        # C pad columns behind: the chunk of C from any start is a slice of seq.
        seq = jnp.concatenate([prompt, jnp.full((B, N + C), pad_id, jnp.int32)], axis=1)

        def prefill(state, k):   # one traced forward however long the prompt
            chunk = jax.lax.dynamic_slice(seq, (jnp.int32(0), k * C), (B, C))
            return _last(params, cfg, ex, state, chunk, features(cfg, seq, k * C, chunk))[2], None

        state, _ = jax.lax.scan(prefill, zero, jnp.arange(full, dtype=jnp.int32))

        def body(c):
            i, seq, state, start, out = c
            n = P + i                                    # ids so far; the chunk so far is seq[start:n]
            chunk = jax.lax.dynamic_slice(seq, (jnp.int32(0), start), (B, C))
            h, _, after = model.forward_hidden(params, state, chunk, cfg, features(cfg, seq, start, chunk), ex=ex)
            h_last = jax.lax.dynamic_index_in_dim(h, n - 1 - start, axis=1, keepdims=False)
            logits = model.logits_from_hidden(params, h_last[:, None])[:, 0]
            new, out = emit(i, logits, model.confidence(params, h_last), out)
            seq = jax.lax.dynamic_update_slice(seq, new[:, None], (jnp.int32(0), n))
            whole = n - start == C                      # the chunk was whole: its end is the next carry
            state = jax.tree.map(lambda a, b: jnp.where(whole, a, b), after, state)
            return i + 1, seq, state, start + jnp.where(whole, C, 0), out

        _, _, _, _, out = jax.lax.while_loop(cond, body, (jnp.int32(0), seq, state, jnp.int32(full * C), out0))
    else:
        W = int(window)
        # W pad columns in front: the window of the first n ids is seq[:, n : n + W].
        seq = jnp.concatenate([jnp.full((B, W), pad_id, jnp.int32), prompt,
                               jnp.full((B, N), pad_id, jnp.int32)], axis=1)

        def body(c):
            i, seq, out = c
            ids_win = jax.lax.dynamic_slice(seq, (jnp.int32(0), P + i), (B, W))
            logits, conf, _ = _last(params, cfg, ex, zero, ids_win, features(cfg, seq, P + i, ids_win, text_start=W))
            new, out = emit(i, logits, conf, out)
            seq = jax.lax.dynamic_update_slice(seq, new[:, None], (jnp.int32(0), W + P + i))
            return i + 1, seq, out

        _, _, out = jax.lax.while_loop(cond, body, (jnp.int32(0), seq, out0))
    ids, confs, _, n_valid = out
    return ids, confs, n_valid
