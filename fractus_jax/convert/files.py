"""PyTorch-side checkpoint files: .pt / .bin (torch.save), safetensors, and the optimizer
file beside them (docs/spec.md §2, §6).

    FILE.pt | FILE.bin          torch.save({"model_state": state_dict, "config": {...},
                                            "step": ..., "start_token_next": ..., ...})
    FILE.safetensors            the same tensors (the tied head once), the config and the
                                other keys as JSON strings in the metadata
    FILE.opt | FILE.opt.bin     torch.save(optimizer.state_dict())   (.opt.bin: hub names)

Every failure to read becomes a ConversionError that names the file; writes go through a
temporary file and a rename, so a failed write leaves nothing half-written.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import numpy as np
import torch

from fractus_jax.convert import names
from fractus_jax.convert.state_dicts import ConversionError

SAFETENSORS = ".safetensors"
HUB_WEIGHTS, HUB_OPT, OPT = ".bin", ".opt.bin", ".opt"
# Top-level keys of a checkpoint dict besides model_state and config (round-tripped).
EXTRA_KEYS = ("step", "start_token_next", "start_token", "batch_size", "seq_len", "accum", "skipped",
              "corpus")
_STATE_DICT_KEYS = ("model_state", "state_dict", "model")
_OPTIMIZER_KEYS = ("optimizer_state", "optimizer")


@dataclasses.dataclass
class TorchCheckpoint:
    path: Path
    model_state: dict            # name → torch.Tensor, as stored (prefixes kept)
    config: Optional[dict]       # the constructor arguments, where the file has them
    extras: dict                 # step, start_token_next, batch_size, seq_len, corpus, ...
    optimizer: Optional[dict]    # an optimizer state dict stored inside the file, if any


def is_safetensors(path) -> bool:
    return Path(path).suffix == SAFETENSORS


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (HUB_OPT, OPT, HUB_WEIGHTS, SAFETENSORS, ".pth", ".pt"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def export_paths(out, opt: bool, hub: bool) -> tuple[Path, Optional[Path]]:
    """(weights file, optimizer file or None) for `export --out OUT [--opt] [--hub]`.

    --hub renames a .pt to .bin and writes the moments as <stem>.opt.bin (the hub ignores
    .pt); otherwise the moments go to <stem>.opt (<stem>.opt.bin beside a .bin)."""
    out = Path(out)
    if hub and not is_safetensors(out):
        out = out.with_name(_stem(out) + HUB_WEIGHTS)
    if not opt:
        return out, None
    hub_names = hub or out.suffix == HUB_WEIGHTS
    return out, out.with_name(_stem(out) + (HUB_OPT if hub_names else OPT))


def optimizer_candidates(weights) -> list[Path]:
    """Where `import` looks for the moments of WEIGHTS: <stem>.opt, then <stem>.opt.bin."""
    weights = Path(weights)
    return [weights.with_name(_stem(weights) + OPT), weights.with_name(_stem(weights) + HUB_OPT)]


# ----------------------------------------------------------------------------- reading

def _torch_load(path: Path, trust_pickle: bool, what: str):
    if not path.exists():
        raise ConversionError(f"{path}: no such file")
    if not path.is_file():
        raise ConversionError(f"{path} is not a file")
    if path.stat().st_size == 0:
        raise ConversionError(f"{path} is empty (a truncated or failed write?)")
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except pickle.UnpicklingError as e:
        text = str(e)
        if "Unsupported global" in text and not trust_pickle:
            detail = text.split("Unsupported global:", 1)[1].split(" was not", 1)[0].strip()
            raise ConversionError(
                f"{path}: the {what} holds a Python object torch.load will not read safely ({detail}); "
                "if you trust the file, pass --trust-pickle") from None
        raise ConversionError(f"{path} is truncated or corrupt (torch.load: {_first_line(text)})") from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile, KeyError, AttributeError,
            ImportError, TypeError, IndexError) as e:
        raise ConversionError(f"{path} is truncated or corrupt (torch.load: {_first_line(str(e))})") from None


def _first_line(text: str) -> str:
    """The first sentence of a library's error message."""
    line = text.strip().splitlines()[0] if text.strip() else "no detail"
    return line.split(". ", 1)[0].rstrip(".")[:200]


def _is_state_dict(obj) -> bool:
    return isinstance(obj, Mapping) and len(obj) > 0 and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())


