"""Real kills: a trainer and a shard build, each a subprocess, killed by SIGKILL from this
process, and what the next start makes of what they left.

The trainer (the tiny run to step 6, save_every=2) is killed inside the asynchronous save of
step 4, at four moments it is held at until the kill: while Orbax writes the arrays into the
step's temporary directory, when everything is written and only the commit (the rename) is
left, after the commit and before the checksums, after the checksums and before the
manifest. It is also killed, with nothing holding it, at seeded random delays after the
step's temporary directory appeared. Each time the same config resumes it in this process:
at the newest step the kill left committed (step 4, or 6 for a kill that came late), or,
where the kill came before step 4's commit, back at step 2 with a note naming the leftover it
removed; and in every case it ends equal bit for bit to the run that was never interrupted
(weights, moments, carry, a metrics log of steps 1-6). Any other outcome fails.

`python -m fractus_jax.atom build` into a directory of shards is killed while a shard is
written, after a shard's index and before its rename, and at seeded random points. The
files the kill leaves are never read as shards: the shards present are whole and read as a
prefix of the full stream, and the same command run again completes it to exactly the one
file built from the same sources.

The children report the moments they pass on a pipe ("name time" lines, time.monotonic,
which every process of the machine shares), so that the kill can be aimed and what it
interrupted be shown.
"""
import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fractus_jax.atom import build as build_lib
from fractus_jax.atom.__main__ import main as atom_main
from fractus_jax.atom.corpus import build_corpus, open_corpus
from fractus_jax.atom.reader import read_index, shard_paths
from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import rundir
from test_faults import ROOT, assert_same_state, metrics_steps, strict, train

SEED = 20240613
CHILD_TIMEOUT = 600   # seconds for a child to reach the moment it is killed at (a slow CPU)

# ----------------------------------------------------------------------------- children

# The trainer: the config given, with hooks that report each moment of a save and hold the
# process at the one asked for (`hold`) until it is killed. Each hook wraps a function of the
# save path, patched as a module attribute; the function itself still runs. Three are
# Orbax's own (as of orbax-checkpoint 0.12): where a later Orbax moves them, the test fails
# saying the child never reached the moment, and the hook is to be moved with them.
TRAINER = r'''
import json, os, re, sys, time
args = json.loads(sys.argv[1])

def reached(name):
    os.write(args["fd"], f"{name} {time.monotonic():.6f}\n".encode())
    if name == args["hold"]:
        time.sleep(3600)   # held here until the SIGKILL

from orbax.checkpoint._src.path import async_path, atomicity
from orbax.checkpoint._src.serialization import serialization
from fractus_jax.train import checkpoint as ckpt_lib, loop, prepare as prepare_lib, rundir
from fractus_jax.train.config import TrainConfig

# atomicity._create_tmp_directory: Orbax makes DIR/checkpoints/<step>.orbax-checkpoint-tmp
# (and each item's temporary directory inside it) as a save starts.
create_tmp = atomicity._create_tmp_directory
async def create_tmp_hook(mkdir, tmp_dir, **kw):
    out = await create_tmp(mkdir, tmp_dir, **kw)
    step = tmp_dir.name.split(".")[0]
    if step.isdigit():
        reached(f"tmp {step}")
    return out
atomicity._create_tmp_directory = create_tmp_hook

# serialization.async_serialize_from_host: writes one array into an item's temporary
# directory, in Orbax's background thread. "arrays N": the first array of step N's params is
# written; the item's other arrays, and its commit, wait on this thread.
serialize = serialization.async_serialize_from_host
PARAMS_TMP = re.compile(r"/(\d+)\.orbax-checkpoint-tmp[^/]*/params\.orbax-checkpoint-tmp[^/]*/")
first_array = set()
async def serialize_hook(value, tspec, *a, **kw):
    out = await serialize(value, tspec, *a, **kw)
    m = PARAMS_TMP.search(json.dumps(tspec))
    if m and m.group(1) not in first_array:
        first_array.add(m.group(1))
        reached(f"arrays {m.group(1)}")
    return out
serialization.async_serialize_from_host = serialize_hook

# async_path.rename: AtomicRenameTemporaryPath.finalize commits each item, then the step, by
# this rename. "rename N": every item of step N is written and committed inside the
# temporary directory; the step's own rename (its commit) is next.
rename = async_path.rename
async def rename_hook(src, dst):
    step = dst.name if dst.name.isdigit() else None
    if step:
        reached(f"rename {step}")
    out = await rename(src, dst)
    if step:
        reached(f"renamed {step}")
    return out
async_path.rename = rename_hook

def around(module, name, before, after):
    """module.name reports before(*args) as it starts and after(*args) once it returned."""
    real = getattr(module, name)
    def hook(*args):
        reached(before(*args))
        real(*args)
        reached(after(*args))
    setattr(module, name, hook)

# checkpoint.write_checksums: RunCheckpointer.wait records a committed step's checksums.
around(ckpt_lib, "write_checksums", lambda d, _: f"checksums {d.name}", lambda d, _: f"checksummed {d.name}")
# rundir.write_manifest: then RunCheckpointer.wait writes the manifest that names the step.
around(rundir, "write_manifest", lambda _, m: f"manifest {m['step']}", lambda _, m: f"manifested {m['step']}")

cfg = TrainConfig.from_dict(args["config"])
loop.run(prepare_lib.prepare(cfg, args["workdir"], progress=False), progress=False, log=print)
reached("done")
if args["hold"] is None:
    time.sleep(3600)   # a kill at a random delay finds the process, however late it comes
'''

