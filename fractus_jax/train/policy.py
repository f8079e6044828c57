"""The stop and save policy, agreed by every process.

A save is collective (every process writes its shards, Orbax waits for all of them), and
so is the step itself: a process that saves or stops alone leaves the others waiting in a
collective it never enters. Saves every `save_every` steps and the end of the run are the
same everywhere by construction (step counts). The other decisions are not, and are taken
here, once per step, for every process:

- a time-based save (`save_every_minutes`) and the deadline stop: by process 0's clock
  (the other processes' clocks are never read);
- a stop for SIGTERM or SIGINT received by ANY process;
- finishing the background save that process 0 sees committed (its retention deletes
  old steps, which is collective too), once no process's upload to the run's store is in
  flight (the finish would wait for it: training goes on instead, and a slow link makes only
  the next save's start wait);
- holding the saves while a process's upload of a step to the run's store failed and waits
  to be tried again (any process: each uploads its part): training goes on, and the saves
  due meanwhile wait for the first step after it (the last save of a run waits for the
  upload instead).

Process 0 decides; each process gets the decision of each step before acting on it. In a
one-process run nothing is exchanged: the decision is that process's own view. A process
notes its signals with `StopFlag`; the deadline is read by `parse_deadline`.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import signal
import time
from typing import Callable, Optional, Sequence

from fractus_jax.train.errors import TrainError

# The policy's clock (tests give a process another one).
clock: Callable[[], float] = time.time

DEADLINE_SLACK_SECONDS = 1.0   # reserved before a deadline beyond two steps and a save
SAVE_FACTOR = 1.5              # the save reserved: this many times the expected one
WINDOW = 1000   # decision keys are grouped by WINDOW steps; a window 2 behind is deleted
WAIT_MS = 600_000   # one wait for process 0's decision; waits again (a compilation, a slow save)


@dataclasses.dataclass(frozen=True)
class Vote:
    """What one process brings to a step. Only process 0 reads its clock and its save in
    flight; the others bring a signal at most."""
    signal: Optional[str] = None   # SIGTERM / SIGINT received by this process
    timed_save: bool = False       # save_every_minutes have passed since the last save
    deadline: bool = False         # two more steps and a save would not fit before the deadline
    committed: bool = False        # the background save has committed: finish it now
    uploading: Optional[int] = None         # the step whose upload (this process's) is in flight
    uploading_again: Optional[int] = None   # the step whose upload (this process's) waits to be tried again


@dataclasses.dataclass(frozen=True)
class Decision:
    """The same on every process, for one step."""
    save: bool = False               # a time-based save after this step
    stop: Optional[str] = None       # why the run saves and stops after this step
    finish_save: bool = False        # finish the committed background save (checksums, retention, manifest, upload)
    hold_saves: Optional[int] = None   # the step whose upload a process tries again: start no save but a last

    def encode(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def decode(cls, text: str) -> "Decision":
        return cls(**json.loads(text))


def decide(votes: Sequence[Vote]) -> Decision:
    """votes[i] is process i's. The clock and the save in flight are process 0's; a signal
    counts from any process (the lowest-numbered one names it), and so does an upload: one
    in flight holds the finishing of a committed save (it waits for the upload before it),
    one tried again holds the saves too. A signal goes before the deadline, as the reason given."""
    lead = votes[0]
    stop = None
    for i, v in enumerate(votes):
        if v.signal:
            stop = f"{v.signal} received" + (f" by process {i}" if len(votes) > 1 else "")
            break
    if stop is None and lead.deadline:
        stop = "deadline near"
    hold = next((v.uploading_again for v in votes if v.uploading_again is not None), None)
    sending = any(v.uploading is not None or v.uploading_again is not None for v in votes)
    return Decision(save=lead.timed_save, stop=stop, finish_save=lead.committed and not sending, hold_saves=hold)


class Alone:
    """One process: its own vote is the decision; nothing is exchanged."""
    alone, lead = True, True

    def agree(self, step: int, vote: Vote) -> Decision:
        return decide([vote])

    def close(self) -> None:
        pass


class Gathered:
    """Agreement from a gather function: gather(step, vote) returns every process's vote
    (index = process). Every process must see the same list."""
    alone = False

    def __init__(self, gather: Callable[[int, Vote], Sequence[Vote]], process_index: int):
        self.gather, self.lead = gather, process_index == 0

    def agree(self, step: int, vote: Vote) -> Decision:
        return decide(self.gather(step, vote))

    def close(self) -> None:
        pass


class KeyValueExchange:
    """Agreement through the key-value store of JAX's coordination service: host to host,
    no device work, so the device queue is never drained for it. A process that received a
    signal writes it once under `said/signal/<process>`, and the step whose upload it has in
    flight (and whether that one is tried again) under `said/upload/<process>` while it does;
    process 0 reads `said/` each step, decides, and writes the step's decision; the other
    processes wait for it. Per step: two small requests from process 0, one from each other
    process (and one as its upload starts, fails or ends)."""
    alone = False
    _instances = 0   # each run in a process gets its own keys (the same count on every process)

    def __init__(self, client, process_index: int, process_count: int, name: Optional[str] = None):
        self.client, self.index, self.count = client, process_index, process_count
        self.lead = process_index == 0
        KeyValueExchange._instances += 1
        self.prefix = f"fractus_jax/policy/{name or KeyValueExchange._instances}"
        self._signal_sent = False
        self._upload_said: tuple = (None, None)

    def _key(self, step: int) -> str:
        return f"{self.prefix}/step/{step // WINDOW}/{step}"

    def agree(self, step: int, vote: Vote) -> Decision:
        if not self.lead:
            if vote.signal and not self._signal_sent:
                self.client.key_value_set(f"{self.prefix}/said/signal/{self.index}", vote.signal)
                self._signal_sent = True
            upload = (vote.uploading, vote.uploading_again)
            if upload != self._upload_said:
                key = f"{self.prefix}/said/upload/{self.index}"
                if upload == (None, None):
                    self.client.key_value_delete(key)
                else:
                    self.client.key_value_set(key, json.dumps(upload), allow_overwrite=True)
                self._upload_said = upload
            return Decision.decode(self._wait(self._key(step)))
        said = {"signal": {}, "upload": {}}
        for key, value in self.client.key_value_dir_get(f"{self.prefix}/said/"):
            kind, index = key.rstrip("/").rsplit("/", 2)[1:]
            said[kind][int(index)] = value
        uploads = {i: json.loads(value) for i, value in said["upload"].items()}
        votes = [vote] + [Vote(signal=said["signal"].get(i), uploading=uploads.get(i, (None, None))[0],
                               uploading_again=uploads.get(i, (None, None))[1]) for i in range(1, self.count)]
        decision = decide(votes)
        self.client.key_value_set(self._key(step), decision.encode())
        if step % WINDOW == 0 and step // WINDOW >= 2:
            # Every process has read those: each is at most a few steps behind process 0
            # (the steps' collectives hold them together).
            self.client.key_value_delete(f"{self.prefix}/step/{step // WINDOW - 2}")
        return decision

    def _wait(self, key: str) -> str:
        while True:
            try:
                return self.client.blocking_key_value_get(key, WAIT_MS)
            except Exception as e:   # noqa: BLE001 - the runtime's error type is not public
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise

    def close(self) -> None:
        """Process 0, after the run's last (collective) save: every process has read every decision."""
        if self.lead:
            try:
                self.client.key_value_delete(self.prefix)
            except Exception:   # noqa: BLE001 - the keys die with the coordinator anyway
                pass


