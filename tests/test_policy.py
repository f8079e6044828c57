"""The stop and save policy, in one process: the decision rule, the one-process path, and
the agreement of two processes (threads here) through an injected gather and through a
key-value store like the coordination service's. The two-process runs are in
tests/test_multihost_faults.py."""
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import config as cfg_lib
from fractus_jax.train import state as state_lib
from fractus_jax.train import policy
from fractus_jax.train.errors import TrainError
from fractus_jax.train.policy import DEADLINE_SLACK_SECONDS, Decision, StopSavePolicy, Vote, decide


class FakeCheckpointer:
    def __init__(self, committed_at=(), save_seconds=1.0, uploading_again=None, uploading=None):
        self.committed_at, self._save_seconds = set(committed_at), save_seconds
        self.again = uploading_again or {}   # step -> the step whose upload is tried again then
        self.sending = uploading or {}       # step -> the step whose upload is in flight then
        self.step = None
        self.calls = []

    def uploading(self):
        return self.sending.get(self.step, self.again.get(self.step))

    def uploading_again(self):
        return self.again.get(self.step)

    def poll(self):
        self.calls.append(("poll", self.step))

    def committed(self):
        self.calls.append(("committed", self.step))
        return self.step in self.committed_at

    def wait(self):
        self.calls.append(("wait", self.step))

    def save_seconds(self):
        return self._save_seconds


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(policy, "clock", c)
    return c


# ----------------------------------------------------------------------------- the rule

def test_one_process_words_a_signal_as_before():
    assert decide([Vote(signal="SIGTERM")]) == Decision(stop="SIGTERM received")
    assert decide([Vote(deadline=True)]) == Decision(stop="deadline near")
    assert decide([Vote(signal="SIGINT", deadline=True, timed_save=True)]) == Decision(save=True, stop="SIGINT received")
    assert decide([Vote()]) == Decision()


def test_a_signal_to_any_process_stops_every_one():
    assert decide([Vote(), Vote(), Vote(signal="SIGTERM")]).stop == "SIGTERM received by process 2"
    assert decide([Vote(signal="SIGINT"), Vote(signal="SIGTERM")]).stop == "SIGINT received by process 0"


def test_only_process_0s_clock_and_save_count():
    others = Vote(timed_save=True, deadline=True, committed=True)
    assert decide([Vote(), others]) == Decision()
    assert decide([Vote(timed_save=True, committed=True), Vote()]) == Decision(save=True, finish_save=True)
    assert decide([Vote(deadline=True), Vote()]).stop == "deadline near"


def test_any_process_s_upload_tried_again_holds_the_saves_and_the_finish_of_one():
    assert decide([Vote(uploading_again=4), Vote()]) == Decision(hold_saves=4)
    assert decide([Vote(committed=True), Vote(uploading_again=4)]) == Decision(hold_saves=4)
    assert decide([Vote(uploading_again=4), Vote(uploading_again=6)]).hold_saves == 4
    assert decide([Vote(committed=True), Vote()]) == Decision(finish_save=True)


def test_any_process_s_upload_in_flight_holds_the_finish_of_a_save_but_not_the_saves():
    assert decide([Vote(committed=True, uploading=4)]) == Decision()
    assert decide([Vote(committed=True), Vote(uploading=4)]) == Decision()
    assert decide([Vote(committed=True, timed_save=True), Vote(), Vote(uploading=4)]) == Decision(save=True)
    assert decide([Vote(committed=True), Vote(), Vote()]) == Decision(finish_save=True)


def test_a_decision_travels_as_text():
    d = Decision(save=True, stop="SIGTERM received by process 1", finish_save=True, hold_saves=4)
    assert Decision.decode(d.encode()) == d


# ----------------------------------------------------------------------------- one process

def test_alone_polls_and_decides_by_its_own_clock(clock):
    p = StopSavePolicy(save_every_minutes=2, deadline=None)
    ck = FakeCheckpointer()
    ck.step = 1
    assert p.at_step(1, None, ck, 0.5) == Decision()
    assert ck.calls == [("poll", 1)]   # its own view: the save in flight is finished by poll
    clock.t += 119
    assert not p.at_step(2, None, ck, 0.5).save
    clock.t += 1
    assert p.at_step(3, None, ck, 0.5).save
    p.saved()
    assert not p.at_step(4, None, ck, 0.5).save