# The shard build (`python -m fractus_jax.atom build`'s main), with hooks that report and
# hold, as the trainer's.
BUILDER = r'''
import json, os, sys, time
from pathlib import Path
args = json.loads(sys.argv[1])

def reached(name):
    os.write(args["fd"], f"{name} {time.monotonic():.6f}\n".encode())
    if name == args["hold"]:
        time.sleep(3600)   # held here until the SIGKILL

from fractus_jax.atom import build as build_lib
from fractus_jax.atom.__main__ import main

# build._encode_into: writes one shard's sources into its shard-N.u16.tmp.
shard = {"name": None, "sources": 0}
encode_into = build_lib._encode_into
def encode_into_hook(dst, files, index, field, bar):
    shard.update(name=Path(dst.name).name.split(".")[0], sources=0)
    return encode_into(dst, files, index, field, bar)
build_lib._encode_into = encode_into_hook

# build.encode_source: one source's ids, as _encode_into writes them. "encode shard-N": the
# shard's first source is written into its .tmp, the second is next.
encode_source = build_lib.encode_source
def encode_source_hook(path, field="text"):
    shard["sources"] += 1
    if shard["sources"] == 2:
        reached(f"encode {shard['name']}")
    yield from encode_source(path, field)
build_lib.encode_source = encode_source_hook

# build._write_json: a shard's index, written before the shard's rename into place.
# "index shard-N": the index is written, the shard is still its .tmp.
write_json = build_lib._write_json
def write_json_hook(path, obj):
    write_json(path, obj)
    reached(f"index {Path(path).name[:-len('.u16.json')]}")
build_lib._write_json = write_json_hook

sys.exit(main(args["argv"]))
'''


