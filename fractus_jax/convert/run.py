"""A run directory ↔ PyTorch checkpoint files: `export` and `import` (docs/spec.md §2, §6).

Export reads one checkpoint of a run directory (parameters, carried state, counters,
optionally the optimizer moments) and writes the PyTorch files. Import checks everything
first (config, tensors, shapes, the optimizer file) and only then writes a run directory
that `python -m fractus_jax.train --config NAME --workdir DIR` resumes from.
"""
from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from fractus_jax.config import WEIGHT_FIELDS
from fractus_jax.convert import files, names, optim, state_dicts
from fractus_jax.convert.state_dicts import ConversionError
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import rundir
from fractus_jax.train import state as state_lib
from fractus_jax.train.config import TrainConfig, apply_overrides, load_config

Log = Callable[[str], None]


@dataclasses.dataclass
class Snapshot:
    """One checkpoint of a run, as numpy trees."""
    cfg: TrainConfig
    params: dict
    opt_state: object          # None unless asked for
    carry: dict
    step: int
    skipped: int
    meta: dict


def load_run(ckpt, with_opt: bool) -> Snapshot:
    """One checkpoint, restored in the shapes of the config saved with that step (a run grown
    in place holds steps of two shapes; its manifest describes only the latest)."""
    run_dir, step = ckpt_lib.resolve_checkpoint(ckpt)
    step, _, cfg = ckpt_lib.read_step(run_dir, step, items=None if with_opt else ckpt_lib.WEIGHTS_ITEMS)
    items = ("params", "opt_state", "extra") if with_opt else ("params", "extra")
    state, meta = ckpt_lib.restore_one_device(run_dir, step, cfg, items=items)
    state = jax.device_get(state)
    return Snapshot(cfg, state["params"], state.get("opt_state"), state["carry"], int(state["step"]),
                    int(state["skipped"]), meta)


def torch_checkpoint(snap: Snapshot) -> tuple[dict, dict, dict]:
    """(state dict of numpy arrays in the reference module's order, config, extra keys)."""
    model = snap.cfg.model
    sd = {**state_dicts.params_to_torch(snap.params, model),
          **state_dicts.state_to_torch(snap.carry, model, last_lb_loss=float(snap.meta.get("last_lb_loss", 0.0)))}
    order = optim.torch_state_dict_order(model)
    if set(order) != set(sd):
        raise ConversionError(f"internal: the export's keys differ from the reference module's "
                              f"({sorted(set(order) ^ set(sd))})")
    # gate_temp: the key the PyTorch trainers' scripts read the gate temperature from.
    config = {**model.torch_kwargs(), "capacity_factor": model.capacity_factor,
              names.GATE_TEMP: model.gate_temperature}
    meta = snap.meta
    extras = {"step": snap.step, "start_token_next": int(meta.get("start_token_next", 0)),
              "batch_size": int(meta.get("batch_size", snap.cfg.batch_size)),
              "seq_len": int(meta.get("seq_len", snap.cfg.seq_len)),
              "accum": int(meta.get("accum", snap.cfg.accum)),
              "skipped": snap.skipped, "corpus": dict(meta.get("corpus") or {})}
    return {k: sd[k] for k in order}, config, extras


def decay_warning(model) -> Optional[str]:
    """What an export of a decayed engine must say: the PyTorch trainers' engine computes the
    running sum, so it loads these weights strictly and computes another function."""
    if model.carry_decay is None:
        return None
    if model.learn_carry_decay:
        return ("learn_carry_decay is set: every block's attn.decay_logit is a weight the PyTorch trainers' "
                "engine does not have; it would refuse these weights in a strict load. "
                "fractus_jax.reference.FractusEngine(**config) computes this function.")
    return (f"carry_decay={','.join(f'{g:g}' for g in model.carry_decay)} is set: the file's config records it, "
            "but the PyTorch trainers' engine has no carry decay; it would load these weights and compute "
            "another function. fractus_jax.reference.FractusEngine(**config) computes this one.")


