"""Two processes on localhost (4 CPU devices each, one 8-device mesh) disagree about time
or signals, and still save the same steps: SIGTERM to one of them, clocks apart. Each
process runs the trainer's command line behind a small hook (a SIGTERM to itself at a
step; another clock for the stop and save policy)."""
import os
import re
import shutil
import signal  # noqa: F401 - named in the hooks
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import config as cfg_lib
from fractus_jax.train import state as state_lib

from engine_testing import SUBPROCESS_XLA_FLAGS

ROOT = Path(__file__).resolve().parents[1]
RUN = ["batch_size=8", "model.moe_group_rows=1", "optimizer=sgd", "lr=0.05", "mesh.data=2", "mesh.fsdp=4"]

pytestmark = pytest.mark.slow

HOOK = textwrap.dedent("""
    import os, signal, sys, time
    from fractus_jax.train import policy, store
    from fractus_jax.train.__main__ import main
    offset, rate, sigterm_after, every_process_caches = {offset!r}, {rate!r}, {sigterm_after!r}, {cache!r}
    restore_fails_at, held_at, tries_seconds = {restore_fails_at!r}, {held_at!r}, {tries_seconds!r}
    more_env, paused_uploading = {env!r}, {paused_uploading!r}
    os.environ.update(more_env)
    if every_process_caches:
        # JAX writes compilation cache entries from process 0 only, and each process's
        # programs have keys of their own: process 1's would never be found. No public
        # setting changes that, so the test wraps JAX's writer here, in the test's own
        # processes only; warm_run asserts that both processes' train steps were written, so
        # a JAX whose internals moved fails there, by name, not by a timeout.
        from jax._src import compilation_cache, compiler, config, distributed
        cache_write = compiler._cache_write
        def cache_write_from_every_process(key, secs, name, backend, executable, callbacks):
            if distributed.global_state.process_id == 0 or callbacks:
                return cache_write(key, secs, name, backend, executable, callbacks)
            if secs >= config.persistent_cache_min_compile_time_secs.value:
                compilation_cache.put_executable_and_time(key, name, executable, backend, int(secs))
        compiler._cache_write = cache_write_from_every_process
    t0 = time.time()
    if offset or rate != 1:
        policy.clock = lambda: t0 + offset + (time.time() - t0) * rate
    if sigterm_after:
        at_step = policy.StopSavePolicy.at_step
        def at_step_then_sigterm(self, step, *args):
            decision = at_step(self, step, *args)
            if step == sigterm_after:
                os.kill(os.getpid(), signal.SIGTERM)   # seen at the next step
            return decision
        policy.StopSavePolicy.at_step = at_step_then_sigterm
    if restore_fails_at is not None:   # this process alone cannot restore that step (its own disk)
        from fractus_jax.train import checkpoint
        restore = checkpoint.RunCheckpointer.restore
        def restore_failing(self, abstract_state, step=None, items=("params", "opt_state", "extra")):
            if step == restore_fails_at:
                raise OSError(f"a read of step {{step}} failed on this host")
            return restore(self, abstract_state, step, items)
        checkpoint.RunCheckpointer.restore = restore_failing
    if held_at is not None:   # the first upload of that step's files waits for the test (a store cut meanwhile)
        step, marker = held_at
        put = store.Store.put
        def put_once_the_test_says(self, local, remote, transfer=None):
            if any(r.startswith(f"checkpoints/{{step}}/") for r in remote) and not os.path.exists(marker + ".go"):
                open(marker, "w").close()
                t = time.time()
                while not os.path.exists(marker + ".go") and time.time() - t < 120:
                    time.sleep(0.05)
            return put(self, local, remote, transfer)
        store.Store.put = put_once_the_test_says
    if paused_uploading is not None:   # the first step with an upload in flight waits for the test
        at_step_unpaused = policy.StopSavePolicy.at_step
        def at_step_paused(self, step, signal_, ckpt, *args):
            if ckpt.mirror is not None and ckpt.mirror.pushing() and not os.path.exists(paused_uploading + ".go"):
                open(paused_uploading, "w").close()
                t = time.time()
                while not os.path.exists(paused_uploading + ".go") and time.time() - t < 120:
                    time.sleep(0.05)
            return at_step_unpaused(self, step, signal_, ckpt, *args)
        policy.StopSavePolicy.at_step = at_step_paused
    if tries_seconds is not None:   # an upload that fails is tried again for this long only
        store.TRIES_SECONDS = tries_seconds
    sys.exit(main(sys.argv[1:]))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(workdir, corpus_file, overrides, hooks=None, logs=None, cache=None, args=(), each=None, env=None):
    """The two processes, started. hooks: {process: dict(offset=, rate=, sigterm_after=,
    restore_fails_at=, held_at=(step, marker path): the process's first upload of the step's
    files creates the marker and waits for the file marker + ".go"; paused_uploading=marker
    path: the process's first step that finds its upload in flight creates the marker and
    waits for marker + ".go" before the policy's decision; tries_seconds=:
    store.TRIES_SECONDS; env=: variables set in the process alone)}.
    logs: a directory for their stderr (err0.txt, err1.txt; otherwise pipes, to be read
    while they run). cache: a persistent compilation cache directory that both processes
    read and write (each its own entries), or None for none. A cache that one process finds
    its step in while the other compiles it is unsafe: the first waits in the first
    collective, which gives up after 30 s (Gloo context initialization failed). So a test's
    cache is one that a run of the same command filled for both (`warm_run`), or none.
    args: more of the trainer's flags, for both; each: {process: more flags for it alone}.
    env: the processes' environment (this one's when None)."""
    hooks, each = hooks or {}, each or {}
    env = {**(os.environ if env is None else env), "XLA_FLAGS": SUBPROCESS_XLA_FLAGS}
    if cache is None:
        env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    else:
        env["JAX_ENABLE_COMPILATION_CACHE"] = "true"
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
        # every program, however quick to compile (the state's initialisation, the metrics'
        # reductions): each launch after warm_run compiles nothing
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    port = _free_port()
    sets = [f"--set={o}" for o in [f"corpus={corpus_file}", *RUN, *overrides]]
    procs = []
    for i in range(2):
        hook = {"offset": 0.0, "rate": 1.0, "sigterm_after": None, "restore_fails_at": None, "held_at": None,
                "tries_seconds": None, "env": {}, "paused_uploading": None, **hooks.get(i, {}), "cache": cache is not None}
        procs.append(subprocess.Popen(
            [sys.executable, "-c", HOOK.format(**hook), "--no-progress", "--config", "tiny",
             "--workdir", str(workdir), *sets, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
             "--process-id", str(i), "--local-devices", "4", *args, *each.get(i, ())],
            cwd=ROOT, env=env, stdout=subprocess.PIPE if logs is None else subprocess.DEVNULL,
            stderr=subprocess.PIPE if logs is None else open(Path(logs) / f"err{i}.txt", "w"), text=True))
    return procs


def launch(workdir, corpus_file, overrides, hooks=None, timeout=400, cache=None, each=None, env=None):
    """Both processes' stderr; each must exit 0. hooks: {process: dict(offset=, rate=, sigterm_after=)};
    each, env: as `start`'s."""
    procs = start(workdir, corpus_file, overrides, hooks, cache=cache, each=each, env=env)
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        errs = [p.communicate()[1] for p in procs]   # what each said before it was stopped
        raise AssertionError(f"not ended after {timeout} s:\n" + "\n".join(
            f"process {i}: ...{err[-3000:]}" for i, err in enumerate(errs))) from None
    finally:
        for p in procs:
            p.kill()
    for i, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i}: {err[-3000:]}"
    return [err for _, err in outs]