class Child:
    """A subprocess of this repository's Python: a program given as text (`code`, its one
    argument the JSON of `args` plus "fd", the pipe it reports moments on), or `argv` as is.
    Its output goes to `log`."""

    def __init__(self, log: Path, code=None, args=None, argv=None):
        self.log = log
        self.events, self._buf, self._eof = [], b"", code is None
        read, write = os.pipe() if code is not None else (None, None)
        self._fd = read
        cmd = [sys.executable, "-c", code, json.dumps({**args, "fd": write})] if code is not None else argv
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         pass_fds=(write,) if write is not None else ())
        if write is not None:
            os.close(write)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()   # however the test went: no child outlives it

    def output(self) -> str:
        return self.log.read_text()[-4000:]

    def _read(self, timeout: float) -> None:
        if self._eof or not select.select([self._fd], [], [], max(timeout, 0))[0]:
            return
        chunk = os.read(self._fd, 1 << 16)
        if not chunk:
            self._eof = True
            return
        *lines, self._buf = (self._buf + chunk).split(b"\n")
        for line in lines:
            name, t = line.decode().rsplit(" ", 1)
            self.events.append((name, float(t)))

    def wait_for(self, name: str, timeout: float = CHILD_TIMEOUT) -> float:
        """The time the child reported `name` at; fails when it ends or times out first."""
        deadline = time.monotonic() + timeout
        while True:
            for n, t in self.events:
                if n == name:
                    return t
            if self._eof or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"the child never reached {name!r} (exit {self.proc.returncode}; it reported "
                            f"{[n for n, _ in self.events][-8:]}):\n{self.output()}")
            self._read(min(1.0, deadline - time.monotonic()))

    def kill(self) -> None:
        """SIGKILL, then every moment it had reported (the pipe outlives it)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while not self._eof and time.monotonic() < deadline:
            self._read(1.0)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def assert_killed(self) -> None:
        assert self.proc.returncode == -signal.SIGKILL, (self.proc.returncode, self.output())

    def reported(self, prefix: str) -> list[int]:
        """The steps N of the events `prefix N` reported."""
        return [int(n.split()[1]) for n, _ in self.events if n.split()[0] == prefix]


# ----------------------------------------------------------------------------- the trainer

def kill_trainer(cfg, d: Path, log: Path, hold=None, fraction=None) -> tuple[Child, float]:
    """Run the trainer on d and SIGKILL it: when it reports `hold` (held there), or, nothing
    holding it, `fraction` times its step-2 save's time (from the temporary directory to the
    commit) after step 4's temporary directory appeared. (the child, that delay)."""
    delay = 0.0
    with Child(log, TRAINER, {"config": cfg.to_dict(), "workdir": str(d), "hold": hold}) as child:
        if hold is not None:
            child.wait_for(hold)
        else:
            delay = fraction * (child.wait_for("renamed 2") - child.wait_for("tmp 2"))
            t = child.wait_for("tmp 4")
            time.sleep(max(0.0, t + delay - time.monotonic()))
    child.assert_killed()
    return child, delay


def resume_and_check(cfg6, straight_dir: Path, d: Path) -> tuple[int, list[str]]:
    """Resume d to step 6 in this process; it must equal the uninterrupted run bit for bit.
    (the step it resumed at, its log lines)."""
    last, logs = train(cfg6, d)
    found = [(int(m[1]), int(m[2])) for line in logs
             if (m := re.fullmatch(rf"resumed {re.escape(str(d))} at step (\d+), lane offset (\d+)", line))]
    assert len(found) == 1, logs
    step, offset = found[0]
    assert offset == step * cfg6.seq_len, logs
    if step < cfg6.max_steps:
        assert last["step"] == cfg6.max_steps, logs
    assert_same_state(straight_dir, d, cfg6)
    assert metrics_steps(d) == [1, 2, 3, 4, 5, 6]
    manifest = strict((d / "manifest.json").read_text())
    assert manifest["step"] == 6 and manifest["checkpoint"] == "checkpoints/6"
    assert not [p for p in (d / "checkpoints").rglob("*") if rundir.ORBAX_TMP in p.name]
    assert {ckpt_lib.check_files(p)[0] for p in (d / "checkpoints").iterdir()} == {"ok"}
    return step, logs


def removed_note(d: Path, step: int, logs) -> list[str]:
    """The notes of the leftovers of step's unfinished write, removed at the start."""
    tmp = str(d / "checkpoints" / f"{step}{rundir.ORBAX_TMP}")
    return [line for line in logs if line.startswith(f"note: removed {tmp}")
            and line.endswith(", left by a write that did not finish")]


