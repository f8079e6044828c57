"""Probes: what a falling CE does not show (docs/spec.md §6), run every probe_every steps.

Each probe is one jitted function of the parameters on fixed inputs (a fresh carry, the
same corpus rows every time), so values are comparable across steps and across resumes:
  * ce / echo: teacher-forced CE on probe rows, and the fraction of positions whose argmax
    repeats the input id (an echoing model has low CE on repetitive text, and no speech);
  * the speech gate: greedy decoding of 40 ids from an open prefix; unique ids and unique
    bytes among them (a model that only emits spaces has 1). It decodes as the run trained
    (`TrainConfig.trained_decoding`): chunks of seq_len carrying the state for an Atom run
    that streams its carry, a window of seq_len ids for one whose every chunk started from
    the initial carry, one id at a time for the parent;
  * AR eval: warm on 32 true ids, then 32 greedy steps fed back; CE of those predictions
    against the true continuation and the rate of exact matches;
  * load balance per block: lb, expert hits, alive experts (≥ 1 hit), capacity keep rate.
An engine that takes packet features (`EngineConfig.feeds_features`) gets them in every probe.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fractus_jax import model
from fractus_jax.atom import decode, encode_open
from fractus_jax.atom.features import FEATURE_CONTEXT, atom_features
from fractus_jax.atom.ids import VOCAB as ATOM_VOCAB
from fractus_jax.decode import decode_ids, host_features, speech_counts
from fractus_jax.train.config import TrainConfig

PROBE_ROWS = 4
PROBE_LEN = 64
WARM, FREE = 32, 32
SPEECH_STEPS = 40
SPEECH_PROMPT = "The meaning of "


def _probe_rows(corpus, n_rows: int, length: int) -> np.ndarray:
    """Rows of length+1 ids from offsets spread evenly over the corpus."""
    n = corpus.n_ids
    starts = np.linspace(0, max(0, n - length - 2), n_rows).astype(np.int64)
    return np.stack([np.asarray(corpus.ids[s:s + length + 1], np.int32) for s in starts])


def _teacher_forced(params, rows, cfg, ex, feats=None):
    inputs, targets = rows[:, :-1], rows[:, 1:]
    state = model.init_state(cfg, rows.shape[0])
    h, aux, _ = model.forward_hidden(params, state, inputs, cfg, feats, ex=ex)
    logits = model.logits_from_hidden(params, h).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, -1)
    ce = -jnp.take_along_axis(logp, targets[..., None], -1).mean()
    echo = (jnp.argmax(logits, -1) == inputs).mean()
    alive = (aux.expert_hits > 0).sum(-1)
    return {"ce": ce, "echo": echo, "lb_per_block": aux.lb_per_layer, "keep_rate_per_block": aux.keep_rate,
            "alive_experts": alive, "expert_hits": aux.expert_hits}


def _ar_eval(params, rows, cfg, ex, feats=None):
    """Warm on WARM true ids, then FREE greedy steps with C = 1, each fed its own guess (and,
    for an engine that takes packet features, the features of each id, the ids read
    before it its context). feats: the rows' features (the warm-up reads its part)."""
    B = rows.shape[0]
    warm, truth = rows[:, :WARM], rows[:, WARM:WARM + FREE]
    state = model.init_state(cfg, B)
    h, _, state = model.forward_hidden(params, state, warm, cfg, None if feats is None else feats[:, :WARM], ex=ex)
    logits = model.logits_from_hidden(params, h[:, -1:])[:, 0]
    # the last FEATURE_CONTEXT ids read, the newest last (the guesses' context)
    history = jnp.concatenate([jnp.zeros((B, FEATURE_CONTEXT), jnp.int32), warm.astype(jnp.int32)], 1)
    history = history[:, -FEATURE_CONTEXT:]

    def step(carry, xs):
        state, logits, history = carry
        true_id, t = xs
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        ce = -jnp.take_along_axis(logp, true_id[:, None], -1)[:, 0]
        guess = jnp.argmax(logits, -1).astype(jnp.int32)
        f = (host_features(guess[:, None], history, jnp.minimum(t, FEATURE_CONTEXT))
             if cfg.feeds_features else None)
        h, _, state = model.forward_hidden(params, state, guess[:, None], cfg, f, ex=ex)
        history = jnp.concatenate([history[:, 1:], guess[:, None]], 1)
        return (state, model.logits_from_hidden(params, h)[:, 0], history), (ce, guess == true_id)

    steps = (truth.T, WARM + jnp.arange(truth.shape[1], dtype=jnp.int32))
    _, (ce, match) = jax.lax.scan(step, (state, logits, history), steps)
    return {"ce": ce.mean(), "match": match.mean()}


class Prober:
    def __init__(self, cfg: TrainConfig, corpus):
        # The probes run their own few rows on one device with the trained routing; a
        # capacity group that does not divide them makes them one group.
        rows = cfg.model.moe_group_rows
        self.cfg = cfg.model.for_inference(exact=False).replace(
            moe_group_rows=rows if rows and PROBE_ROWS % rows == 0 else 0)
        # Decoding feeds chunks of a few tokens: capacity would drop their assignments.
        self.decode_cfg = self.cfg.for_inference()
        self.ex = cfg.execution.for_inference()
        rows = _probe_rows(corpus, PROBE_ROWS, max(PROBE_LEN, WARM + FREE))
        self.rows = jnp.asarray(rows)
        # Packet features of the teacher-forced rows (from their start, as a fresh chunk's).
        self.feats = jnp.asarray(atom_features(rows[:, :-1])) if self.cfg.feeds_features else None
        self._tf = jax.jit(_teacher_forced, static_argnums=(2, 3))
        self._ar = jax.jit(_ar_eval, static_argnums=(2, 3))
        mode, window = cfg.trained_decoding()
        self.speech_mode = {"mode": mode, "window": window} if window else {"mode": mode}
        self.prompt = None
        if self.cfg.vocab_size == ATOM_VOCAB:
            self.prompt = jnp.asarray(encode_open(SPEECH_PROMPT), jnp.int32)[None]

    def run(self, params, initial: bool = False) -> dict:
        tf = jax.device_get(self._tf(params, self.rows, self.cfg, self.ex, self.feats))
        ar = jax.device_get(self._ar(params, self.rows, self.decode_cfg, self.ex, self.feats))
        prefix = "init" if initial else "probe"
        out = {f"{prefix}_ce": float(tf["ce"]), f"{prefix}_echo": float(tf["echo"]),
               "ar_ce": float(ar["ce"]), "ar_match": float(ar["match"]),
               "lb_per_block": [round(float(x), 6) for x in tf["lb_per_block"]],
               "keep_rate_per_block": [round(float(x), 4) for x in tf["keep_rate_per_block"]],
               "alive_experts": [int(x) for x in tf["alive_experts"]],
               "expert_hits": np.asarray(tf["expert_hits"], np.int64).tolist()}
        if self.prompt is not None:
            ids, _, n_valid = jax.device_get(decode_ids(params, self.decode_cfg, self.prompt, SPEECH_STEPS,
                                                         ex=self.ex, **self.speech_mode))
            gen = ids[0, : int(n_valid[0])]
            unique_ids, unique_bytes = speech_counts(gen)
            out.update(speech_unique_ids=unique_ids, speech_unique_bytes=unique_bytes,
                       speech_text=decode(gen))
        return out