def exchange_for_run():
    """Alone in a one-process run; through the coordination service otherwise."""
    import jax

    if jax.process_count() == 1:
        return Alone()
    return KeyValueExchange(runtime_client(), jax.process_index(), jax.process_count())


def runtime_client():
    """jax.distributed's client of the coordination service (its key-value store), as
    Orbax's public multihost helper hands it out."""
    # JAX exports no handle on this client (jax.distributed has initialize, shutdown and
    # is_initialized), and jax.experimental.multihost_utils agrees through device
    # collectives (broadcast_one_to_all, process_allgather, sync_global_devices), which
    # would drain the device queue every step and cannot serve the peer watchdog's threads.
    # Orbax, which the trainer checkpoints with, hands the client out for its own barriers.
    from orbax.checkpoint import multihost   # multi-process runs only

    if not multihost.is_jax_distributed_client_initialized():
        raise RuntimeError("a multi-process run without jax.distributed's client")
    return multihost.get_jax_distributed_client()


def gather_json(key: str, value, index: int, count: int) -> list:
    """Every process's JSON `value`, by process: each process calls it once with the same key
    and gets the same list, through the coordination service's key-value store (no device
    collective, whose first use gives up when the processes come to it far apart)."""
    client = runtime_client()
    client.key_value_set(f"{key}/{index}", json.dumps(value, sort_keys=True))
    return [json.loads(client.blocking_key_value_get(f"{key}/{i}", WAIT_MS)) for i in range(count)]