def export_run(ckpt, out, opt: bool = False, hub: bool = False, log: Optional[Log] = None) -> list[Path]:
    """`export`: a run's latest (or given) checkpoint → FILE.pt|.bin|.safetensors [+ .opt]."""
    snap = load_run(ckpt, with_opt=opt)
    warning = decay_warning(snap.cfg.model)
    if warning and log is not None:
        log(warning)
    weights, opt_path = files.export_paths(out, opt, hub)
    model_state, config, extras = torch_checkpoint(snap)
    optimizer = optim.optimizer_to_torch(snap.opt_state, snap.params, snap.cfg, snap.step) if opt else None
    return files.write_files(weights, model_state, config, extras, opt_path, optimizer)


# ----------------------------------------------------------------------------- import

def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ConversionError(f"--out {out} exists and is not a directory")
    if out.exists() and ((out / rundir.MANIFEST).exists() or (out / rundir.CHECKPOINTS).exists()):
        raise ConversionError(f"--out {out} already holds a run; import into a new directory")


def _check_tensors(ck: files.TorchCheckpoint, sd: dict, cfg: TrainConfig, log: Log) -> None:
    model = cfg.model
    try:
        state_dicts.check_state_dict(sd, model)
    except ConversionError as e:
        raise ConversionError(f"{ck.path}: {e}") from None
    head = sd.get(names.TIED_HEAD)
    if head is not None and head is not sd["observe.weight"] and not bool((head == sd["observe.weight"]).all()):
        raise ConversionError(f"{ck.path}: output_head.weight differs from observe.weight; "
                              "the engine ties them (one tensor), the head would be lost")
    if ck.config:
        wrong = [f"{k}: file {ck.config[k]!r}, config {getattr(model, k)!r}"
                 for k in WEIGHT_FIELDS if k in ck.config and ck.config[k] != getattr(model, k)]
        if wrong:
            raise ConversionError(f"{ck.path}: the file's config differs in what decides the weights "
                                  f"({'; '.join(wrong)}); choose a matching --config or --set model.FIELD=VALUE")
        soft = [k for k in (*model.torch_kwargs(), "capacity_factor")
                if k not in (*WEIGHT_FIELDS, names.GATE_TEMPERATURE, CARRY_DECAY, LEARN_CARRY_DECAY) and k in ck.config
                and ck.config[k] != getattr(model, k)]
        for k in soft:
            log(f"{ck.path}: the file's {k} is {ck.config[k]!r}, the config's {getattr(model, k)!r} applies")
    _check_gate_temperature(ck, model.gate_temperature)
    dtypes = sorted({str(v.dtype).replace("torch.", "") for v in sd.values()} - {"float32"})
    if dtypes:
        log(f"{ck.path}: tensors stored as {', '.join(dtypes)} become float32 in the run")


CARRY_DECAY, LEARN_CARRY_DECAY = "carry_decay", "learn_carry_decay"