def test_a_save_is_not_finished_while_the_upload_before_it_is_tried_again(clock):
    """Finishing a save waits for the upload before it: while that one is tried again, the
    committed save stays unfinished and the saves are held; after it, both go on."""
    p = StopSavePolicy(save_every_minutes=0, deadline=None)
    ck = FakeCheckpointer(uploading_again={2: 4, 3: 4})
    for step in (1, 2, 3, 4):
        ck.step = step
        assert p.at_step(step, None, ck, 0.5).hold_saves == ck.again.get(step)
    assert ck.calls == [("poll", 1), ("poll", 4)]


def test_a_save_is_not_finished_while_the_upload_before_it_is_in_flight(clock):
    """A slow upload: the committed save is finished once the upload before it has ended,
    rather than wait for it; no save is held."""
    p = StopSavePolicy(save_every_minutes=0, deadline=None)
    ck = FakeCheckpointer(uploading={2: 2, 3: 2})
    for step in (1, 2, 3, 4):
        ck.step = step
        assert p.at_step(step, None, ck, 0.5) == Decision()
    assert ck.calls == [("poll", 1), ("poll", 4)]


def test_the_deadline_margin_is_two_steps_one_and_a_half_saves_and_a_second(clock):
    ck = FakeCheckpointer(save_seconds=10.0)
    p = StopSavePolicy(0, deadline=clock.t + 2 * 3.0 + 15.0 + DEADLINE_SLACK_SECONDS + 0.5)
    assert p.at_step(1, None, ck, 3.0).stop is None
    clock.t += 0.5
    assert p.at_step(2, None, ck, 3.0).stop == "deadline near"
    assert StopSavePolicy(0, None).at_step(3, "SIGTERM", ck, 3.0).stop == "SIGTERM received"


def test_the_save_time_reserved_is_the_slowest_of_the_last_saves():
    times = ckpt_lib.CommitTimes(guess=7.0)
    assert times.seconds() == 7.0
    times.add(2.0)
    times.add(0.5)
    assert times.seconds() == 2.0   # one slow write is the one a deadline must allow for
    for _ in range(ckpt_lib.RECENT_COMMITS - 1):
        times.add(0.5)
    assert times.seconds() == 0.5   # it left the window


# ----------------------------------------------------------------------------- a deadline sized to the state

def _abstract_state(name):
    return state_lib.abstract_train_state(cfg_lib.load_config(name))   # jax.eval_shape: nothing allocated


def test_a_small_run_trains_to_within_seconds_of_its_deadline(clock, tmp_path):
    """tiny's state (0.6 MB) is saved in well under the floor: before any save is timed, the
    run reserves two steps, 1.5 x the 2 s floor and a second, not 1.5 x 30 s. The clock is
    the test's: 0.05 s steps towards a deadline 150 s away."""
    ckpt = ckpt_lib.RunCheckpointer(tmp_path, asynchronous=True)
    try:
        ckpt.expect(_abstract_state("tiny"))
        assert ckpt.save_seconds() == ckpt_lib.FIRST_SAVE_FLOOR_SECONDS
        deadline = clock.t + 150
        p = StopSavePolicy(0, deadline)
        step = 0
        while True:
            step += 1
            if p.at_step(step, None, ckpt, 0.05).stop is not None:
                break
            clock.t += 0.05
    finally:
        ckpt.close()
    left = deadline - clock.t
    margin = policy.deadline_margin(0.05, ckpt_lib.FIRST_SAVE_FLOOR_SECONDS)
    assert margin == pytest.approx(2 * 0.05 + 1.5 * 2.0 + DEADLINE_SLACK_SECONDS)
    # It stops at the first step whose margin would reach the deadline, and no sooner.
    assert margin - 0.05 <= left <= margin and left < 5.0, (step, left)