@pytest.mark.parametrize("moment, resumed_at", [
    ("arrays 4", 2),       # Orbax writing step 4's arrays into its temporary directory
    ("rename 4", 2),       # step 4 written whole in its temporary directory, not yet committed
    ("checksums 4", 4),    # step 4 committed, no checksums yet
    ("manifest 4", 4),     # step 4 committed and checksummed, the manifest still names step 2
], ids=lambda x: str(x).replace(" 4", ""))
def test_a_sigkill_at_each_moment_of_an_async_save_resumes_bit_exact(moment, resumed_at, straight, tmp_path):
    cfg6, straight_dir = straight
    d = tmp_path / "run"
    child, _ = kill_trainer(cfg6, d, tmp_path / "trainer.log", hold=moment)
    # The kill left the save as the moment says; the manifest names step 2.
    ck = d / "checkpoints"
    assert strict((d / "manifest.json").read_text())["step"] == 2
    assert child.reported("manifested") == [2]
    tmp = list(ck.glob(f"4{rundir.ORBAX_TMP}*"))
    if resumed_at == 2:
        assert len(tmp) == 1 and not (ck / "4").exists(), sorted(p.name for p in ck.iterdir())
        items = {p.name for p in tmp[0].iterdir() if p.is_dir()}
        if moment == "arrays 4":   # params still in its own temporary directory, its arrays in part
            params = [tmp[0] / i for i in items if i.startswith(f"params{rundir.ORBAX_TMP}")]
            assert len(params) == 1 and any(p.parent.name == "d" for p in params[0].rglob("*") if p.is_file()), items
        else:                      # every item committed inside; the step itself not
            assert set(ckpt_lib.ITEMS) <= items
    else:
        assert not tmp and (ck / "4").is_dir()
        assert (ck / "4" / ckpt_lib.CHECKSUMS).exists() == (moment == "manifest 4")

    step, logs = resume_and_check(cfg6, straight_dir, d)
    assert step == resumed_at, logs
    if moment in ("arrays 4", "rename 4"):
        assert removed_note(d, 4, logs), logs
    if moment == "checksums 4":
        assert any("step 4 has no checksums" in line for line in logs), logs
    if moment == "manifest 4":
        assert (f"note: repaired {d / 'manifest.json'}: it was named step 2, the newest good checkpoint "
                "is step 4") in logs


@pytest.mark.parametrize("draw", range(3))
def test_a_sigkill_at_a_random_moment_of_an_async_save_resumes_bit_exact(draw, straight, tmp_path):
    """Killed, nothing holding the process, at a delay after step 4's temporary directory
    appeared: a seeded draw of a fraction of the time the same process took to commit step 2,
    within the draw's third of 0-1.5, so that the kills fall while the arrays are written, near
    the commit, and after it (the checksums, the manifest, steps 5 and 6, the save of step 6)."""
    cfg6, straight_dir = straight
    seed = SEED + draw
    fraction = (draw + random.Random(seed).random()) * 1.5 / 3
    d = tmp_path / "run"
    child, delay = kill_trainer(cfg6, d, tmp_path / "trainer.log", fraction=fraction)
    t_tmp = child.wait_for("tmp 4")
    passed = [f"{n} (+{t - t_tmp:.3f} s)" for n, t in child.events if t >= t_tmp]
    print(f"seed {seed}: SIGKILL {delay:.3f} s ({fraction:.3f} of step 2's save) after step 4's temporary "
          f"directory appeared; the moments passed since: {passed}")
    step, logs = resume_and_check(cfg6, straight_dir, d)
    print(f"seed {seed}: resumed at step {step}")
    # The newest step whose commit was reported, or one whose commit had begun (its report
    # lost to the kill); never an older one.
    committed, begun = max(child.reported("renamed")), max(child.reported("rename"))
    assert step == committed or step == begun > committed, (step, child.events[-6:], logs)
    # A newer step's unfinished write was removed, saying so.
    for newer in (s for s in child.reported("tmp") if s > step):
        assert removed_note(d, newer, logs), (newer, logs)


# ----------------------------------------------------------------------------- atom build

SOURCES = 90
SHARD_MB = 12 / 1024     # about two sources a shard: some 40 shards


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """(a directory of SOURCES text files of about 5 kB, the ids of the one file built from them)."""
    base = tmp_path_factory.mktemp("atom_kills")
    rng = np.random.default_rng(SEED)
    words = ["shard", "lane", "kill", "def", "return", "(x, y)", "the", "stream", "of", "ids", "\n", "    ", "#"]
    src = base / "src"
    src.mkdir()
    for k in range(SOURCES):
        text = " ".join(rng.choice(words, size=int(rng.integers(800, 1100))))
        (src / f"{k:03d}.txt").write_text(f"# source {k}\n{text}\n")
    build_corpus([src], base / "one.u16", progress=False, log=lambda m: None)
    return src, np.asarray(open_corpus(base / "one.u16").ids)


