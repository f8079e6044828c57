"""Planning a run: every check a user can fail, before anything is written.

`prepare` opens the corpus, cuts it into the part the lanes read and the part held out,
finds the step a run directory resumes from and checks that the config can continue it.
A refused run leaves the disk as it was (docs/training.md).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Optional

import jax

from fractus_jax import model
from fractus_jax.atom import corpus as corpus_lib
from fractus_jax.atom.ids import VOCAB as ATOM_VOCAB
from fractus_jax.atom.reader import JoinedIds
from fractus_jax.config import WEIGHT_FIELDS
from fractus_jax.growth import GrowthError
from fractus_jax.lanes import LaneError, LaneReader, lane_layout
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import growth as growth_lib
from fractus_jax.train import rundir
from fractus_jax.train import state as state_lib
from fractus_jax.train import store
from fractus_jax.train.config import TrainConfig, resolve_for_mesh
from fractus_jax.train.errors import TrainError


@dataclasses.dataclass
class CorpusPart:
    """Ids [start, start + n_ids) of a corpus: the held-out part (or a val_corpus, whole)."""
    corpus: object
    start: int
    n_ids: int

    @property
    def ids(self):
        return self.corpus.ids[self.start:self.start + self.n_ids]

    @property
    def path(self):
        return self.corpus.path

    def describe(self) -> dict:
        return {"path": str(Path(self.corpus.path).resolve()), "start": self.start, "n_ids": self.n_ids}


@dataclasses.dataclass
class TrainPart:
    """What the lanes of a pass read: the first n_ids ids of the training stream, which is
    the corpus less its held-out range [held[0], held[1]) (fixed when the run started;
    None without val_fraction). Text appended to the corpus extends the stream past it."""
    corpus: object
    n_ids: int
    held: Optional[tuple[int, int]] = None

    @property
    def ids(self):
        ids = self.corpus.ids
        if self.held is None or self.n_ids <= self.held[0]:
            return ids[:self.n_ids]
        start, end = self.held
        return JoinedIds([ids[:start], ids[end:end + self.n_ids - start]])

    @property
    def path(self):
        return self.corpus.path

    def available(self) -> int:
        """The length of the training stream of the corpus as it is open."""
        return self.corpus.n_ids - (0 if self.held is None else self.held[1] - self.held[0])

    def head(self, n_ids: int) -> "TrainPart":
        return TrainPart(self.corpus, n_ids, self.held)


def split_corpus(corpus, val_fraction: float) -> tuple[TrainPart, Optional[CorpusPart]]:
    """(the part the lanes read, the part held out from its end or None): the last
    floor(val_fraction · n_ids) ids are held out."""
    n_val = int(corpus.n_ids * val_fraction)
    n_train = corpus.n_ids - n_val
    if not n_val:
        return TrainPart(corpus, n_train), None
    return TrainPart(corpus, n_train, (n_train, corpus.n_ids)), CorpusPart(corpus, n_train, n_val)


def resumed_parts(meta: dict, corpus, val_fraction: float) -> tuple[TrainPart, Optional[CorpusPart]]:
    """(train, held-out) of a run resumed from meta, over its corpus as it is now (the same,
    or grown by appending): the lanes read the extent they read (`train_ids`), the held-out
    range stays where the run's start put it (docs/training.md, A corpus that grows)."""
    recorded = meta.get("corpus") or {}
    n_then = int(recorded.get("n_ids", corpus.n_ids))
    held = None
    if val_fraction:
        record = meta.get("held_out") or {}
        start = int(record.get("start", meta.get("train_ids", n_then - int(n_then * val_fraction))))
        end = start + int(record.get("n_ids", n_then - start))
        held = (start, end) if end > start else None
    n_train = int(meta.get("train_ids", n_then - (0 if held is None else held[1] - held[0])))
    return TrainPart(corpus, n_train, held), (None if held is None else CorpusPart(corpus, held[0], held[1] - held[0]))