def test_the_state_counts_what_this_process_writes():
    """A replicated array is written once (its replica-0 shard), a sharded one whole."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    n = len(jax.devices())
    assert n >= 2   # conftest's fake devices: otherwise the two cases below are one
    x = np.zeros((8 * n, 4), np.float32)
    rep = jax.device_put(x, NamedSharding(mesh, P()))
    split = jax.device_put(x, NamedSharding(mesh, P("data")))
    assert ckpt_lib.save_bytes({"a": rep}) == (x.nbytes, x.nbytes)
    assert ckpt_lib.save_bytes({"a": split, "b": rep}) == (2 * x.nbytes, 2 * x.nbytes)
    abstract = jax.ShapeDtypeStruct((3, 5), jnp.bfloat16)
    assert ckpt_lib.save_bytes([abstract]) == (30, 30)


def test_atom_1b_s_first_margin_covers_its_12_gb_state(clock, tmp_path):
    abstract = _abstract_state("atom_1b")
    written, whole = ckpt_lib.save_bytes(abstract)
    params = sum(ckpt_lib.save_bytes(abstract[k])[1] for k in ("params", "opt_state"))
    assert 11e9 < params <= whole < 13e9 and written == whole   # weights + AdamW moments, one process
    guess = ckpt_lib.first_save_seconds(abstract)
    assert guess >= written / ckpt_lib.SAVE_WRITE_BYTES_PER_SECOND
    assert guess >= 12e9 / 200e6   # 12 GB on a 200 MB/s disk
    ckpt = ckpt_lib.RunCheckpointer(tmp_path, asynchronous=True)
    try:
        ckpt.expect(abstract)
        assert ckpt.save_seconds() == guess
        # The policy stops a run whose deadline is 1.5 x (12 GB at 100 MB/s) away, at its
        # first step; a run twice as far from it trains on.
        step_seconds = 1.0
        far = 1.5 * 12e9 / 100e6
        assert StopSavePolicy(0, clock.t + far).at_step(1, None, ckpt, step_seconds).stop == "deadline near"
        assert StopSavePolicy(0, clock.t + 2 * far).at_step(1, None, ckpt, step_seconds).stop is None
        # A save timed replaces the guess.
        ckpt.commits.add(20.0)
        assert ckpt.save_seconds() == 20.0
        assert StopSavePolicy(0, clock.t + far).at_step(1, None, ckpt, step_seconds).stop is None
    finally:
        ckpt.close()


# ----------------------------------------------------------------------------- two processes

class ThreadGather:
    """An all-gather between threads: each step, every thread's vote, in process order."""

    def __init__(self, n):
        self.n, self.votes, self.barrier = n, {}, threading.Barrier(n)

    def for_process(self, i):
        def gather(step, vote):
            self.votes[(step, i)] = vote
            self.barrier.wait()
            out = [self.votes[(step, j)] for j in range(self.n)]
            self.barrier.wait()
            return out
        return gather


def run_processes(make_exchange, signals, committed_at=(), steps=8, n=2, clock_step=None, uploading_again=None,
                  uploading=None):
    """Each "process" a thread running the policy for `steps` steps; signals[i] = (step, name)
    received by process i; uploading_again[i]: {step: the step whose upload process i tries
    again then}; uploading[i]: {step: the step whose upload process i has in flight then}.
    Returns each one's decisions and its checkpointer's calls."""
    out, errors = {}, []
    # The train step is collective: no process runs a step ahead of the others' dispatch.
    # The last save is too: all have read every decision before process 0 cleans up.
    step_collective, done = threading.Barrier(n), threading.Barrier(n)

    def body(i):
        try:
            p = StopSavePolicy(save_every_minutes=1, deadline=None, exchange=make_exchange(i))
            ck = FakeCheckpointer(committed_at, uploading_again=(uploading_again or {}).get(i),
                                  uploading=(uploading or {}).get(i))
            got, signal = [], None
            for step in range(1, steps + 1):
                ck.step = step
                step_collective.wait(timeout=20)
                if i in signals and step >= signals[i][0]:
                    signal = signals[i][1]
                if clock_step is not None and i == 0:
                    clock_step(step)
                d = p.at_step(step, signal, ck, 0.1)
                got.append(d)
                if d.save or d.stop:
                    p.saved()
                if d.stop:
                    break
            done.wait(timeout=20)
            p.close()
            out[i] = (got, ck.calls)
        except BaseException as e:   # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
        if t.is_alive():   # unblock the others' waits: the test fails below
            policy.WAIT_MS = 1
    assert not errors, errors
    assert all(not t.is_alive() for t in threads)
    return [out[i] for i in range(n)]