def _with_carry_decay(ck: files.TorchCheckpoint, cfg: TrainConfig, log: Log) -> TrainConfig:
    """The config with the file's carry decay: recorded by an export of a decayed run, it is
    part of the function the weights were trained in (learned: its weights are in the file,
    and the config's carry_decay only says where they started). A config that sets another
    is refused."""
    recorded = (ck.config or {}).get(CARRY_DECAY)
    learned = bool((ck.config or {}).get(LEARN_CARRY_DECAY, False))
    model = cfg.model
    if model.learn_carry_decay and not learned:
        raise ConversionError(f"{ck.path} holds no learned carry decay (its config has no {LEARN_CARRY_DECAY}): "
                              f"import without --set model.{LEARN_CARRY_DECAY}=true")
    if recorded is None:
        if model.carry_decay is not None:
            log(f"{ck.path} records no carry_decay (the PyTorch trainers' running sum); the config's "
                f"carry_decay {list(model.carry_decay)} applies, another function of these weights")
        return cfg
    try:
        decayed = model.replace(carry_decay=recorded, learn_carry_decay=learned)
    except ValueError as e:
        raise ConversionError(f"{ck.path}: the file's carry_decay {recorded!r}: {e}") from None
    if learned:
        if not model.learn_carry_decay:
            log(f"{ck.path}: the run learns the carry decay from the file's attn.decay_logit weights")
        return dataclasses.replace(cfg, model=decayed)
    if model.carry_decay is None:
        log(f"{ck.path}: the run computes the file's carry_decay {list(decayed.carry_decay)}")
        return dataclasses.replace(cfg, model=decayed)
    if not np.allclose(model.carry_decay, decayed.carry_decay, rtol=0, atol=1e-12):
        raise ConversionError(f"{ck.path}: the file's carry_decay is {list(decayed.carry_decay)}, the config's "
                              f"{list(model.carry_decay)}; the weights were trained with the file's: import with "
                              f"--set model.carry_decay={','.join(repr(g) for g in decayed.carry_decay)}")
    return cfg


def _gate_temperature_key(ck: files.TorchCheckpoint) -> Optional[str]:
    """The file's config key that holds the gate temperature the weights were trained at: the PyTorch
    trainers' gate_temp (what they set on the built module) before the constructor's gate_temperature."""
    return next((k for k in (names.GATE_TEMP, names.GATE_TEMPERATURE) if k in (ck.config or {})), None)


def _check_gate_temperature(ck: files.TorchCheckpoint, temperature: float) -> None:
    """Refuse a file whose gate temperature is not the config's: it is part of the function the weights
    were trained in."""
    key = _gate_temperature_key(ck)
    if key is None:
        return
    value = ck.config[key]
    try:
        file_temperature = float(value)
    except (TypeError, ValueError):
        file_temperature = math.nan
    if not 0.0 < file_temperature < math.inf:
        raise ConversionError(f"{ck.path}: the file's {key} is {value!r}, not a positive number")
    if not math.isclose(file_temperature, temperature, rel_tol=1e-6):
        raise ConversionError(
            f"{ck.path}: the file's {key} is {file_temperature!r}, the config's gate_temperature is {temperature!r}; "
            f"the weights were trained at the file's: import and train with "
            f"--set model.gate_temperature={file_temperature!r}")


def _carry(ck: files.TorchCheckpoint, sd: dict, cfg: TrainConfig, abstract, fresh: bool, log: Log):
    """(carry tree, last_lb_loss, kept, the carry's batch or None): the file's carried state, or zeros
    where it cannot continue."""
    model = cfg.model
    zeros = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract)
    keys = [k for k in names.state_keys(model) if k != names.LAST_LB]
    if not any(k in sd for k in keys):
        log(f"{ck.path} holds no carried state; the run starts from a zero carry")
        return zeros, 0.0, False, None
    thought = sd.get(names.THOUGHT)
    if thought is None or thought.dim() != 3:
        raise ConversionError(f"{ck.path}: thought_state is missing or not (B, 1, D)")
    B, D, N = thought.shape[0], model.d_model, model.n_oscillators
    want = {names.THOUGHT: (B, 1, D)}
    for i in range(model.n_layers):
        want[names.block_key(i, names.BLOCK_S)] = (B, D, D)
        want[names.block_key(i, names.BLOCK_Z)] = (B, D)
        want[names.block_key(i, names.BLOCK_PHASE)] = (B, None, N)   # (B, C, N): a chunk's phases
    problems = [f"missing carry buffer {k}" for k in want if k not in sd]
    for k, shape in want.items():
        got = tuple(sd[k].shape) if k in sd else None
        if got is not None and (len(got) != len(shape) or any(w is not None and w != g for w, g in zip(shape, got))):
            problems.append(f"wrong shape for {k}: checkpoint {got}, expected "
                            f"{tuple('C' if w is None else w for w in shape)}")
    if problems:
        raise ConversionError(f"{ck.path}: " + "; ".join(problems))
    last_lb = float(sd[names.LAST_LB]) if names.LAST_LB in sd and sd[names.LAST_LB].numel() == 1 else 0.0
    if fresh:
        log("--fresh-carry: the run starts from a zero carry")
        return zeros, 0.0, False, B
    if B != cfg.batch_size:
        log(f"{ck.path}: the carried state is for batch {B}, the config's batch_size is {cfg.batch_size}; "
            "the run starts from a zero carry")
        return zeros, 0.0, False, B
    carry = state_dicts.state_from_torch(sd, model)
    return jax.tree.map(lambda x, a: np.asarray(x, a.dtype), carry, abstract), last_lb, True, B