def steps_per_pass(n_ids: int, cfg: TrainConfig) -> int:
    """Steps from lane offset 0 until the lanes of n_ids ids wrap (lanes.LaneReader)."""
    return max(1, (n_ids // cfg.batch_size - 1) // (cfg.accum * cfg.seq_len))


def pass_record(number: int, first_step: int, train: TrainPart) -> dict:
    """What the manifest's `passes` says of one pass: the steps from first_step on read the
    first n_ids ids of the training stream, cut into the lanes; the corpus had corpus_ids."""
    return {"pass": number, "first_step": first_step, "n_ids": train.n_ids, "corpus_ids": train.corpus.n_ids}


def recorded_passes(meta: dict, train: TrainPart, cfg: TrainConfig) -> list[dict]:
    """The passes of a resumed run: as recorded, or, for a run from before they were, those
    of its one extent (a pass every steps_per_pass steps, from step 1)."""
    if meta.get("passes"):
        return [dict(p) for p in meta["passes"]]
    n_then = (meta.get("corpus") or {}).get("n_ids", train.corpus.n_ids)
    per, step = steps_per_pass(train.n_ids, cfg), int(meta["step"])
    return [{"pass": k, "first_step": k * per + 1, "n_ids": train.n_ids, "corpus_ids": n_then}
            for k in range(max(step - 1, 0) // per + 1)]


def next_pass_part(train: TrainPart, vocab: int, log, reopen: bool = True) -> TrainPart:
    """What the lanes of a new pass read: the whole training stream of the corpus as its
    file holds it now (reopened when `reopen`: text appended since enters here). A file
    that no longer begins with the run's ids, or that cannot be read now (a build in
    progress), is warned about and the corpus as the run opened it is kept."""
    corpus = train.corpus
    if reopen:
        try:
            now = corpus_lib.open_corpus(corpus.path)
            why = now.prefix_change(corpus.identity())
            if why is not None:
                raise corpus_lib.CorpusError(f"{why}: it no longer begins with the ids this run trained on")
            if now.n_ids > corpus.n_ids:
                now.validate(vocab=vocab)
                corpus = now
        except corpus_lib.CorpusError as e:
            log(f"warning: the next pass reads {corpus.path} as the run opened it ({corpus.n_ids} ids): {e}")
    return TrainPart(corpus, TrainPart(corpus, 0, train.held).available(), train.held)


@dataclasses.dataclass
class Plan:
    cfg: TrainConfig
    workdir: Path
    corpus: object
    resume_step: Optional[int]
    start_pos: int
    manifest: Optional[dict]   # the meta of the step to resume from (the manifest's facts)
    rejected: list = dataclasses.field(default_factory=list)   # (step, why) of newer steps that failed
    note: Optional[str] = None   # about the step to resume from (no checksums to check)
    train: Optional[TrainPart] = None    # what the lanes read (the whole corpus without val_fraction)
    val: Optional[CorpusPart] = None     # the held-out part (val_fraction's tail or val_corpus)
    passes: list = dataclasses.field(default_factory=list)   # the manifest's `passes`, to the current one
    notes: list = dataclasses.field(default_factory=list)    # said when the run starts
    init_from: Optional[str] = None   # cfg.init_from's checkpoint on this machine (a URL's, fetched)

    def __post_init__(self):
        if self.train is None:
            self.train = TrainPart(self.corpus, self.corpus.n_ids)
        if not self.passes:
            self.passes = [pass_record(0, 1, self.train)]


def open_training_corpus(cfg: TrainConfig, progress: bool = True):
    path = cfg.corpus
    if not path:
        if cfg.model.vocab_size != ATOM_VOCAB:
            raise TrainError("no corpus set: the embedded default corpus is an Atom (266-id) stream, "
                             f"this model's vocab is {cfg.model.vocab_size}; pass --set corpus=FILE")
        path = corpus_lib.build_default_corpus(rundir.cache_dir(), progress=progress)
    try:
        corpus = corpus_lib.open_corpus(path)
        corpus.validate(vocab=cfg.model.vocab_size)
    except corpus_lib.CorpusError as e:
        raise TrainError(str(e)) from None
    return corpus


def prepare(cfg: TrainConfig, workdir, progress: bool = True, explicit=frozenset(), checked=frozenset(),
            absent=None) -> Plan:
    """Every check a user can fail, before anything is written to workdir. `explicit`: the
    fields the user set on the command line (the others are the config file's). `checked`:
    steps whose files were just checked (`store.Mirror.checked`), not hashed again. `absent`:
    {step: files the stage may lack} of steps pulled in part (`store.Mirror.left_out`)."""
    workdir = Path(workdir)
    n = cfg.mesh.data * cfg.mesh.fsdp
    if n > jax.device_count():
        raise TrainError(f"mesh data={cfg.mesh.data} x fsdp={cfg.mesh.fsdp} needs {n} devices, "
                         f"{jax.device_count()} available")
    if cfg.batch_size % n:
        raise TrainError(f"batch_size {cfg.batch_size} is not divisible by the mesh's {n} devices "
                         f"(data={cfg.mesh.data} x fsdp={cfg.mesh.fsdp})")
    cfg = resolve_for_mesh(cfg)
    if cfg.grow_at:
        try:
            growth_lib.target_config(cfg, growth_lib.spec_of(cfg))
        except GrowthError as e:
            raise TrainError(f"grow_at={cfg.grow_at}: {e}") from None
    rows = cfg.model.moe_group_rows
    if cfg.model.capacity_factor is not None and (cfg.batch_size // n) % (rows or cfg.batch_size):
        raise TrainError(f"model.moe_group_rows={rows} ({rows or cfg.batch_size} rows per capacity group) does not "
                         f"divide the {cfg.batch_size // n} rows each of the {n} devices holds: a group would "
                         f"span devices (set model.moe_group_rows to a divisor of {cfg.batch_size // n})")
    streams = cfg.execution.row_streams
    if streams > 1 and n > 1:
        raise TrainError(f"execution.row_streams={streams} is for one device: a mesh of {n} devices "
                         "already runs its rows apart (set execution.row_streams=1)")
    if streams > 1 and (rows == 0 or cfg.batch_size % (streams * rows)):
        raise TrainError(f"batch_size {cfg.batch_size} does not split into execution.row_streams={streams} "
                         f"streams of whole MoE dispatch groups (model.moe_group_rows={rows}; "
                         "0 makes the batch one group)")
    for problem in cfg.conflicts():
        raise TrainError(problem)
    if workdir.exists() and not workdir.is_dir():
        raise TrainError(f"workdir {workdir} exists and is not a directory")
    rundir.check_not_in_run(workdir)
    manifest, rejected, note = resume_point(workdir, checked, absent)
    notes = []
    if manifest is not None:
        cfg = growth_lib.grown_model_for(cfg, manifest) or cfg
        cfg, split_note = keep_no_split(cfg, workdir, manifest, explicit)
        notes += [split_note] if split_note else []
        check_resume(cfg, workdir, manifest)
    corpus = open_training_corpus(cfg, progress)
    if manifest is None:
        train, val = split_corpus(corpus, cfg.val_fraction)
    else:
        check_corpus(workdir, manifest, corpus)
        train, val = resumed_parts(manifest, corpus, cfg.val_fraction)
    source = str(corpus.path) if val is None else f"the first {train.n_ids} ids (1 - val_fraction) of {corpus.path}"
    try:
        LaneReader(train.ids, cfg.batch_size, cfg.seq_len, cfg.accum, source=source)
    except LaneError as e:
        raise TrainError(str(e)) from None
    if cfg.val_corpus:
        val = open_val_corpus(cfg)
    if cfg.eval_every:
        check_val_slice(cfg, val)
    if manifest is None:
        init_from = check_init_from(cfg) if cfg.init_from else None   # last: it may fetch from a store
        return Plan(cfg, workdir, corpus, None, cfg.start_token or 0, None, train=train, val=val, init_from=init_from)
    pos = cfg.start_token if cfg.start_token is not None else int(manifest["start_token_next"])
    return Plan(cfg, workdir, corpus, int(manifest["step"]), pos, manifest, rejected, note, train=train, val=val,
                passes=recorded_passes(manifest, train, cfg), notes=notes)


def check_init_from(cfg: TrainConfig) -> str:
    """init_from names a checkpoint whose weights fit the config's engine, so that the new
    run's state is built around them (nothing else to initialise). Returns its local path: a
    path as it is, a URL's step fetched into the read cache (its weights alone)."""
    try:
        path = store.readable(cfg.init_from, items=ckpt_lib.WEIGHTS_ITEMS, log=lambda m: print(m, file=sys.stderr))
        _, step, source = ckpt_lib.checkpoint_config(path, items=ckpt_lib.WEIGHTS_ITEMS)
    except rundir.CheckpointError as e:
        raise TrainError(f"init_from={cfg.init_from}: {e}") from None
    differ = [f"{k}: {getattr(source.model, k)!r} there, {getattr(cfg.model, k)!r} here" for k in
              (*WEIGHT_FIELDS, "learn_carry_decay") if getattr(source.model, k) != getattr(cfg.model, k)]
    if differ:
        raise TrainError(f"init_from={cfg.init_from}: the weights of its step {step} are another engine's "
                         f"({'; '.join(differ)}); set the config's model to the source's")
    return path


def keep_no_split(cfg: TrainConfig, workdir: Path, manifest: dict, explicit=frozenset()):
    """(cfg, note): a run that held out nothing (val_fraction 0, or a run from before held-out
    splits) resumed with a config FILE that holds out a part (atom_1b's, since it does)
    keeps its lanes over the whole corpus: val_fraction 0, and no held-out score unless a
    val_corpus is set. A val_fraction set on the command line is the user's: check_resume
    refuses it, as any change of the lanes."""
    old = manifest.get("config") or {}
    if float(old.get("val_fraction", 0.0)) or not cfg.val_fraction or "val_fraction" in explicit:
        return cfg, None
    kept = dataclasses.replace(cfg, val_fraction=0.0, eval_every=cfg.eval_every if cfg.val_corpus else 0)
    scored = ("" if cfg.val_corpus or not cfg.eval_every else
              "; it scores nothing held out (val_corpus=FILE scores a file of its own)")
    return kept, (f"note: {workdir} began without a held-out part: it keeps its lanes over the whole corpus, "
                  f"the config's val_fraction={cfg.val_fraction:g} is not applied{scored}")


def check_corpus(workdir: Path, manifest: dict, corpus) -> None:
    """The corpus must begin with the ids the checkpoint's corpus held: the same corpus, or
    that one with text appended (the lane offsets then mean the same text)."""
    why = corpus.prefix_change(manifest.get("corpus") or {})
    if why is not None:
        raise TrainError(f"{workdir}: the corpus is not the one the checkpoint at step {manifest['step']} trained on, "
                         f"nor that one with text appended: {why}. A corpus may only grow at its end (python -m "
                         "fractus_jax.atom build adds new sources there); another corpus needs another run directory")


def open_val_corpus(cfg: TrainConfig) -> CorpusPart:
    try:
        corpus = corpus_lib.open_corpus(cfg.val_corpus)
        corpus.validate(vocab=cfg.model.vocab_size)
    except corpus_lib.CorpusError as e:
        raise TrainError(f"val_corpus: {e}") from None
    return CorpusPart(corpus, 0, corpus.n_ids)


def check_val_slice(cfg: TrainConfig, val: Optional[CorpusPart]) -> None:
    if val is None:   # val_fraction so small that no id is held out
        raise TrainError(f"val_fraction={cfg.val_fraction:g} of {cfg.corpus or 'the corpus'} holds out no id")
    n = min(cfg.val_ids, val.n_ids)
    try:
        lane_layout(n, cfg.val_lanes, cfg.seq_len)
    except LaneError as e:
        raise TrainError(f"the held-out slice ({n} ids of {val.path}, val_lanes={cfg.val_lanes}, "
                         f"chunks of seq_len={cfg.seq_len}): {e}") from None


def resume_point(workdir: Path, checked=frozenset(), absent=None):
    """(meta, rejected, note) of the step a run in workdir resumes from: the newest committed
    step whose files match their checksums and whose meta reads, whatever the manifest says
    (it may lag a crash, or be gone). (None, [], None) for a fresh run. Reads only."""
    if not workdir.exists():
        return None, [], None
    try:
        step, meta, rejected, note = ckpt_lib.newest_good_step(workdir, checked=checked, absent=absent)
    except OSError as e:
        raise TrainError(f"cannot read the checkpoints of {workdir}: {rundir.reason(e)}") from None
    if step is None:
        if rejected:
            raise TrainError(ckpt_lib.no_good_step_message(workdir, rejected))
        if (workdir / rundir.MANIFEST).exists():
            raise TrainError(f"{workdir / rundir.MANIFEST} names a checkpoint, but {workdir / rundir.CHECKPOINTS} "
                             "holds none; move the manifest away to start afresh in this directory")
        return None, [], None
    if "config" not in meta:   # older checkpoints: the config is the manifest's
        try:
            meta["config"] = (rundir.read_manifest(workdir) or {})["config"]
        except (KeyError, rundir.CheckpointError):
            raise TrainError(f"{workdir}: step {step} records no config and there is no manifest with one") from None
    return meta, rejected, note


def check_resume(cfg: TrainConfig, workdir: Path, manifest: dict) -> None:
    old = manifest.get("config", {})
    old_model = old.get("model", {})
    if old_model.get("vocab_size") != cfg.model.vocab_size:
        raise TrainError(f"{workdir}: the checkpoint's vocab is {old_model.get('vocab_size')}, "
                         f"the config's is {cfg.model.vocab_size}")
    changed = [f"{k}: checkpoint {old_model.get(k)!r}, config {getattr(cfg.model, k)!r}"
               for k in WEIGHT_FIELDS if old_model.get(k) != getattr(cfg.model, k)]
    if changed:
        raise TrainError(f"{workdir}: the model differs from the checkpoint's ({'; '.join(changed)})")
    learned = bool(old_model.get("learn_carry_decay", False))   # runs from before it learned none
    if learned != cfg.model.learn_carry_decay:
        raise TrainError(f"{workdir}: model.learn_carry_decay was {str(learned).lower()} and is now "
                         f"{str(cfg.model.learn_carry_decay).lower()}: the checkpoint holds "
                         f"{'' if learned else 'no '}attn.decay_logit weights (keep "
                         f"model.learn_carry_decay={str(learned).lower()})")
    for key in ("batch_size", "seq_len", "accum"):
        if manifest.get(key, old.get(key)) != getattr(cfg, key):
            raise TrainError(f"{workdir}: {key} was {manifest.get(key, old.get(key))} and is now "
                             f"{getattr(cfg, key)}; the lanes would change (keep {key}={manifest.get(key)})")
    # A run from before held-out splits records none: it held out nothing.
    was = float(old.get("val_fraction", 0.0))
    if was != cfg.val_fraction:
        before = " (a run from before held-out splits)" if "val_fraction" not in old else ""
        raise TrainError(f"{workdir}: val_fraction was {was:g}{before} and is now {cfg.val_fraction:g}; the lanes "
                         f"would change (keep val_fraction={was:g}, with eval_every=0 or a held-out "
                         "file to score: val_corpus=FILE)")
    lacking = moments_lacking(old, cfg)
    if lacking:
        keep = [f"{k}={old[k]}" for k in LOSS_REACH_FIELDS if k in old and old[k] != getattr(cfg, k)]
        fed = _fed_features(old)
        if fed is not None and fed != cfg.model.packet_features:
            keep.append(f"model.packet_features={str(fed).lower()}")
        raise TrainError(f"{workdir}: the optimizer would now step {', '.join(lacking[:4])}"
                         f"{', ...' if len(lacking) > 4 else ''}, which the checkpoint's run left alone (the loss "
                         f"did not reach them) and holds no moments for; keep " + ", ".join(keep))
    if cfg.start_token == 0:
        raise TrainError(f"{workdir} has a checkpoint at step {manifest['step']}: start_token=0 would restart "
                         f"the data; drop it to resume at {manifest['start_token_next']}")


LOSS_REACH_FIELDS = ("step_unreached", "lb_coef", "repeat_coef", "bptt_chunks")


def _fed_features(old: dict) -> Optional[bool]:
    """Whether the run of config dict `old` fed packet features (its model's packet_features,
    or the top-level feats of a run from before they joined the engine's config)."""
    value = old.get("feats", (old.get("model") or {}).get("packet_features"))
    return None if value is None else bool(value)


def moments_lacking(old: dict, cfg: TrainConfig) -> list[str]:
    """The parameters cfg's optimizer steps that the checkpoint's (config dict `old`) left
    alone, so that its optimizer state holds no moments for them. A checkpoint from before
    unreached parameters were left alone (no step_unreached in its config) has moments for
    every parameter: none lacking."""
    if "step_unreached" not in old:
        return []
    was = dataclasses.replace(cfg, **{k: old[k] for k in LOSS_REACH_FIELDS if k in old})
    if _fed_features(old) is not None:
        was = dataclasses.replace(was, model=was.model.replace(packet_features=_fed_features(old)))
    if was == cfg:
        return []
    abstract = jax.eval_shape(lambda: model.init_params(cfg.model, jax.random.PRNGKey(0)))
    now, then = state_lib.optimizer_labels(cfg, abstract), state_lib.optimizer_labels(was, abstract)
    return [jax.tree_util.keystr(p) for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(now)[0],
                                                          jax.tree.leaves(then)) if a == "train" and b != "train"]


SCHEDULE_FIELDS = ("lr", "warmup_steps", "lr_schedule", "lr_floor", "decay_steps")


def schedule_change_note(old_config: dict, cfg: TrainConfig, step: int) -> Optional[str]:
    """A note when the learning-rate schedule differs from the checkpoint's: the run goes on
    from its step on the new curve (the same fields continue the same curve exactly)."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in SCHEDULE_FIELDS}
    changed = [f"{k} {old_config.get(k, defaults[k])} -> {getattr(cfg, k)}" for k in SCHEDULE_FIELDS
               if old_config.get(k, defaults[k]) != getattr(cfg, k)]
    if not changed:
        return None
    return (f"note: the learning-rate schedule differs from the checkpoint's ({', '.join(changed)}); "
            f"from step {step} the run follows the new one")