STRAIGHT = ["max_steps=6", "save_every=2"]


@pytest.fixture(scope="module")
def warm_run(corpus_file, tmp_path_factory):
    """One uninterrupted run of STRAIGHT, whose compilation cache holds both processes'
    programs (the initialisation, the train step): (run directory, cache directory)."""
    base = tmp_path_factory.mktemp("multihost")
    run, cache = base / "straight", base / "xla_cache"
    launch(run, corpus_file, STRAIGHT, cache=cache)
    steps = sorted(p.name for p in cache.iterdir() if p.name.startswith("jit_step-") and p.name.endswith("-cache"))
    assert len(steps) == 2, f"the train step's cache entries, one per process: {steps}"
    return run, cache


@pytest.fixture
def warm_cache(warm_run):
    """warm_run's compilation cache, shared by every test here."""
    return warm_run[1]


def saved_steps(workdir):
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def restore_state(workdir):
    cfg = cfg_lib.resolve_for_mesh(cfg_lib.apply_overrides(cfg_lib.load_config("tiny"), RUN))
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev),
                            state_lib.abstract_train_state(cfg))
    ck = ckpt_lib.RunCheckpointer(workdir, read_only=True)
    try:
        return ck.restore(abstract)
    finally:
        ck.close()


def metrics_steps(workdir):
    import json
    return [json.loads(x)["step"] for x in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_sigterm_to_one_process_stops_both_at_one_step_and_resumes_bit_exact(corpus_file, tmp_path, warm_run,
                                                                             warm_cache):
    run, straight = tmp_path / "run", tmp_path / "straight"
    # Process 1 alone receives SIGTERM after step 2: both stop at the same step and save it.
    errs = launch(run, corpus_file, ["max_steps=100", "save_every=2"], {1: {"sigterm_after": 2}}, cache=warm_cache)
    stops = [re.search(r"stopped at step (\d+) \(SIGTERM received by process 1\)", e) for e in errs]
    assert all(stops), errs[0][-2000:] + errs[1][-2000:]
    step = int(stops[0].group(1))
    assert int(stops[1].group(1)) == step and step in (3, 4)
    assert ckpt_lib.read_manifest(run)["step"] == step and step in saved_steps(run)

    # The same command resumes (to step 6) and ends where an uninterrupted run ends, bit for bit.
    errs = launch(run, corpus_file, STRAIGHT, cache=warm_cache)
    assert f"resumed {run} at step {step}" in errs[0]
    shutil.copytree(warm_run[0], straight)   # the uninterrupted run: STRAIGHT, the same command
    (a, meta_a), (b, meta_b) = restore_state(run), restore_state(straight)
    assert meta_a["step"] == meta_b["step"] == 6 and meta_a["start_token_next"] == meta_b["start_token_next"]
    for part in ("params", "opt_state", "carry"):
        jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a[part], b[part])
    assert metrics_steps(run) == metrics_steps(straight) == [1, 2, 3, 4, 5, 6]