def _moments(ck: files.TorchCheckpoint, cfg: TrainConfig, params, opt_file, no_opt: bool,
             trust_pickle: bool, log: Log):
    template = jax.device_get(state_lib.make_optimizer(cfg, params).init(params))
    if no_opt:
        log("--no-opt: fresh optimizer moments (warmup advised)")
        return template
    if opt_file is not None:
        path, opt_sd = Path(opt_file), files.read_optimizer(opt_file, trust_pickle)
    else:
        candidates = files.optimizer_candidates(ck.path)
        path = next((p for p in candidates if p.exists()), None)
        if path is not None:
            opt_sd = files.read_optimizer(path, trust_pickle)
        elif ck.optimizer is not None:
            path, opt_sd = ck.path, ck.optimizer
        else:
            log(f"no optimizer file beside {ck.path} (looked for {', '.join(p.name for p in candidates)}): "
                "fresh optimizer moments (warmup advised)")
            return template
    if not (isinstance(opt_sd.get("state"), dict) and isinstance(opt_sd.get("param_groups"), (list, tuple))):
        raise ConversionError(f"{path}: not a PyTorch optimizer state dict")
    return optim.optimizer_from_torch(opt_sd, template, params, cfg, path, log)


def _as_int(ck: files.TorchCheckpoint, key: str, value) -> int:
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise ConversionError(f"{ck.path}: {key} is {value!r}, not an integer") from None
    if out < 0:
        raise ConversionError(f"{ck.path}: {key} is {out}, must be >= 0")
    return out


def _count(ck: files.TorchCheckpoint, key: str, value) -> Optional[int]:
    """An informational count of the file (a batch, tokens_processed), or None where absent or unreadable."""
    try:
        return None if value is None else _as_int(ck, key, value)
    except ConversionError:
        return None


def _trained_with(ck: files.TorchCheckpoint, cfg: TrainConfig, log: Log) -> None:
    """Name each trainer setting of the file that differs from the config's (the config's applies)."""
    settings = [("seq_len", ck.extras.get("seq_len"), "seq_len")]
    settings += [(k, (ck.config or {}).get(k), field) for k, field in names.TRAINER_KEYS.items()]
    for key, value, field in settings:
        if value is not None and value != getattr(cfg, field):
            log(f"{ck.path}: trained with {key} {value!r}, the config's {field} {getattr(cfg, field)!r} applies")