def test_gathered_a_signal_to_process_1_stops_both_at_the_same_step(clock):
    g = ThreadGather(2)
    (d0, calls0), (d1, calls1) = run_processes(lambda i: policy.Gathered(g.for_process(i), i),
                                               {1: (3, "SIGTERM")}, committed_at={2})
    assert d0 == d1 and len(d0) == 3
    assert d0[-1].stop == "SIGTERM received by process 1"
    # The save that process 0 saw committed at step 2 is finished by both at step 2; only
    # process 0's view was asked.
    assert ("wait", 2) in calls0 and ("wait", 2) in calls1
    assert not any(c[0] in ("committed", "poll") for c in calls1)


@pytest.mark.parametrize("who", [0, 1])
def test_gathered_a_committed_save_waits_while_a_process_s_upload_is_tried_again(clock, who):
    g = ThreadGather(2)
    (d0, calls0), (d1, calls1) = run_processes(lambda i: policy.Gathered(g.for_process(i), i), {},
                                               committed_at={2, 3, 4}, steps=4, uploading_again={who: {2: 6, 3: 6}})
    assert d0 == d1
    assert [d.hold_saves for d in d0] == [None, 6, 6, None]
    assert [d.finish_save for d in d0] == [False, False, False, True]
    for calls in (calls0, calls1):
        assert [c for c in calls if c[0] == "wait"] == [("wait", 4)]


def test_key_value_exchange_holds_the_saves_while_process_1_s_upload_is_tried_again(clock):
    client = FakeClient()
    (d0, calls0), (d1, _) = run_processes(lambda i: policy.KeyValueExchange(client, i, 2, name="run"), {},
                                          committed_at={2, 3, 4, 5, 6}, steps=7,
                                          uploading_again={1: {2: 6, 3: 6, 4: 6}})
    assert d0 == d1
    # process 0 reads what process 1 said (at steps 2 and 5) at that step, or at the next one
    held = [i + 1 for i, d in enumerate(d0) if d.hold_saves == 6]
    assert held == list(range(held[0], held[-1] + 1)) and held[0] in (2, 3) and held[-1] in (4, 5), d0
    assert all(d.hold_saves in (None, 6) for d in d0)
    finished = [i + 1 for i, d in enumerate(d0) if d.finish_save]
    assert finished and finished[0] == held[-1] + 1 and not set(finished) & set(held), d0
    assert client.kv == {}


def test_key_value_exchange_finishes_a_save_once_process_1_s_upload_has_ended(clock):
    client = FakeClient()
    (d0, calls0), (d1, calls1) = run_processes(lambda i: policy.KeyValueExchange(client, i, 2, name="run"), {},
                                               committed_at={3, 4, 5, 6, 7}, steps=7, uploading={1: {2: 4, 3: 4, 4: 4}})
    assert d0 == d1 and all(d.hold_saves is None for d in d0), d0
    # process 0 reads what process 1 said (at steps 2 and 5) at that step, or at the next one
    finished = [i + 1 for i, d in enumerate(d0) if d.finish_save]
    assert finished and finished[0] in (5, 6) and finished == list(range(finished[0], 8)), d0
    for calls in (calls0, calls1):
        assert [c[1] for c in calls if c[0] == "wait"] == finished
    assert client.kv == {}


def test_gathered_time_saves_follow_process_0s_clock(clock):
    g = ThreadGather(2)

    def tick(step):   # process 0's clock: a minute passes at step 3
        if step == 3:
            clock.t += 60

    (d0, _), (d1, _) = run_processes(lambda i: policy.Gathered(g.for_process(i), i), {}, steps=5, clock_step=tick)
    assert d0 == d1
    assert [d.save for d in d0] == [False, False, True, False, False]