HOUR = 3600.0


@pytest.mark.parametrize("case", ["process_1_ahead_and_fast", "process_0_ahead", "process_0_fast"])
def test_clocks_apart_both_save_the_same_steps(case, corpus_file, tmp_path, warm_cache):
    run = tmp_path / "run"
    deadline = time.time() + HOUR / 2
    if case == "process_1_ahead_and_fast":
        # Alone, process 1 would save every step (a minute passes in 60 ms of its clock) and
        # stop at once (its deadline is half an hour past): process 0's clock decides.
        errs = launch(run, corpus_file, ["max_steps=4", "save_every=1000", "save_every_minutes=1",
                                         f"deadline={deadline}"], {1: {"offset": HOUR, "rate": 1000.0}}, cache=warm_cache)
        assert saved_steps(run) == [4]
        assert not any("deadline near" in e or "stopped at" in e for e in errs)
    elif case == "process_0_ahead":
        # Process 0's deadline is past: both stop at step 1 and save it; process 1's clock
        # alone would train on.
        errs = launch(run, corpus_file, ["max_steps=4", "save_every=1000", f"deadline={deadline}"],
                      {0: {"offset": HOUR}}, cache=warm_cache)
        assert saved_steps(run) == [1]
        for e in errs:
            assert "stopped at step 1 (deadline near)" in e, e[-2000:]
    else:
        # Process 0's minutes pass in milliseconds: its time-based saves are every process's.
        launch(run, corpus_file, ["max_steps=4", "save_every=1000", "save_every_minutes=1",
                                  "keep_checkpoints=10"], {0: {"rate": 1000.0}}, cache=warm_cache)
        assert 4 in saved_steps(run) and len(saved_steps(run)) >= 2, saved_steps(run)
    assert ckpt_lib.read_manifest(run)["step"] == saved_steps(run)[-1]