def deadline_margin(step_seconds: Optional[float], save_seconds: float) -> float:
    """The seconds a run stops short of its deadline: two steps (the one in flight and the
    next), SAVE_FACTOR times the save's expected seconds (the slowest of the last ones timed;
    before any, the state's bytes over a slow disk's rate: checkpoint.first_save_seconds),
    and DEADLINE_SLACK_SECONDS."""
    return 2 * (step_seconds or 0) + SAVE_FACTOR * save_seconds + DEADLINE_SLACK_SECONDS


class StopSavePolicy:
    """Per step: whether to save by time, whether to stop, whether to finish the save in
    flight. `at_step` is called by every process at every step, in the same order."""

    def __init__(self, save_every_minutes: float, deadline: Optional[float], exchange=None):
        self.save_every_minutes = save_every_minutes
        self.deadline = deadline
        self.exchange = exchange or Alone()
        self.last_save = clock()

    def saved(self) -> None:
        """A save was made (at a step every process saved)."""
        self.last_save = clock()

    def at_step(self, step: int, signal: Optional[str], ckpt, step_seconds: Optional[float]) -> Decision:
        """ckpt: `poll()` (one process), `committed()`, `wait()`, `save_seconds()`,
        `uploading()`, `uploading_again()`. A save finished waits for the upload before it:
        while that one is in flight, a committed save stays unfinished."""
        committed = False
        sending, held = ckpt.uploading(), ckpt.uploading_again()
        if self.exchange.alone:
            if sending is None and held is None:
                ckpt.poll()   # its own view is the agreed one: finish a committed save right away
        elif self.exchange.lead:
            committed = ckpt.committed()
        vote = Vote(signal=signal, uploading=sending, uploading_again=held)
        if self.exchange.lead:
            timed = self.save_every_minutes > 0 and clock() - self.last_save >= 60 * self.save_every_minutes
            near = self.deadline is not None and (
                clock() + deadline_margin(step_seconds, ckpt.save_seconds()) >= self.deadline)
            vote = Vote(signal=signal, timed_save=timed, deadline=near, committed=committed, uploading=sending,
                        uploading_again=held)
        decision = self.exchange.agree(step, vote)
        if decision.finish_save:
            ckpt.wait()
        return decision

    def close(self) -> None:
        self.exchange.close()


def parse_deadline(text: str) -> Optional[float]:
    """The config's deadline as unix seconds (None: none): unix seconds, or an ISO time
    (local time without a zone)."""
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        t = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise TrainError(f"deadline {text!r} is neither unix seconds nor an ISO time (2026-12-01T18:00)") from None
    if t.tzinfo is None:
        t = t.astimezone()  # local time
    return t.timestamp()


def deadline_words(deadline: float) -> str:
    """A deadline (unix seconds) as its ISO time in this machine's zone."""
    return datetime.datetime.fromtimestamp(deadline).astimezone().isoformat(timespec="seconds")


class StopFlag:
    """SIGTERM/SIGINT: finish the current step, save, exit 0. A second SIGINT interrupts."""

    def __init__(self):
        self.signal = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, _frame):
        self.signal = signal.Signals(signum).name
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