def _meta(ck: files.TorchCheckpoint, cfg: TrainConfig, carry_kept: bool, carry_batch: Optional[int],
          last_lb: float, log: Log) -> dict:
    ex = ck.extras
    step = _as_int(ck, "step", ex.get("step", 0))
    start = ex.get("start_token_next", ex.get("start_token"))
    start = None if start is None else _as_int(ck, "start_token_next", start)
    config = ck.config or {}
    # The lanes the offset was counted in.
    batches = [_count(ck, k, v) for k, v in (("batch_size", ex.get("batch_size")), ("batch", config.get("batch")),
                                             ("B", config.get("B")))]
    batch = next((b for b in batches if b is not None), carry_batch)
    tokens = _count(ck, names.TOKENS_PROCESSED, config.get(names.TOKENS_PROCESSED))
    if start is not None and batch is not None and batch != cfg.batch_size:
        log(f"{ck.path}: lane offset {start} was for batch {batch}; with batch_size {cfg.batch_size} the lanes "
            "differ, the offset is set to 0 (choose one with --set start_token=N when training)")
        start = None
    elif start is None and (step > 0 or tokens):
        lanes = ""
        if tokens:
            lanes = (f"; its {names.TOKENS_PROCESSED} {tokens} counts the ids of all lanes together, not an offset "
                     "inside a lane")
            if batch:
                lanes += (f": if the PyTorch run read its {batch} rows as lanes from their starts, as this trainer "
                          f"does, N = {tokens} / {batch} = {tokens // batch}")
        log(f"{ck.path} records no start_token_next: the run resumes at lane offset 0 unless the trainer "
            f"is given --set start_token=N{lanes}")
    _trained_with(ck, cfg, log)
    corpus = ex.get("corpus") if isinstance(ex.get("corpus"), dict) else {}
    return {"step": step, "start_token_next": start or 0, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
            "accum": cfg.accum, "corpus": corpus, "config": cfg.to_dict(), "ema_tf": None, "ema_ss": None,
            "last_lb_loss": last_lb, "imported_from": str(Path(ck.path).resolve()),
            "carry": "imported" if carry_kept else "zero"}


def import_checkpoint(pt, out, config: str, overrides: Sequence[str] = (), opt_file=None, no_opt: bool = False,
                      fresh_carry: bool = False, trust_pickle: bool = False, log: Log = print) -> dict:
    """`import`: a PyTorch checkpoint (+ its .opt) → a new run directory; returns its meta."""
    out = Path(out)
    _check_out(out)
    cfg = apply_overrides(load_config(config), list(overrides))
    ck = files.read_checkpoint(pt, trust_pickle)
    cfg = _with_carry_decay(ck, cfg, log)
    sd = state_dicts.strip_prefix(ck.model_state)
    _check_tensors(ck, sd, cfg, log)
    abstract = state_lib.abstract_train_state(cfg)
    params = jax.tree.map(lambda x, a: np.asarray(x, a.dtype), state_dicts.params_from_torch(sd, cfg.model),
                          abstract["params"])
    carry, last_lb, kept, carry_batch = _carry(ck, sd, cfg, abstract["carry"], fresh_carry, log)
    opt_state = _moments(ck, cfg, params, opt_file, no_opt, trust_pickle, log)
    meta = _meta(ck, cfg, kept, carry_batch, last_lb, log)
    if _gate_temperature_key(ck) is None:
        log(f"{ck.path} records no gate temperature ({names.GATE_TEMP}): the config's gate_temperature "
            f"{cfg.model.gate_temperature!r} applies; if the PyTorch run set another, import and train with "
            "--set model.gate_temperature=T")
    state = {"params": params, "opt_state": opt_state, "carry": carry,
             "step": np.asarray(meta["step"], np.int32),
             "skipped": np.asarray(_as_int(ck, "skipped", ck.extras.get("skipped", 0)), np.int32)}
    created = not out.exists()
    out_dir = rundir.RunDir(out, log=log).open()   # one writer: a trainer on out is refused, and refuses
    try:
        _check_out(out)   # still no run: nothing wrote one before the lock was taken
    except BaseException:
        out_dir.close(quiet=True)
        raise
    try:
        writer = ckpt_lib.RunCheckpointer(out, keep=cfg.keep_checkpoints, log=log)
        out_dir.checkpointer = writer
        writer.save(state, meta)
    except BaseException as e:
        out_dir.close(quiet=True)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        if isinstance(e, OSError):
            raise rundir.io_error("cannot write", out, e, None) from None
        raise
    out_dir.close()
    return meta