@pytest.mark.parametrize("dead", [1, 0])
def test_a_peer_killed_ends_the_other_in_bounded_time_naming_it_and_the_step_to_resume(dead, corpus_file, tmp_path,
                                                                                         warm_cache):
    """kill -9 of one process after a committed step: process 1, or process 0 and the
    coordination service with it."""
    from fractus_jax.train import peers

    run = tmp_path / "run"
    # The shortest --peer-timeout the trainer takes (the default's 30 s is checked in test_policy).
    timeout = peers.MIN_PEER_TIMEOUT_SECONDS
    procs = start(run, corpus_file, ["max_steps=100000", "save_every=2"], logs=tmp_path, cache=warm_cache,
                  args=["--peer-timeout", str(timeout)])
    logs = [tmp_path / f"err{i}.txt" for i in range(2)]
    try:
        t0 = time.time()
        while (ckpt_lib.read_manifest(run) or {}).get("step", 0) < 2:   # a step committed
            assert time.time() - t0 < 400 and all(p.poll() is None for p in procs), \
                logs[0].read_text()[-3000:] + logs[1].read_text()[-3000:]
            time.sleep(0.2)
        procs[dead].kill()   # SIGKILL
        killed = time.time()
        survivor = procs[1 - dead]
        survivor.wait(timeout=peers.lost_bound_seconds(timeout) + 60)
        took = time.time() - killed
        err = logs[1 - dead].read_text()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    step = ckpt_lib.read_manifest(run)["step"]
    last = err.rstrip("\n").splitlines()[-1]
    print(f"process {1 - dead} exited {survivor.returncode} {took:.1f} s after the kill; its last line: {last}")
    assert survivor.returncode == peers.EXIT_PEER_LOST, err[-3000:]
    assert took <= peers.lost_bound_seconds(timeout) + 5, (took, err[-3000:])
    silent = re.match(rf"error: process {dead}\b[^;]* stopped answering \(silent for (\d+) s\)", last)
    assert silent and int(silent.group(1)) >= timeout, err[-3000:]
    assert f"Last committed step: {step} ({run / 'checkpoints' / str(step)})" in last, last
    assert f"--workdir {run}" in last and f"--process-id {1 - dead}" in last and "fractus_jax.train" in last, last
    assert "Traceback" not in err, err[-3000:]
    # Both restarted resume from that step (max_steps there: nothing more to compile).
    errs = launch(run, corpus_file, [f"max_steps={step}", "save_every=2"], cache=warm_cache)
    assert f"resumed {run} at step {step}" in errs[0], errs[0][-2000:]


def ended(procs, logs):
    """(exit statuses, stderr texts) of the two processes `start` began with `logs`, once both end."""
    try:
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return codes, [(Path(logs) / f"err{i}.txt").read_text() for i in range(2)]


@pytest.mark.parametrize("who", [1, 0])
def test_a_process_that_stops_on_an_error_ends_the_other_naming_it(who, corpus_file, tmp_path):
    """One host lacks the corpus (a new pod whose shards were not copied to every host): that
    process stops on its error, and the other ends with that error named (exit 2 on both),
    rather than on a collective's timeout of its own that names the checkpoints."""
    run = tmp_path / "run"
    procs = start(run, corpus_file, ["max_steps=4"], logs=tmp_path,
                  each={who: ["--set", f"corpus={tmp_path / 'missing.u16'}"]})
    codes, errs = ended(procs, tmp_path)
    own = f"error: {tmp_path / 'missing.u16'}: no such corpus file"
    assert codes == [2, 2], errs
    assert errs[who].rstrip("\n").splitlines()[-1] == own, errs[who][-3000:]
    last = errs[1 - who].rstrip("\n").splitlines()[-1]
    assert last.startswith(f"error: process {who} stopped: {own[len('error: '):]}. This process {1 - who} stops "
                           "too (exit 2)"), errs[1 - who][-3000:]
    assert f"--process-id {1 - who}" in last and "Traceback" not in errs[1 - who], errs[1 - who][-3000:]
    assert not any("checkpoint" in line for line in errs[1 - who].splitlines() if line.startswith("error:")), errs


def test_a_step_one_process_alone_cannot_restore_stops_both_and_rejects_nothing(corpus_file, tmp_path, warm_cache):
    """Process 1 cannot read step 4 (a fault of its own host): it cannot fall back alone (the
    processes would hold shards of different steps), so both stop, exit 2, naming the step
    and the cause; step 4 stays, and the same commands resume from it."""
    run = tmp_path / "run"
    launch(run, corpus_file, ["max_steps=4", "save_every=2"], cache=warm_cache)
    procs = start(run, corpus_file, STRAIGHT, hooks={1: {"restore_fails_at": 4}}, logs=tmp_path, cache=warm_cache)
    codes, errs = ended(procs, tmp_path)
    assert codes == [2, 2], errs
    cause = "step 4 could not be restored (OSError: a read of step 4 failed on this host), and then: "
    assert errs[1].rstrip("\n").splitlines()[-1].startswith("error: " + cause), errs[1][-3000:]
    assert errs[0].rstrip("\n").splitlines()[-1].startswith("error: process 1 stopped: " + cause), errs[0][-3000:]
    assert "resumed" not in errs[0] + errs[1] and saved_steps(run) == [2, 4] and not (run / "rejected").exists()
    errs = launch(run, corpus_file, STRAIGHT, cache=warm_cache)
    assert f"resumed {run} at step 4" in errs[0], errs[0][-2000:]