def build_argv(src, out):
    return ["build", "--src", str(src), "--out", str(out), "--shard-mb", repr(SHARD_MB), "--quiet"]


def shard_names(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if build_lib.shard_number(p) is not None) if out.is_dir() else []


def assert_whole_prefix(out: Path, full) -> dict:
    """What a reader takes from out: shard-000000.u16 ... in order, each whole (the size its
    index says), and no other file (a .tmp, an index without its shard); their ids a prefix of
    the full stream. The corpus record (for prefix_change), or {} when there is no shard yet."""
    names = shard_names(out)
    assert names == [f"shard-{k:06d}.u16" for k in range(len(names))], names
    if not names:
        return {}
    paths, _ = shard_paths(out)
    assert [p.name for p in paths] == names   # the files a reader takes are the shards
    for p in paths:
        assert read_index(p)["n_ids"] * 2 == p.stat().st_size, p
    corpus = open_corpus(out)
    np.testing.assert_array_equal(np.asarray(corpus.ids), full[:corpus.n_ids])
    assert corpus.n_ids < full.size   # the build was cut
    return corpus.identity()


def rebuild_and_check(src, out: Path, full, records) -> None:
    """The same command again completes the stream: the one file's ids, the shards written
    before the kills unchanged, nothing left of the kills."""
    assert atom_main(build_argv(src, out)) == 0
    corpus = open_corpus(out)
    np.testing.assert_array_equal(np.asarray(corpus.ids), full)
    for record in records:
        assert corpus.prefix_change(record) is None
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([*shard_names(out), *(f"{n}.json" for n in shard_names(out))]), names
    assert atom_main(build_argv(src, out)) == 0 and open_corpus(out).n_ids == full.size   # up to date


@pytest.mark.parametrize("moment", ["encode", "index"])
def test_atom_build_killed_inside_a_shard_write_leaves_whole_shards(moment, sources, tmp_path):
    """Held, then killed, inside the third shard's write: its first source written into its
    .tmp (encode), or its index written and the shard not yet renamed into place (index)."""
    src, full = sources
    out = tmp_path / "shards"
    hold = f"{moment} shard-000002"
    with Child(tmp_path / "build.log", BUILDER, {"argv": build_argv(src, out), "hold": hold}) as child:
        child.wait_for(hold)
    child.assert_killed()
    left = sorted(p.name for p in out.iterdir())
    assert "shard-000002.u16.tmp" in left and "shard-000002.u16" not in left, left
    assert ("shard-000002.u16.json" in left) == (moment == "index"), left
    if moment == "encode":
        assert (out / "shard-000002.u16.tmp").stat().st_size > 0   # the first source's ids, in part at least
    record = assert_whole_prefix(out, full)
    assert shard_names(out) == ["shard-000000.u16", "shard-000001.u16"]
    rebuild_and_check(src, out, full, [record])


def test_atom_build_killed_at_random_points_completes_to_the_one_file(sources, tmp_path):
    """`python -m fractus_jax.atom build` killed three times over the same directory, each a
    seeded number of new shards in (plus a seeded pause of up to 2 ms), nothing holding it;
    the next run starts on what the last kill left."""
    src, full = sources
    out = tmp_path / "shards"
    rng = random.Random(SEED)
    records = []
    for kill in range(3):
        before = len(shard_names(out))
        new, pause = rng.randint(1, 10), rng.uniform(0.0, 0.002)
        argv = [sys.executable, "-m", "fractus_jax.atom", *build_argv(src, out)]
        with Child(tmp_path / f"build{kill}.log", argv=argv) as child:
            deadline = time.monotonic() + CHILD_TIMEOUT
            while len(shard_names(out)) < before + new and child.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.0005)
            time.sleep(pause)
        child.assert_killed()
        left = sorted(p.name for p in out.iterdir() if p.name.endswith(".tmp"))
        print(f"seed {SEED}, kill {kill}: SIGKILL {pause * 1000:.2f} ms after shard {before + new - 1} appeared; "
              f"{len(shard_names(out))} shards, leftovers {left}")
        records.append(assert_whole_prefix(out, full))
    rebuild_and_check(src, out, full, records)