def _plain(value):
    """A checkpoint's scalar extra (int, float, 0-d tensor) as a Python number."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, np.generic):
        return value.item()
    return value


def read_checkpoint(path, trust_pickle: bool = False) -> TorchCheckpoint:
    """A PyTorch checkpoint file (.pt, .bin, .pth or .safetensors)."""
    path = Path(path)
    if path.name.endswith(HUB_OPT) or path.suffix == OPT:
        raise ConversionError(f"{path} is an optimizer file; pass the weights file (the .opt is found beside it)")
    if is_safetensors(path):
        return _read_safetensors(path)
    obj = _torch_load(path, trust_pickle, "checkpoint")
    if not isinstance(obj, Mapping):
        raise ConversionError(f"{path} holds a {type(obj).__name__}, not a checkpoint dict")
    key = next((k for k in _STATE_DICT_KEYS if _is_state_dict(obj.get(k))), None)
    if key is not None:
        state = dict(obj[key])
    elif _is_state_dict(obj):
        state, obj = dict(obj), {}
    else:
        raise ConversionError(f"{path} holds no state dict (looked for a dict of tensors under "
                              f"{', '.join(_STATE_DICT_KEYS)}, or a bare state dict); keys: "
                              f"{', '.join(map(str, list(obj)[:12]))}")
    config = obj.get("config")
    config = dict(config) if isinstance(config, Mapping) else None
    extras = {k: _plain(obj[k]) for k in EXTRA_KEYS if k in obj}
    optimizer = next((obj[k] for k in _OPTIMIZER_KEYS if isinstance(obj.get(k), Mapping)), None)
    return TorchCheckpoint(path, state, config, extras, optimizer)


def _read_safetensors(path: Path) -> TorchCheckpoint:
    from safetensors import SafetensorError, safe_open   # the torch extra: loaded on use
    from safetensors.torch import load_file

    if not path.exists():
        raise ConversionError(f"{path}: no such file")
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as e:
        raise ConversionError(f"{path} is truncated or corrupt (safetensors: {_first_line(str(e))})") from None
    try:
        parsed = {k: json.loads(v) for k, v in metadata.items() if k != "format"}
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: the safetensors metadata is not JSON ({e})") from None
    if names.TIED_HEAD not in tensors and "observe.weight" in tensors:
        tensors[names.TIED_HEAD] = tensors["observe.weight"]   # stored once; tied again here
    config = parsed.get("config") if isinstance(parsed.get("config"), dict) else None
    extras = {k: parsed[k] for k in EXTRA_KEYS if k in parsed}
    return TorchCheckpoint(path, tensors, config, extras, None)


def read_optimizer(path, trust_pickle: bool = False) -> dict:
    """A PyTorch optimizer state dict ({"state": {i: {...}}, "param_groups": [...]})."""
    path = Path(path)
    obj = _torch_load(path, trust_pickle, "optimizer file")
    if not (isinstance(obj, Mapping) and isinstance(obj.get("state"), Mapping)
            and isinstance(obj.get("param_groups"), (list, tuple))):
        raise ConversionError(f"{path} is not a PyTorch optimizer state dict "
                              "(expected the keys 'state' and 'param_groups')")
    return dict(obj)


# ----------------------------------------------------------------------------- writing

def to_tensors(arrays: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """numpy → torch, each tensor its own storage except the tied head (observe.weight's)."""
    out = {}
    for key, value in arrays.items():
        if key == names.TIED_HEAD and "observe.weight" in arrays:
            continue
        out[key] = torch.from_numpy(np.array(value, copy=True, order="C"))
    if names.TIED_HEAD in arrays and "observe.weight" in out:
        out[names.TIED_HEAD] = out["observe.weight"]
    return {k: out[k] for k in arrays}


def _atomic_write(path: Path, write: Callable[[Path], None]) -> Path:
    """Write to a temporary neighbour; the caller renames it with `commit`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_files(weights: Path, model_state: Mapping[str, np.ndarray], config: dict, extras: dict,
                opt_path: Optional[Path] = None, optimizer: Optional[dict] = None) -> list[Path]:
    """Write the weights file (and the optimizer file); both appear only when both are done."""
    tensors = to_tensors(model_state)
    pending = []
    try:
        if is_safetensors(weights):
            from safetensors.torch import save_file
            once = {k: v for k, v in tensors.items() if k != names.TIED_HEAD}
            metadata = {"format": "pt", "config": json.dumps(config, sort_keys=True)}
            metadata.update({k: json.dumps(v, sort_keys=True) for k, v in extras.items()})
            pending.append((_atomic_write(weights, lambda p: save_file(once, str(p), metadata=metadata)), weights))
        else:
            blob = {"model_state": tensors, "config": config, **extras}
            pending.append((_atomic_write(weights, lambda p: torch.save(blob, p)), weights))
        if opt_path is not None:
            pending.append((_atomic_write(opt_path, lambda p: torch.save(optimizer, p)), opt_path))
    except BaseException:
        for tmp, _ in pending:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, final in pending:
        os.replace(tmp, final)
    return [final for _, final in pending]