class FakeClient:
    """The coordination service's key-value store, in memory."""

    def __init__(self):
        self.kv, self.cv = {}, threading.Condition()
        self.deleted = []

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.cv:
            assert allow_overwrite or key not in self.kv, key
            self.kv[key] = value
            self.cv.notify_all()

    def key_value_dir_get(self, d):
        with self.cv:
            return [(k, v) for k, v in sorted(self.kv.items()) if k.startswith(d)]

    def blocking_key_value_get(self, key, timeout_in_ms):
        with self.cv:
            if not self.cv.wait_for(lambda: key in self.kv, timeout_in_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
            return self.kv[key]

    def key_value_delete(self, key):
        with self.cv:
            self.deleted.append(key)
            for k in [k for k in self.kv if k == key or k.startswith(key + "/")]:
                del self.kv[k]


@pytest.mark.parametrize("who", [0, 1, 2])
def test_key_value_exchange_a_signal_to_any_process_stops_all_at_one_step(clock, who):
    client = FakeClient()
    results = run_processes(lambda i: policy.KeyValueExchange(client, i, 3, name="run"), {who: (3, "SIGTERM")},
                            committed_at={2}, n=3)
    decisions = [d for d, _ in results]
    assert decisions[0] == decisions[1] == decisions[2]
    # Process 0 may read the signal directory of step 3 before process `who` wrote to it:
    # then all stop at step 4, together.
    assert len(decisions[0]) in (3, 4) and decisions[0][-1].stop == f"SIGTERM received by process {who}"
    for _, calls in results:
        assert ("wait", 2) in calls
    assert client.kv == {}   # process 0 removed the run's keys at the end


def test_key_value_exchange_waits_again_for_a_slow_process_0(clock, monkeypatch):
    monkeypatch.setattr(policy, "WAIT_MS", 50)
    client = FakeClient()
    late = threading.Timer(0.3, lambda: client.key_value_set(f"{ex.prefix}/step/0/1", Decision(save=True).encode()))
    ex = policy.KeyValueExchange(client, 1, 2)
    late.start()
    assert ex.agree(1, Vote()) == Decision(save=True)


def test_key_value_exchange_deletes_old_decisions(clock, monkeypatch):
    monkeypatch.setattr(policy, "WINDOW", 3)
    client = FakeClient()
    run_processes(lambda i: policy.KeyValueExchange(client, i, 2, name="run"), {}, steps=10)
    prefix = client.deleted[0].rsplit("/step/", 1)[0]
    assert client.deleted == [f"{prefix}/step/0", f"{prefix}/step/1", prefix]   # at steps 6, 9, the end


def test_each_run_in_a_process_has_its_own_keys():
    client = FakeClient()
    a, b = policy.KeyValueExchange(client, 0, 2), policy.KeyValueExchange(client, 0, 2)
    assert a.prefix != b.prefix


def test_the_stop_flag_records_a_signal_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with policy.StopFlag() as flag:
        assert flag.signal is None
        os.kill(os.getpid(), signal.SIGTERM)   # delivered to the main thread before kill returns
        assert flag.signal == "SIGTERM"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # a second Ctrl-C interrupts
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_deadline_is_unix_seconds_or_an_iso_time():
    assert policy.parse_deadline("") is None
    assert policy.parse_deadline("1764612000.5") == 1764612000.5
    assert policy.parse_deadline("2026-12-01T18:00+00:00") == 1796148000.0
    with pytest.raises(TrainError, match="neither unix seconds nor an ISO time"):
        policy.parse_deadline("tomorrow")


class _Store:
    """The coordination service's key-value store as the watchdog uses it; `down` makes it fail."""

    def __init__(self):
        self.data, self.down = {}, False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE")
        self.data[key] = value

    def key_value_dir_get(self, prefix):
        if self.down:
            raise RuntimeError("UNAVAILABLE")
        return [(k, v) for k, v in self.data.items() if k.startswith(prefix)]


@pytest.mark.parametrize("timeout", [None, 10.0])   # the default (30 s), the shortest --peer-timeout
def test_the_watchdog_names_a_silent_peer_or_process_0_when_the_store_is_silent(timeout):
    from fractus_jax.train import peers

    now = [0.0]
    store = _Store()
    kw = {} if timeout is None else {"timeout": timeout}
    timeout = timeout or peers.PEER_TIMEOUT_SECONDS
    dogs = [peers.Watchdog(store, i, 3, lambda p, s: f"lost {p}", clock=lambda: now[0], **kw) for i in range(3)]

    def tick(seconds, who=(0, 1, 2)):
        for _ in range(int(seconds / peers.HEARTBEAT_SECONDS)):
            now[0] += peers.HEARTBEAT_SECONDS
            for i in who:
                dogs[i].beat()

    tick(300)   # all beat (a compilation of minutes changes nothing: the beats come from a thread)
    assert [d.lost() for d in dogs] == [None] * 3
    tick(timeout - peers.HEARTBEAT_SECONDS, who=(0, 1))   # process 2 silent, not yet for the timeout
    assert [d.lost() for d in dogs[:2]] == [None] * 2
    tick(3 * peers.HEARTBEAT_SECONDS, who=(0, 1))
    assert dogs[0].lost()[0] == dogs[1].lost()[0] == 2
    assert timeout < dogs[0].lost()[1] <= peers.lost_bound_seconds(timeout)
    dogs[2].finish()   # a process that finished is never taken for dead
    tick(peers.HEARTBEAT_SECONDS, who=(0, 1))
    assert dogs[0].lost() is None and dogs[1].lost() is None
    store.down = True   # process 0 and its store gone: process 1 names process 0
    tick(timeout + 2 * peers.HEARTBEAT_SECONDS, who=(1,))
    assert dogs[1].lost()[0] == 0


def test_a_process_that_stops_on_an_error_ends_the_others_with_its_line():
    """Process 1 of three stops on an error of its own: its counter becomes the error's line;
    the others read it at their next beat and end with it (EXIT_PEER_FAILED), not after a
    silence; process 1 ends once they have read it and gone silent, never judging them lost."""
    from fractus_jax.train import peers

    now, store, codes = [0.0], _Store(), []
    dogs = [peers.Watchdog(store, i, 3, lambda p, s: f"lost {p}", clock=lambda: now[0], exit=codes.append,
                           failed=lambda p, line: f"stopped {p}: {line}") for i in range(3)]

    def tick(seconds, who=(0, 1, 2)):
        for _ in range(int(seconds / peers.HEARTBEAT_SECONDS)):
            now[0] += peers.HEARTBEAT_SECONDS
            for i in who:
                dogs[i].beat()

    tick(10)
    assert [d.failed() for d in dogs] == [None] * 3
    failing = threading.Thread(target=dogs[1].fail, args=("error: /data/atom: no such\n corpus file", 2))
    failing.start()
    for _ in range(200):   # process 1 writes its line (once its thread has set it); the others read it
        tick(peers.HEARTBEAT_SECONDS)
        if dogs[0].failed() and dogs[2].failed():
            break
        time.sleep(0.05)
    assert [dogs[0].failed(), dogs[2].failed()] == [(1, "error: /data/atom: no such corpus file")] * 2
    assert dogs[1].failed() is None and failing.is_alive()   # it waits for them to go
    dogs[0].end_failed(*dogs[0].failed())
    assert codes == [peers.EXIT_PEER_FAILED]
    tick(5 * peers.HEARTBEAT_SECONDS, who=(1,))   # the others gone silent (a beat seen one late)
    failing.join(timeout=30)
    assert not failing.is_alive() and codes == [peers.EXIT_PEER_FAILED, 2]
    assert dogs[1].lost() is None   # never taken for lost: it ended by itself


def test_a_process_that_stops_on_an_error_is_named_on_the_others_in_the_trainers_words():
    from fractus_jax.train.__main__ import peer_failed_line

    line = peer_failed_line(["--config", "tiny", "--process-id", "0"], 1, "error: /data/atom: no such corpus file",
                            0, 2)
    assert line.startswith("error: process 1 stopped: /data/atom: no such corpus file. This process 0 stops too "
                           "(exit 2); once that is fixed, start all 2 processes again"), line
    assert line.endswith("python -m fractus_jax.train --config tiny --process-id 0"), line


def test_a_peer_timeout_under_five_heartbeats_is_refused(tmp_path):
    from fractus_jax.train import peers

    with pytest.raises(ValueError, match="under 10.0 s"):
        peers.Watchdog(_Store(), 0, 2, lambda p, s: "", timeout=peers.MIN_PEER_TIMEOUT_SECONDS - 1)
    out = subprocess.run([sys.executable, "-m", "fractus_jax.train", "--config", "tiny", "--workdir",
                          str(tmp_path / "run"), "--peer-timeout", "3"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--peer-timeout 3 is under 10 s" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()


def test_the_watchdog_ends_the_process_with_its_line_last(capsys):
    from fractus_jax.train import peers

    codes = []
    dog = peers.Watchdog(_Store(), 0, 2, lambda p, s: f"error: process {p} stopped answering ({s:.0f} s)",
                         exit=codes.append)
    dog.end(1, 31.2)
    assert codes == [peers.EXIT_PEER_LOST]
    assert capsys.readouterr().err.splitlines()[-1] == "error: process 1 stopped answering (31 s)"
    for timeout in (peers.PEER_TIMEOUT_SECONDS, peers.MIN_PEER_TIMEOUT_SECONDS):
        assert peers.service_heartbeat_timeout_seconds(timeout) > peers.lost_bound_seconds(timeout) >= (
            timeout + 2 * peers.HEARTBEAT_SECONDS + 1)
    assert peers.PEER_LOST_BOUND_SECONDS == 37 and peers.SERVICE_HEARTBEAT_TIMEOUT_SECONDS == 148   # docs/training.md


@pytest.mark.parametrize("how", ["a peer lost", "a peer failed", "its own error"])
def test_the_watchdog_lets_go_what_the_process_holds_before_it_ends_it(how, monkeypatch):
    """Before the watchdog ends the process (os._exit: no `finally` runs), it calls
    before_exit (the trainer's: the store's lease let go); one that does not return (a store
    that does not answer) holds the end for LET_GO_SECONDS only."""
    from fractus_jax.train import peers

    events, hung = [], threading.Event()

    def before_exit():
        events.append("let go")
        hung.wait()   # never returns while the test runs

    monkeypatch.setattr(peers, "LET_GO_SECONDS", 0.2)
    dog = peers.Watchdog(_Store(), 0, 2, lambda p, s: "", exit=lambda code: events.append(code),
                         before_exit=before_exit)
    if how == "a peer lost":
        dog.end(1, 31.0)
    elif how == "a peer failed":
        dog.end_failed(1, "error: x")
    else:
        monkeypatch.setattr(dog, "settle", lambda: None)
        monkeypatch.setattr(peers, "lost_bound_seconds", lambda timeout: 0.0)
        dog.fail("error: x", 2)
    hung.set()
    code = {"a peer lost": peers.EXIT_PEER_LOST, "a peer failed": peers.EXIT_PEER_FAILED}.get(how, 2)
    assert events == ["let go", code]


def test_the_coordination_client_comes_from_orbax_public_helper():
    """runtime_client takes the coordination service's key-value client from Orbax's public
    multihost helpers (JAX exports none). An Orbax that drops them, or a client whose
    methods KeyValueExchange and the peer watchdog call are renamed, fails here, in one
    process, instead of in a multi-process run."""
    from jax._src.lib import _jax
    from orbax.checkpoint import multihost

    assert not multihost.is_jax_distributed_client_initialized()   # no jax.distributed.initialize here
    with pytest.raises(RuntimeError, match="without jax.distributed's client"):
        policy.runtime_client()
    assert callable(multihost.get_jax_distributed_client)
    client_type = _jax.DistributedRuntimeClient
    for method in ("key_value_set", "key_value_dir_get", "blocking_key_value_get", "key_value_delete"):
        assert callable(getattr(client_type, method, None)), f"{client_type.__name__}.{method} is gone"