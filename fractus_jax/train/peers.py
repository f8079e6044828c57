"""A peer that dies: every other process of a multi-process run ends within a stated time.

A process killed outright (`kill -9`, a host lost) leaves the others blocked in a
collective or in the wait for process 0's decision, or failing in them; left to itself,
JAX's coordination service aborts them a minute or more later with a C++ stack trace. So
each process of a multi-process run keeps a watchdog (two daemon threads, nothing on the
step's thread): every HEARTBEAT_SECONDS it writes a counter to the coordination service's
key-value store and reads the others'. When a peer's counter has not moved for
PEER_TIMEOUT_SECONDS (the trainer's --peer-timeout) by this process's own clock (clocks of
different hosts are never compared), or the store itself has not answered for as long
(process 0, which holds the service, is gone), the watchdog prints one line naming that
process, the last committed step and the command that resumes the run, and ends this
process with EXIT_PEER_LOST. Before it ends, it lets go what others would otherwise wait
for (`before_exit`: a run on object storage's lease, so that a new pod takes the run at once),
within LET_GO_SECONDS.

JAX's client aborts a process (SIGABRT) the moment it finds the service gone; the watchdog
holds that abort while it judges (`Watchdog.hold_aborts`), and the service's own heartbeat
timeout is raised past the bound (service_heartbeat_timeout_seconds, given to
jax.distributed.initialize), so a survivor ends within lost_bound_seconds of its peer's
death (PEER_LOST_BOUND_SECONDS at the default timeout), by the watchdog's line.

Heartbeats come from the watchdog's threads, so a compilation or a save of any length, or
a step blocked in a collective, never looks like a death; a process that finished (its run
ended or stopped on a signal) says so and is never taken for dead.

A process that stops on an error of its own (a corpus missing on its host, credentials its
host lacks, a disk without room) says so too, its error's line in place of its counter
(`Watchdog.fail`), and waits until the others have read it: each of them then ends at once
with that line and EXIT_PEER_FAILED, instead of waiting in a collective or a barrier for a
process that will not come (up to the barrier's 10 minutes).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from typing import Callable, Optional

HEARTBEAT_SECONDS = 2.0        # each process writes its counter this often
# A counter unmoved (or a store unanswering) this long: the peer is lost. The trainer's
# --peer-timeout; at least MIN_PEER_TIMEOUT_SECONDS, five heartbeats, so that a beat late on
# a loaded host is never read as a death.
PEER_TIMEOUT_SECONDS = 30.0
MIN_PEER_TIMEOUT_SECONDS = 5 * HEARTBEAT_SECONDS
EXIT_PEER_LOST = 3             # the exit status of a survivor
EXIT_PEER_FAILED = 2           # ... of one whose peer stopped on an error (the peer's own status)
# What a process ending by its watchdog lets go (`before_exit`) gets this long; a store that
# does not answer leaves its lease to lapse.
LET_GO_SECONDS = 2.0


def lost_bound_seconds(timeout: float = PEER_TIMEOUT_SECONDS) -> float:
    """The bound stated to users (docs/training.md, "Faults and recovery"): the timeout, one
    heartbeat (a peer's last counter is seen up to one late), one tick of the judge, the
    message, and the lease let go."""
    return timeout + HEARTBEAT_SECONDS + 3.0 + LET_GO_SECONDS


def service_heartbeat_timeout_seconds(timeout: float = PEER_TIMEOUT_SECONDS) -> int:
    """jax.distributed's own heartbeat timeout (its default: 100 s), after which its service
    aborts every process: kept well past the watchdog's bound, so the watchdog ends first."""
    return int(4 * lost_bound_seconds(timeout))


PEER_LOST_BOUND_SECONDS = lost_bound_seconds()                        # 37 s
SERVICE_HEARTBEAT_TIMEOUT_SECONDS = service_heartbeat_timeout_seconds()   # 148 s

PREFIX = "fractus_jax/peers/"
DONE = "done"
FAILED = "failed: "            # a process's last value when it stops on an error: the error's line follows


class Watchdog:
    """The heartbeats of one process and its judgement of the others'.

    client: the coordination service's client (`key_value_set`, `key_value_dir_get`).
    message(process, seconds): the line that ends this process when `process` has not
    answered for `seconds` (called once, on the judge's thread). failed(process, line): the
    line that ends it when `process` stopped on the error `line`. timeout: the silence that
    makes a peer lost (PEER_TIMEOUT_SECONDS; no less than MIN_PEER_TIMEOUT_SECONDS).
    before_exit: what the process lets go before the watchdog ends it (the store's lease),
    given LET_GO_SECONDS on a thread of its own."""

    def __init__(self, client, process_index: int, process_count: int,
                 message: Callable[[int, float], str], clock: Callable[[], float] = time.monotonic,
                 exit: Callable[[int], None] = os._exit, timeout: float = PEER_TIMEOUT_SECONDS,
                 failed: Optional[Callable[[int, str], str]] = None,
                 before_exit: Callable[[], None] = lambda: None):
        if timeout < MIN_PEER_TIMEOUT_SECONDS:
            raise ValueError(f"a peer timeout of {timeout} s is under {MIN_PEER_TIMEOUT_SECONDS} s "
                             "(five heartbeats): a late beat would read as a death")
        self.client, self.index, self.count = client, process_index, process_count
        self.message, self.clock, self.exit, self.timeout = message, clock, exit, timeout
        self.failed_message = failed or (lambda process, line: f"error: process {process} stopped: {line}")
        self.before_exit = before_exit
        self.beats = 0
        self._final: Optional[str] = None   # written in place of the counter once this process fails
        self._published: Optional[float] = None   # when the store took it
        self._aborted = False   # JAX's client tried to abort the process meanwhile (and printed why)
        self._stopping = False  # this process stops on its own error (`fail`)
        now = clock()
        self.last_ok = now                                  # the store's last answer
        self.seen = {i: (None, now) for i in range(process_count) if i != process_index}  # value, since
        self.changes = {i: 0 for i in self.seen}            # the values seen change this many times
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = []

    def start(self) -> "Watchdog":
        for target, name in ((self._beat_loop, "fractus-heartbeat"), (self._judge_loop, "fractus-watchdog")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def hold_aborts(self) -> None:
        """JAX's client aborts the process (a C++ check failure, SIGABRT: exit 134 and a stack
        trace) the moment it finds the coordination service gone (process 0 died) or told of
        a fault. The aborting thread is held while the watchdog judges: a peer lost, and the
        watchdog ends the process with its line and EXIT_PEER_LOST; every peer alive (the
        abort was not a death), and the abort goes on. A process that stops on its own error
        (`fail`) holds it until it ends itself: the others, having read the error, end first."""
        import ctypes

        @ctypes.CFUNCTYPE(None, ctypes.c_int)
        def on_abort(_signum):
            if self._final is not None:   # this process ends by itself (`fail`): the others went first
                self._aborted = True
                threading.Event().wait()
            self.settle()   # returning: abort() restores the default action and ends the process

        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        self._on_abort = on_abort   # kept alive with the watchdog
        libc.signal(signal.SIGABRT, ctypes.cast(on_abort, ctypes.c_void_p))

    # The heartbeat thread: the only one that talks to the store (a call may hang on a lost host).
    def _beat_loop(self) -> None:
        while not self._stop.is_set():
            self.beat()
            self._stop.wait(HEARTBEAT_SECONDS)

    def beat(self) -> None:
        try:
            self.beats += 1
            final = self._final
            self.client.key_value_set(f"{PREFIX}{self.index}", final or str(self.beats), allow_overwrite=True)
            values = self.client.key_value_dir_get(PREFIX)
        except Exception:   # noqa: BLE001 - the runtime's error type is not public; the judge sees the silence
            return
        now = self.clock()
        with self._lock:
            if final is not None and self._published is None:
                self._published = now
            self.last_ok = now
            for key, value in values:
                i = int(key.rstrip("/").rsplit("/", 1)[1])
                if i in self.seen and self.seen[i][0] != value:
                    self.seen[i] = (value, now)
                    self.changes[i] += 1

    # The judge's thread: never blocks on the store.
    def _judge_loop(self) -> None:
        while not self._stop.wait(1.0):
            if self._final is not None:
                return   # this process stops on its own error
            failed = None if self._stopping else self.failed()   # its own error is the one it names
            if failed is not None:
                self.end_failed(*failed)
                return
            lost = self.lost()
            if lost is not None:
                self.end(*lost)
                return

    def failed(self) -> Optional[tuple[int, str]]:
        """(process, its error's line) of a peer that stopped on an error, or None."""
        with self._lock:
            for i, (value, _) in sorted(self.seen.items()):
                if value is not None and value.startswith(FAILED):
                    return i, value[len(FAILED):]
        return None

    def lost(self) -> Optional[tuple[int, float]]:
        """(process, seconds silent) of a peer lost, or None. The store's silence first: then
        every counter is still, and process 0, which holds the service, is the one gone."""
        now = self.clock()
        with self._lock:
            if self.seen.get(0, (None,))[0] == DONE:
                return None   # process 0 finished: the store may go at any time
            if self._final is not None:
                return None   # this process ends by itself
            if now - self.last_ok > self.timeout:
                return 0, now - self.last_ok
            for i, (value, since) in sorted(self.seen.items()):
                if value != DONE and now - since > self.timeout:
                    return i, now - since
        return None

    def end(self, process: int, seconds: float) -> None:
        try:
            line = self.message(process, seconds)
        except Exception as e:   # noqa: BLE001 - the line must come out whatever happens
            line = f"error: process {process} stopped answering ({e})"
        self._say(line)
        self._exit(EXIT_PEER_LOST)

    def _exit(self, code: int) -> None:
        """End the process with `code`, once `before_exit` returned or LET_GO_SECONDS passed."""
        def let_go():
            try:
                self.before_exit()
            except Exception:   # noqa: BLE001 - what it held lapses by itself
                pass
        t = threading.Thread(target=let_go, name="fractus-let-go", daemon=True)
        t.start()
        t.join(LET_GO_SECONDS)
        self.exit(code)

    @staticmethod
    def _say(line: str) -> None:
        try:
            sys.stdout.flush()
        except Exception:   # noqa: BLE001
            pass
        if line:
            print(line, file=sys.stderr, flush=True)
        else:
            sys.stderr.flush()

    def end_failed(self, process: int, line: str) -> None:
        self._say(self.failed_message(process, line))
        self._exit(EXIT_PEER_FAILED)

    def fail(self, line: str, code: int, print_traceback: bool = False) -> None:
        """This process stops on its own error (`line`, printed already) and ends with `code`:
        its counter becomes that line, and it ends once each peer has read it (then ended,
        silent for three heartbeats since) or stops too, within the bound of a peer's loss.
        The service lives in process 0: a process 0 that ended before the others read its line
        would be taken for lost, not for failed. It ends as the watchdog ends a survivor,
        without jax.distributed's shutdown, whose barrier the others, blocked in a collective
        or gone, would never reach. First `settle`: an error caused by a peer's death ends the
        process there, by the watchdog's line naming the dead peer. print_traceback: called in
        an `except` block, print the exception's traceback once it is known not to be a
        peer's death."""
        self._stopping = True
        self.settle()
        if print_traceback:
            traceback.print_exc()
        with self._lock:
            self._final = FAILED + " ".join(line.split())
        start = self.clock()
        while self.clock() - start < lost_bound_seconds(self.timeout):
            with self._lock:
                now, published = self.clock(), self._published
                if published is not None and all(
                        v == DONE or (v or "").startswith(FAILED) or now - max(since, published) > 3 * HEARTBEAT_SECONDS
                        for v, since in self.seen.values()):
                    break
            time.sleep(0.2)
        self._say(line if self._aborted else "")   # its line last, after the client's report
        self._exit(code)

    def settle(self) -> None:
        """After this process's run failed: return once every peer has beaten twice since (it
        lives: the failure was not a peer's death; a dead peer's last beat may be read once
        after its death), or never, when the judge ends the process first."""
        start = self.clock()
        with self._lock:
            before = dict(self.changes)
        while self.clock() - start < lost_bound_seconds(self.timeout) + 3 * HEARTBEAT_SECONDS:
            with self._lock:
                if all(v == DONE or self.changes[i] >= before[i] + 2 for i, (v, _) in self.seen.items()):
                    return
            time.sleep(0.2)

    def finish(self) -> None:
        """This process's run ended (max_steps or a stop): the others no longer wait for its
        heartbeat."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=1.0)
        try:
            self.client.key_value_set(f"{PREFIX}{self.index}", DONE, allow_overwrite=True)
        except Exception:   # noqa: BLE001 - a peer then judges this process by its silence
            pass
