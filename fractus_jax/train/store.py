"""A run directory on object storage: the store holds the committed run, this machine a stage.

    python -m fractus_jax.train --config atom_1b --workdir s3://bucket/runs/a [--stage DIR]
    python -m fractus_jax.train --config atom_1b --workdir gs://bucket/runs/a [--stage DIR]

The trainer works in a local stage (`--stage`, by default under the cache directory) exactly
as in a local run directory, and the store is its truth:

    URL/lease.json                      the writer's lease (conditional puts; see `Lease`)
    URL/checkpoints/<step>/...          a step's files, as the stage committed them
    URL/checkpoints/<step>/committed.json   written after the step's files and the logs:
                                        the step's commit in the store (its files and sizes)
    URL/metrics.jsonl, URL/tensorboard/*    the stage's logs, uploaded whole before each commit
    URL/manifest.json                   uploaded after each commit
    URL/rejected/<step>/...             steps a resume rejected, moved aside

At the start the lease is taken and the store's logs and newest committed step are pulled into
the stage: steps newest first until one verifies (its checksums, its finite flags), the older
ones left in the store (`Mirror.deferred`: retention counts them, and a resume that rejects
every stage step fetches them); a step the store does not hold as committed (an upload that
was cut) is deleted from the store, and so are, on s3://, the multipart uploads such an upload
left unfinished (`Store.unfinished_uploads`; a bucket that keeps what is deleted as older
versions is warned of, `Store.keeps_deleted`); a stage step the store lacks is moved aside to
STAGE/unpushed/; a step the stage held already whose copy fails its checks is fetched again
(the store's is the one committed); a pull the store fails is tried again (`Tries`), each
try fetching the files the tries before did not receive whole, until the run's deadline (a
start after one killed during its pull on this machine takes over its files, each checked).
After each local commit (checksums and manifest written) the step is uploaded in a
background thread: its files, the logs, then committed.json, then the manifest; retention
and rejections are then mirrored. Once a step's upload has settled, the next save drops it
from the stage: a stage holds the step just saved and the newest good one, the run's older
steps being the store's alone (`Mirror.deferred` again). A store is never asked to append,
rename or lock: every object is written whole by one PUT. The next save is finished
(checksums, retention, its upload) at a step after the upload has ended, training going on
meanwhile (`policy`); a save started while that one is unfinished, and the end of the run,
wait for the upload. An upload that fails is tried again while training goes on, each try
going on from where the last stopped (TRY_WAITS); meanwhile no save is made but the run's last
(`Mirror.trying_again`, `policy`), and it stops the run with the step the store holds once
TRIES_SECONDS have passed since its first failure or the run's deadline leaves no time for
another try, or at once when the lease is lost. A call to the store under way at the
deadline is cut there (`Store.deadline`). The deadline's margin counts the uploads owed
(`Mirror.push_seconds`).

Several processes (hosts that share no disk) each stage the run in STAGE/process-<k> and
write there only their own shards (`checkpoint.RunCheckpointer` in parts mode: each array as
zarr chunk files, since OCDBT merges every process's files in one directory). After a save
the processes exchange their files' names, sizes and sha256; each file goes to the store
from the lowest process that holds it, every process uploading its share; process 0, which
alone holds the lease and writes the logs, commits the step once the store holds every file
of it (`PARTS_WAIT_SECONDS`). At the start each process pulls the step it resumes from but
its arrays' chunk files (`Mirror.left_out`); restoring it, it fetches the chunk files its
devices' shards read (`Mirror.fill`): Orbax then restores from each stage as from a shared
disk, each process reading its shards only (Orbax reads with tensorstore's
fill_missing_data_reads off: a chunk file a process lacks fails its restore, never reads as
zeros).

Why a stage rather than Orbax writing to the bucket: orbax-checkpoint 0.12.8 hands array
writes to tensorstore's own driver for gs:// only, and refuses an s3:// directory ("Checkpoint
path should be absolute. Got s3:/..."); one path serves both stores. The library is fsspec's:
s3fs for s3://, whose credentials and endpoint come from the standard variables
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_PROFILE, ...) as boto3 reads
them; gcsfs for gs://, with Google's application default credentials
(GOOGLE_APPLICATION_CREDENTIALS, `gcloud auth application-default login`, or a VM's service
account) and STORAGE_EMULATOR_HOST for a server other than Google's. The lease's one write
that fsspec does not offer on gs://, a PUT conditional on the object's generation, is made by
google-cloud-storage, the client gcsfs itself installs.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import errno
import fcntl
import functools
import hashlib
import importlib.util
import itertools
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator, Optional, TypeVar

import jax

from fractus_jax.train import checkpoint as ckpt_lib
from fractus_jax.train import policy, rundir
from fractus_jax.train import transfer as transfer_lib
from fractus_jax.train.rundir import (CHECKPOINTS, MANIFEST, METRICS, ORBAX_TMP, REJECTED, CheckpointError, RunDirBusy,
                                     RunLock)
from fractus_jax.train.tboard import DIRNAME as TENSORBOARD
from fractus_jax.urls import URL, check_lost_slash

LEASE = "lease.json"
COMMITTED = "committed.json"
UNPUSHED = "unpushed"
PULL_TMP = ORBAX_TMP + "-pull"       # a step being pulled (removed at start like Orbax's leftovers)
LEASE_SECONDS = 120.0                # a lease not renewed for this long is free to take
LEASE_RENEW_SECONDS = 30.0
LEASE_POLL_SECONDS = 5.0             # a start waiting on another's lease looks at it this often
# A holder whose last renewal is older than this commits nothing more: past LEASE_SECONDS
# another process may take the lease, and the margin covers clocks that disagree.
LEASE_TRUST_SECONDS = LEASE_SECONDS - 2 * LEASE_RENEW_SECONDS
# An upload not yet timed is sized by its bytes at this rate (1 Gbit/s: a rented pod's
# uplink to a bucket in another region is often no faster).
UPLOAD_BYTES_PER_SECOND = 125e6
RECENT_PUSHES = 5
# Process 0 commits a step of a multi-process run once the store holds every process's files
# of it: it waits this long after its own upload ended (a dead peer ends the run sooner).
PARTS_WAIT_SECONDS = 600.0
PARTS_POLL_SECONDS = 0.5
# An upload that fails (the store unreachable, the lease not renewed meanwhile, a peer's files
# late) is tried again while training goes on, and so is the pull at a start, after these
# waits (the last repeated), as long as TRIES_SECONDS have not passed since its first failure
# and the run's deadline leaves time: a store down for a few minutes does not stop the run; one
# down for longer stops it with the step the store holds. A lease another process took stops
# it at once.
TRY_WAITS = (5.0, 15.0, 30.0, 60.0)
TRIES_SECONDS = 600.0
# A store request that gets no byte back for this long fails (and is tried again by the
# client library: s3fs and botocore, gcsfs); so does a connection not made in CONNECT_SECONDS.
# A store that stops answering fails the run's upload in minutes, not never.
READ_SECONDS = 15.0
CONNECT_SECONDS = 10.0
# A store that keeps a connection open but stops reading what is sent on it (its receive
# window shut) holds a request for ever: the read timeout starts only once the body is sent,
# and TCP's own retries end only for data never acknowledged. TCP_USER_TIMEOUT (Linux) ends a
# connection whose sent data stays unacknowledged, or whose window stays shut, this long.
SEND_SECONDS = 30.0
# A run with a deadline cuts each call to the store there (the pod ends then); one made after
# it (the lease let go as the run stops) is given this long.
DEADLINE_GRACE_SECONDS = 5.0

# scheme -> (the module fsspec needs for it, the extra that installs it); None: not served yet
SCHEMES = {"s3": ("s3fs", "s3"), "gs": ("gcsfs", "gs")}

Log = Callable[[str], None]
T = TypeVar("T")


def scheme_of(value: str) -> Optional[str]:
    """The URL scheme of a --workdir value, or None for a local path."""
    m = URL.match(str(value))
    return m.group(1).lower() if m else None


def check_url(value: str) -> str:
    """value if it is a local path or a URL this install can serve (its scheme in lower case);
    else why not (ValueError): a scheme not served, its library missing (the extra named), or
    a URL with a slash lost."""
    scheme = scheme_of(value)
    if scheme is None:
        check_lost_slash(value)
        return value
    value = scheme + value[len(scheme):]   # S3://... is s3://... (a scheme's case does not matter)
    if scheme not in SCHEMES:
        raise ValueError(f"{value!r}: a run directory is a local path or an s3:// or gs:// URL, not {scheme}://")
    module, extra = SCHEMES[scheme]
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"{value!r} needs {module}, which is not installed: pip install 'fractus-jax[{extra}]'")
    bucket, _, key = URL.match(value).group(2).partition("/")
    if not bucket or not key.strip("/"):
        raise ValueError(f"{value!r}: give a bucket and a path inside it ({scheme}://BUCKET/PATH)")
    return value


def workdir_arg(value: str) -> str:
    """The argparse type of a trainer's --workdir: a local path or a URL served here; any other
    URL is refused (exit 2), never taken as the local directory its slashes collapse to."""
    try:
        return check_url(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def default_stage(url: str) -> Path:
    """Where a URL's run is staged when --stage is not given: the cache directory's stage/."""
    scheme, rest = URL.match(url).groups()
    return rundir.cache_dir() / "stage" / scheme / rest.strip("/")


def _timed_out_sending(e: Optional[BaseException]) -> bool:
    """e, or what it wraps (botocore keeps it in `kwargs`), is a connection that TCP_USER_TIMEOUT
    ended (ETIMEDOUT)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ETIMEDOUT:
            return True
        wrapped = getattr(e, "kwargs", None)
        e = (wrapped.get("error") if isinstance(wrapped, dict) else None) or e.__cause__ or e.__context__
    return False


def failure_words(e: BaseException) -> str:
    """rundir.reason, with words for a timeout that has none (gcsfs's) and for a store that
    stopped taking what was sent (which botocore words as a connection never made)."""
    if isinstance(e, TimeoutError) and not str(e).strip():
        return f"the store did not answer (no byte for {READ_SECONDS:g} s, on each of the client's tries)"
    if _timed_out_sending(e):
        return f"the store took nothing sent to it for {SEND_SECONDS:g} s, on each of the client's tries"
    if isinstance(e, CheckpointError):   # the run's own words (a lease not renewed)
        return str(e)
    return rundir.reason(e)


# the local disk's failures: another try would meet them again
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.ENOTDIR, errno.EISDIR}


def store_failed(e: BaseException) -> bool:
    """e is the store failing (unreachable, not answering, an error of its own), which a later
    try may not meet; not a refusal that it would meet again (credentials, a missing object,
    a check), nor the local disk."""
    if isinstance(e, (CheckpointError, FileNotFoundError, PermissionError)):
        return False
    return not (isinstance(e, OSError) and (e.errno in DISK_ERRNOS or (
        isinstance(e.filename, str) and os.path.isabs(e.filename))))


def _no_expect(params, **kwargs):
    """An S3 request without "Expect: 100-continue" (botocore asks it of every PUT): aiohttp
    waits for the interim answer with no timeout, so a store that stops answering would hold
    the PUT for ever; without it, the read timeout bounds every request. (The body goes out
    before a refusal is seen: a part of 50 MiB at most.)"""
    params.get("headers", {}).pop("Expect", None)


def _socket(addr_info) -> socket.socket:
    """A store connection's socket (aiohttp's socket_factory), with TCP_USER_TIMEOUT set to
    SEND_SECONDS where the system has it."""
    family, kind, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=kind, proto=proto)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(SEND_SECONDS * 1000))
    return sock


async def _connector():
    """gcsfs's connection pool: aiohttp's, with `_socket`; made in fsspec's loop, which binds it."""
    import aiohttp
    return aiohttp.TCPConnector(socket_factory=_socket)


def _quiet_orphans(loop, context) -> None:
    """fsspec's loop: the store's failures of the requests a call cut at the deadline left
    running are said by the call's own error, not by asyncio's traceback at exit."""
    error = context.get("exception")
    if context.get("message") == "Task exception was never retrieved" and error is not None and store_failed(error):
        return
    loop.default_exception_handler(context)


def _filesystem(scheme: str):
    # installed with the s3 and gs extras: imported only when a URL is used
    import aiohttp
    import fsspec
    import fsspec.asyn
    fsspec.asyn.get_loop().set_exception_handler(_quiet_orphans)
    # no listings cache: the store changes under this client (another process's part of a
    # step, a run read while it trains), and a cached listing would hide that
    common = {"skip_instance_cache": True, "use_listings_cache": False}
    if scheme == "s3":
        fs = fsspec.filesystem("s3", **common, config_kwargs={
            "read_timeout": READ_SECONDS, "connect_timeout": CONNECT_SECONDS,
            "connector_args": {"socket_factory": _socket}})
        # on the one client s3fs makes and keeps: after botocore's own handler, which adds it
        fs.s3.meta.events.register("before-call.s3", _no_expect)
        return fs
    # gcsfs logs each request that ran out of tries with its traceback; the run's own error
    # line names the failure, the URL and the step the store holds
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
    # gcsfs sets no timeout of its own: without one, a request to a silent store never ends
    loop = fsspec.asyn.get_loop()
    return fsspec.filesystem("gs", **common, loop=loop, requests_timeout=aiohttp.ClientTimeout(
        sock_connect=CONNECT_SECONDS, sock_read=READ_SECONDS),
        session_kwargs={"connector": fsspec.asyn.sync(loop, _connector)})


# What each store's refusals name: the credentials it reads and the variable of its endpoint.
CREDENTIALS = {"s3": ("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"),
               "gs": ("GOOGLE_APPLICATION_CREDENTIALS", "`gcloud auth application-default login`")}
ENDPOINTS = {"s3": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"), "gs": ("STORAGE_EMULATOR_HOST",)}
# The field of an object's info (and of a PUT's answer) that the conditional PUTs name: its
# ETag on s3://, its generation on gs://.
VERSION_FIELD = {"s3": "ETag", "gs": "generation"}


class Store:
    """A URL's objects through fsspec: whole-object reads and writes, conditional puts."""

    def __init__(self, url: str):
        check_url(url)
        self.url = url.rstrip("/")
        self.scheme, rest = URL.match(self.url).groups()
        self.root = rest.strip("/")
        self.bucket = self.root.split("/", 1)[0]
        self.fs = _filesystem(self.scheme)
        self._gcs = None   # gs://: google-cloud-storage's bucket, for `replace`
        # a run's deadline (unix seconds; None: none): a call under way is cut there (`_call`)
        self.deadline: Optional[float] = None

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *[p.strip("/") for p in parts if p]])

    def url_of(self, *parts: str) -> str:
        return f"{self.scheme}://{self.path(*parts)}"

    def key(self, *parts: str) -> str:
        """The object key (in the bucket) of a path under the run; "" for the bucket's root."""
        return self.path(*parts).partition("/")[2]

    def check_access(self) -> None:
        """The bucket exists and the credentials read it: refused (CheckpointError) in one line.
        What is listed is the run's own prefix, as a key allowed only that prefix may; the
        bucket only when the prefix holds nothing (a new run, or no bucket)."""
        try:
            try:
                self._call("ls", self.root, detail=False, refresh=True)
            except FileNotFoundError:   # an empty prefix, or no bucket
                try:
                    self._call("ls", self.bucket, detail=False, refresh=True)
                except PermissionError:
                    pass   # a key that may list its prefix only: the bucket is there
        except FileNotFoundError:
            raise CheckpointError(f"{self.url}: the bucket {self.bucket} does not exist (or this endpoint does "
                                  f"not serve it){self._endpoint_words()}; create it first") from None
        except PermissionError as e:
            raise CheckpointError(f"{self.url}: access refused ({failure_words(e)}); check the credentials "
                                  "({}, or {})".format(*CREDENTIALS[self.scheme])) from None
        except Exception as e:   # noqa: BLE001 - no credentials, no network, a bad endpoint
            # botocore's, google-auth's
            if any(c.__name__ in ("NoCredentialsError", "DefaultCredentialsError") for c in type(e).__mro__):
                raise CheckpointError(f"{self.url}: no credentials found; set "
                                      "{} (or {})".format(*CREDENTIALS[self.scheme])) from None
            raise CheckpointError(f"{self.url}: cannot reach the store{self._endpoint_words()} "
                                  f"({failure_words(e)})") from None

    def check_not_in_run(self) -> None:
        """CheckpointError where the URL is, or lies inside, another run's checkpoints (as
        `rundir.check_not_in_run` for a local directory)."""
        keys = self.root.split("/")
        for i in rundir.runs_around(keys):
            run = "/".join(keys[:i])
            if any(self._seen(f"{run}/{n}") for n in (LEASE, MANIFEST)):
                where = f"{self.scheme}://{run}"
                raise rundir.nested_run_error(self.url, where, f"{where}/{CHECKPOINTS}", url=True)

    def _seen(self, path: str) -> bool:
        """The object exists, as far as the credentials may see (a key allowed only its own
        prefix is refused a look outside it)."""
        try:
            return self._call("exists", path)
        except PermissionError:
            return False

    def _endpoint_words(self) -> str:
        endpoint = next((os.environ[v] for v in ENDPOINTS[self.scheme] if os.environ.get(v)), None)
        return f" at {endpoint}" if endpoint else ""

    def exists(self, *parts: str) -> bool:
        return self._call("exists", self.path(*parts))

    def read(self, *parts: str) -> bytes:
        return self._call("cat_file", self.path(*parts))

    def write(self, data: bytes, *parts: str) -> None:
        """One PUT of the whole object."""
        self._call("pipe_file", self.path(*parts), data)

    # Conditional PUTs, the lease's: an object's version is its VERSION_FIELD.

    def version(self, *parts: str) -> Optional[str]:
        """The object's version; None when it does not exist."""
        try:
            info = self._call("info", self.path(*parts), refresh=True)
        except FileNotFoundError:
            return None
        version = info.get(VERSION_FIELD[self.scheme])
        return None if version is None else str(version)

    def create(self, data: bytes, *parts: str) -> str:
        """A PUT that only creates (If-None-Match: *, ifGenerationMatch=0): FileExistsError
        when the object exists. Returns its version."""
        answer = self._call("pipe_file", self.path(*parts), data, mode="create")
        return self._version_of(answer, parts)

    def replace(self, data: bytes, version: str, *parts: str) -> str:
        """A PUT that only replaces the object at `version` (If-Match, ifGenerationMatch):
        OSError when it is at another one (or gone). Returns its new version."""
        if self.scheme == "gs":
            return self._gcs_replace(data, version, parts)
        answer = self._call("pipe_file", self.path(*parts), data, IfMatch=version)   # s3fs: OSError when refused
        return self._version_of(answer, parts)

    def _version_of(self, answer, parts) -> str:
        if isinstance(answer, dict) and answer.get(VERSION_FIELD[self.scheme]) is not None:
            return str(answer[VERSION_FIELD[self.scheme]])
        return self.version(*parts)

    def _gcs_replace(self, data: bytes, version: str, parts) -> str:
        from google.api_core import exceptions   # installed with gcsfs (the gs extra)
        from google.auth import exceptions as auth_exceptions
        from google.cloud import storage
        try:
            if self._gcs is None:
                self._gcs = storage.Client().bucket(self.bucket)
            blob = self._gcs.blob(self.key(*parts))
            seconds = self._bound()
            blob.upload_from_string(data, if_generation_match=int(version),
                                    **({"timeout": seconds} if seconds is not None else {}))
        except (exceptions.GoogleAPIError, auth_exceptions.GoogleAuthError) as e:
            raise OSError(f"{type(e).__name__}: {e}") from None
        return str(blob.generation)

    def listdir(self, *parts: str) -> list[str]:
        """The names directly under a prefix ([] when none)."""
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1]
                          for p in self._call("ls", self.path(*parts), detail=False, refresh=True))
        except FileNotFoundError:
            return []

    def files(self, *parts: str) -> dict[str, int]:
        """{path relative to the prefix: size} of every object under it."""
        base = self.path(*parts)
        try:
            found = self._call("find", base, detail=True, withdirs=False)
        except FileNotFoundError:
            return {}
        return {p[len(base) + 1:]: int(info.get("size", 0)) for p, info in found.items() if p.startswith(base + "/")}

    def remove(self, *parts: str) -> None:
        files = list(self.files(*parts))
        if files:
            self._call("rm", [self.path(*parts, f) for f in files])

    def delete(self, *parts: str) -> None:
        """One object."""
        self._call("rm", self.path(*parts))

    def copy(self, src: tuple[str, ...], dst: tuple[str, ...]) -> None:
        """One object, copied inside the store."""
        self._call("copy", self.path(*src), self.path(*dst))

    def put(self, local: list[Path], remote: list[str], transfer: Optional[transfer_lib.Transfer] = None) -> None:
        """Files to objects; `transfer` counts the bytes sent."""
        if local:
            self._call("put", [str(p) for p in local], [self.path(r) for r in remote],
                       **({"callback": transfer} if transfer is not None else {}))

    def get(self, remote: list[str], local: list[Path], transfer: Optional[transfer_lib.Transfer] = None) -> None:
        """Objects to files; `transfer` counts the bytes received."""
        for p in local:
            p.parent.mkdir(parents=True, exist_ok=True)
        if remote:
            self._call("get", [self.path(r) for r in remote], [str(p) for p in local],
                       **({"callback": transfer} if transfer is not None else {}))

    def keeps_deleted(self) -> bool:
        """The bucket keeps each object deleted or replaced under the run's prefix as an older
        version, stored and billed, with no lifecycle rule that ever deletes it: versioning is
        on (S3's Enabled; GCS's object versioning) and no rule that expires noncurrent versions
        covers the prefix (S3's NoncurrentVersionExpiration; GCS's Delete on an age or a
        noncurrent condition, its isLive not true). False where the credentials may not read
        the bucket's settings: then nothing is said."""
        key = self.key() and self.key() + "/"
        try:
            if self.scheme == "s3":
                if self._call("call_s3", "get_bucket_versioning", Bucket=self.bucket).get("Status") != "Enabled":
                    return False
                try:
                    rules = self._call("call_s3", "get_bucket_lifecycle_configuration", Bucket=self.bucket)["Rules"]
                except FileNotFoundError:   # NoSuchLifecycleConfiguration: the bucket has no rule
                    rules = []
                return not any(r.get("Status") == "Enabled" and "NoncurrentVersionExpiration" in r
                               and _s3_rule_covers(r, key) for r in rules)
            info = self._call("call", "GET", "b/{}", self.bucket, json_out=True)
            if not (info.get("versioning") or {}).get("enabled"):
                return False
            return not any(_gcs_rule_covers(r, key) for r in (info.get("lifecycle") or {}).get("rule") or [])
        except Exception:   # noqa: BLE001 - settings the key may not read (each library its own error)
            return False

    def unfinished_uploads(self, *parts: str) -> list[tuple[str, str]]:
        """s3://: the multipart uploads under a prefix that were begun and neither completed
        nor aborted, as (key under the prefix, upload id). A client aborts its own when a part
        fails, but not when its process is killed or its call is cut (at the run's deadline),
        and their parts stay stored, and billed, listed by no object listing, until aborted.
        gs:// has none to abort: an unfinished resumable upload lapses within a week."""
        if self.scheme != "s3":
            return []
        prefix = self.key(*parts) + "/"
        found, marker = [], {}
        while True:
            page = self._call("call_s3", "list_multipart_uploads", Bucket=self.bucket, Prefix=prefix, **marker)
            found += [(u["Key"][len(prefix):], u["UploadId"]) for u in page.get("Uploads") or []]
            if not page.get("IsTruncated"):
                return sorted(found)
            marker = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def abort_upload(self, key: str, upload_id: str, *parts: str) -> int:
        """Abort one of `unfinished_uploads(*parts)`: its parts are deleted. Returns the bytes
        they held."""
        key = self.key(*parts, key)
        held, marker = 0, {}
        try:
            while True:
                page = self._call("call_s3", "list_parts", Bucket=self.bucket, Key=key, UploadId=upload_id, **marker)
                held += sum(int(p.get("Size", 0)) for p in page.get("Parts") or [])
                if not page.get("IsTruncated"):
                    break
                marker = {"PartNumberMarker": page["NextPartNumberMarker"]}
            self._call("call_s3", "abort_multipart_upload", Bucket=self.bucket, Key=key, UploadId=upload_id)
        except FileNotFoundError:   # NoSuchUpload: completed or aborted meanwhile
            pass
        return held

    def _bound(self) -> Optional[float]:
        """The seconds a call to the store may take: to the deadline, at least
        DEADLINE_GRACE_SECONDS; None without a deadline."""
        return None if self.deadline is None else max(self.deadline - time.time(), DEADLINE_GRACE_SECONDS)

    def _call(self, method: str, *args, **kwargs):
        """self.fs.<method>(...), cut where a deadline is set (TimeoutError): at the deadline,
        or DEADLINE_GRACE_SECONDS after it starts when it starts later (the lease let go as
        the run stops). A store that holds its connections answering nothing, or a link too
        slow for a step, keeps a call going no longer than the pod lives."""
        seconds = self._bound()
        if seconds is None:
            return getattr(self.fs, method)(*args, **kwargs)
        try:   # fsspec's own bound: the requests under way are cancelled
            return getattr(self.fs, method)(*args, timeout=seconds, **kwargs)
        except (TimeoutError, asyncio.TimeoutError):
            if time.time() < self.deadline:
                raise
            raise TimeoutError(f"cut at the run's deadline, {policy.deadline_words(self.deadline)}") from None


def _s3_rule_covers(rule: dict, key: str) -> bool:
    """An S3 lifecycle rule applies to every object under `key` (a prefix of it, no tag)."""
    where = rule.get("Filter") or {}
    where = where.get("And", where)
    prefix = rule.get("Prefix") or where.get("Prefix") or ""
    return key.startswith(prefix) and not (where.get("Tag") or where.get("Tags"))


# The conditions of a GCS lifecycle rule that match an object's noncurrent versions (age: every
# version, unless isLive says which).
GCS_NONCURRENT = ("age", "numNewerVersions", "daysSinceNoncurrentTime", "noncurrentTimeBefore")


def _gcs_rule_covers(rule: dict, key: str) -> bool:
    """A GCS lifecycle rule deletes the noncurrent versions of every object under `key`."""
    if (rule.get("action") or {}).get("type") != "Delete":
        return False
    condition = rule.get("condition") or {}
    live = condition.get("isLive")
    noncurrent = live is False or (live is None and any(c in condition for c in GCS_NONCURRENT))
    prefixes = condition.get("matchesPrefix")
    return noncurrent and (not prefixes or any(key.startswith(p) for p in prefixes))


# ----------------------------------------------------------------------------- the lease

class LeaseUnrenewed(RunDirBusy):
    """The holder's lease was not renewed for LEASE_TRUST_SECONDS (the store did not take the
    renewals): it commits nothing until a renewal goes through."""


# a version no object has: the probe's PUT naming it must be refused
OTHER_VERSION = {"s3": '"0"', "gs": "1"}


class Lease:
    """One writer at a time on a store: URL/lease.json, written only by conditional PUTs.

    Taken by a create-if-absent (If-None-Match: *; on gs://, ifGenerationMatch=0); renewed
    every LEASE_RENEW_SECONDS by a PUT that names the version (ETag; generation) this holder
    last wrote (If-Match; ifGenerationMatch), so that a lease another process took over is
    never overwritten; taken over by the same conditional PUT once it expired (not
    renewed for LEASE_SECONDS: its holder died) or when its holder is a process of this
    machine and process namespace (the same boot and pid namespace: containers sharing a
    host name do not count) that no longer lives. A lease another machine holds is watched
    (`_await_lapse`): refused once its holder renews it, taken once it lapses, so that a new
    pod started as the old one vanished waits for its lease rather than failing. A store
    that ignores either condition is refused at acquire. A holder that lost its lease
    (`lost`) commits nothing more; one that could not renew it for LEASE_TRUST_SECONDS
    commits nothing until a renewal goes through."""

    def __init__(self, store: Store, log: Log):
        self.store, self.log = store, log
        self.holder = uuid.uuid4().hex
        self.version: Optional[str] = None   # of the lease as this holder last wrote it
        self.lost: Optional[str] = None
        self._renewed = 0.0          # time.monotonic() of the last PUT the store took
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def _body(self) -> bytes:
        now = time.time()
        return json.dumps({"holder": self.holder, "host": socket.gethostname(), "pid": os.getpid(),
                           "machine": _machine(), "renewed": now, "expires": now + LEASE_SECONDS},
                          sort_keys=True).encode()

    def _check_conditions(self) -> None:
        """What the lease needs of the store, tried on a probe object: a create-if-absent on an
        object that exists fails; a PUT naming a version the object does not have fails and
        leaves it; a PUT naming its own version succeeds. A store (or a client) that lets the
        first two through would let two writers hold the lease; one that refuses the last
        could never renew it."""
        probe = f".conditional-put-probe-{self.holder}"

        def ignores(condition):
            return CheckpointError(f"{self.store.url}: this store ignores conditional writes ({condition}), so it "
                                   "cannot hold the run's lease; use a store that honours them (AWS S3, Google "
                                   "Cloud Storage, MinIO, recent Ceph and R2 do)")
        try:
            version = self.store.create(b"1", probe)
            try:
                self.store.create(b"2", probe)
            except FileExistsError:
                pass
            else:
                raise ignores("If-None-Match")
            try:
                self.store.replace(b"3", OTHER_VERSION[self.store.scheme], probe)
            except OSError:
                pass
            if self.store.read(probe) != b"1":
                raise ignores("If-Match")
            try:
                self.store.replace(b"4", version, probe)
            except OSError as e:
                raise CheckpointError(f"{self.store.url}: this store refuses a PUT naming the object's own version "
                                      f"({failure_words(e)}), so the run's lease could never be renewed; "
                                      "use a store that honours conditional writes (AWS S3, Google Cloud Storage, "
                                      "MinIO, recent Ceph and R2 do)") from None
        finally:
            try:
                self.store.delete(probe)
            except Exception:   # noqa: BLE001 - a stray probe object harms nothing
                pass

    def acquire(self) -> "Lease":
        self._check_conditions()
        try:
            self.version = self.store.create(self._body(), LEASE)
        except FileExistsError:
            self.version = self._take_over()
        self._renewed = time.monotonic()
        _HELD[self.holder] = self
        self._thread = threading.Thread(target=self._renew_loop, name="fractus-lease", daemon=True)
        self._thread.start()
        return self

    def _take_over(self):
        version = self.store.version(LEASE)
        if version is None:   # released since the create found it: create it again
            try:
                return self.store.create(self._body(), LEASE)
            except FileExistsError:
                raise RunDirBusy(f"{self.store.url}: another process took the lease at the same moment") from None
        try:
            held = json.loads(self.store.read(LEASE))
        except (FileNotFoundError, ValueError):
            held = {}
        now = time.time()
        expired = float(held.get("expires", 0)) < now
        # a holder of this host that ended, or a lease this process left (a run here that
        # could not release it) and no longer holds
        here = held.get("host") == socket.gethostname() and held.get("machine") == _machine()
        dead_here = here and (
            not _alive(held.get("pid")) or (held.get("pid") == os.getpid() and held.get("holder") not in _HELD))
        why = "expired" if expired else "its holder's process has ended, or let it go"
        if here and not (expired or dead_here):   # a process of this machine that runs
            raise RunDirBusy(f"{self.store.url} is in use by pid {held.get('pid')} on {held.get('host')} (its lease, "
                             f"renewed every {LEASE_RENEW_SECONDS:.0f} s while it runs, holds for "
                             f"{float(held.get('expires', now)) - now:.0f} s more; one process writes a run at a "
                             "time: wait for it to end or stop it)")
        if not (expired or dead_here):   # another machine's: its holder may have ended with its pod
            why = self._await_lapse(version, held)
            if why == "released":
                return self._take_over()
        try:
            taken = self.store.replace(self._body(), version, LEASE)
        except OSError:
            raise RunDirBusy(f"{self.store.url}: another process took the lease at the same moment") from None
        self.log(f"note: took the lease of {self.store.url_of(LEASE)} ({why}: pid {held.get('pid')} "
                 f"on {held.get('host')})")
        return taken

    def _await_lapse(self, version, held: dict) -> str:
        """A lease another machine holds, watched: its holder renewing it runs, and this start is
        refused (RunDirBusy, within LEASE_RENEW_SECONDS); a lease that lapses (past its expiry, or
        unrenewed for LEASE_SECONDS by this clock) had a holder that stopped without letting it
        go (a pod that ended), and is taken: "expired". "released": its holder let it go."""
        who = f"pid {held.get('pid')} on {held.get('host')}"
        started = time.monotonic()
        left = lambda: min(float(held.get("expires", 0)) - time.time(),  # noqa: E731
                           LEASE_SECONDS - (time.monotonic() - started))
        self.log(f"note: {self.store.url} is held by {who}; waiting up to {left():.0f} s: a run that holds it "
                 f"renews it every {LEASE_RENEW_SECONDS:.0f} s (this one is then refused), and one that stopped "
                 "without letting it go leaves it to lapse (this one then takes it)")
        while left() > 0:
            time.sleep(min(LEASE_POLL_SECONDS, max(left(), 0.0)))
            now = self.store.version(LEASE)
            if now is None:
                return "released"
            if now != version:
                raise RunDirBusy(f"{self.store.url} is in use by {who}: it renewed its lease (every "
                                 f"{LEASE_RENEW_SECONDS:.0f} s while it runs); one process writes a run at a time: "
                                 "wait for it to end or stop it")
        return "expired"

    def renew(self) -> None:
        with self._lock:
            if self.lost or self.version is None:
                return
            try:
                version = self.store.replace(self._body(), self.version, LEASE)
            except OSError as e:
                current = self.store.version(LEASE)
                if current == self.version:
                    return   # a store that does not answer: tried again at the next renewal
                try:
                    mine = json.loads(self.store.read(LEASE)).get("holder") == self.holder
                except (FileNotFoundError, ValueError):
                    mine = False
                if mine:   # our PUT was taken and its answer lost
                    self.version, self._renewed = current, time.monotonic()
                else:
                    self.lost = f"another process took the lease ({failure_words(e)})"
                return
            self.version, self._renewed = version, time.monotonic()

    def _renew_loop(self) -> None:
        while not self._stop.wait(LEASE_RENEW_SECONDS):
            try:
                self.renew()
            except Exception:   # noqa: BLE001 - the next renewal tries again; `check` judges
                pass

    def check(self, renew: bool = False) -> None:
        """Before a commit: raise RunDirBusy when the lease was lost, or not renewed for so
        long that another process may have taken it. renew: a lease due for renewal is
        renewed first. A lease not renewed for a while (a store unreachable) is trusted again
        once a renewal goes through: that PUT names the version this holder last wrote, so it
        fails if another process took the lease meanwhile (the lease is then lost)."""
        if renew and not self.lost and self.version is not None and self.unrenewed() > LEASE_RENEW_SECONDS:
            self.renew()
        if self.lost:
            raise RunDirBusy(f"{self.store.url}: {self.lost}; this process commits nothing more")
        if self.version is not None and self.unrenewed() > LEASE_TRUST_SECONDS:
            raise LeaseUnrenewed(f"{self.store.url}: the lease was not renewed for {self.unrenewed():.0f} s (the "
                                 f"store did not take it), and another process may take it after "
                                 f"{LEASE_SECONDS:.0f} s; this process commits nothing until a renewal goes through")

    def unrenewed(self) -> float:
        """Seconds since the store last took this holder's lease."""
        return time.monotonic() - self._renewed

    def release(self, ending: bool = False) -> None:
        """Delete the lease where it is still this holder's. ending: this process ends outside
        the run's close (its watchdog ends it, with a bound on the time): the renewal thread is
        not waited for, and the lease is marked lost first, so that an upload still running
        commits nothing after it."""
        self._stop.set()
        if self._thread is not None and not ending:
            self._thread.join()
        with self._lock:
            version = None if self.lost else self.version
            if ending and not self.lost:
                self.lost = "this process is ending"
            try:
                if version is not None and self.store.version(LEASE) == version:
                    self.store.delete(LEASE)
            except Exception:   # noqa: BLE001 - a store that does not answer: the lease expires
                pass
            self.version = None
            _HELD.pop(self.holder, None)


_HELD: dict[str, Lease] = {}   # the leases this process holds, by holder


def let_leases_go() -> None:
    """The leases this process holds, let go as its watchdog ends it (a peer died, or stopped
    on an error): a new pod's start then takes the run at once, not after LEASE_SECONDS. A
    store that does not answer leaves them to lapse (the caller bounds the time)."""
    for lease in list(_HELD.values()):
        lease.release(ending=True)


def _machine() -> str:
    """This boot of this machine and this process's pid namespace: two processes with the same
    value see each other's pids (containers sharing a host name may not)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:   # not Linux: the host name alone, as before
        return ""


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


# ----------------------------------------------------------------------------- the mirror

def _step_files(step_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(step_dir)): p.stat().st_size for p in sorted(step_dir.rglob("*")) if p.is_file()}


def _log_files(stage: Path) -> list[str]:
    """The stage's logs, relative: metrics.jsonl and the event files."""
    names = [METRICS] if (stage / METRICS).is_file() else []
    tb = stage / TENSORBOARD
    if tb.is_dir():
        names += [str(p.relative_to(stage)) for p in sorted(tb.rglob("*")) if p.is_file()]
    return names


class Tries:
    """The failures of an operation tried again: `failed()` after each gives the wait before
    the next try (TRY_WAITS, the last repeated), or None once TRIES_SECONDS have passed since
    the first failure, or the deadline (unix seconds) comes before the next try would."""

    def __init__(self, deadline: Optional[float] = None):
        self.deadline = deadline
        self.count = 0             # the failures so far
        self._first = 0.0          # time.monotonic() of the first
        self._past_deadline = False

    def failed(self) -> Optional[float]:
        now = time.monotonic()
        self.count += 1
        self._first = now if self.count == 1 else self._first
        wait = TRY_WAITS[min(self.count, len(TRY_WAITS)) - 1]
        if wait > TRIES_SECONDS - (now - self._first):
            return None
        if self.deadline is not None and wait > self.deadline - time.time():
            self._past_deadline = True
            return None
        return wait

    def left(self) -> float:
        """Seconds until the tries end, failing still."""
        left = TRIES_SECONDS - (time.monotonic() - self._first)
        return left if self.deadline is None else min(left, self.deadline - time.time())

    def run(self, fn: Callable[[], T], what: str, log: Log, again: Optional[Callable[[], None]] = None) -> T:
        """fn(), tried again while the store fails it (`store_failed`; a lease not renewed
        meanwhile too), saying so: `warning: {what} failed (...); trying again in 5 s (...)`.
        again: called before each try after the first (a lease's check). Raises the last
        failure once the tries end, or the first that another try would meet again."""
        while True:
            try:
                if self.count and again is not None:
                    again()
                return fn()
            except Exception as e:   # noqa: BLE001 - the store, the network, the disk
                if not (isinstance(e, LeaseUnrenewed) or store_failed(e)):
                    raise
                wait = self.failed()
                if wait is None:
                    raise
                log(f"warning: {what} failed ({failure_words(e)}); trying again in {wait:g} s (it stops if it "
                    f"still fails {self.left():.0f} s from now)")
                time.sleep(wait)

    def words(self) -> str:
        """" (tried K times over S s[; the deadline ...])" once they ended, as the error says it."""
        said = [f"tried {self.count} times over {time.monotonic() - self._first:.0f} s"] if self.count > 1 else []
        if self._past_deadline:
            said.append(f"the run's deadline, {policy.deadline_words(self.deadline)}, comes before another try")
        return f" ({'; '.join(said)})" if said else ""


class Mirror:
    """The store's side of a run trained in a local stage: `open` (lease, pull), `push(step)`
    after each local commit (in the background), `settle` (wait for it; raise what failed),
    `close` (logs, lease released).

    In a run of several processes (`count` > 1), each has its mirror and stage; process 0
    (`lead`) holds the lease, uploads the logs and commits; the others pull, and upload their
    share of each step's files."""

    def __init__(self, url: str, stage, log: Log = print, index: int = 0, count: int = 1):
        self.store = Store(url)
        self.url = self.store.url
        self.stage = Path(stage)
        self.log = log
        self.index, self.count = index, count
        self.lead = index == 0
        self.lease = Lease(self.store, log)
        self.lock = RunLock(self.stage)          # the stage's, from the pull on (RunDir takes it over)
        self.committed: Optional[int] = None     # the newest step the store holds as committed
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._push: Optional[concurrent.futures.Future] = None
        self._push_step: Optional[int] = None
        self._sending: Optional[transfer_lib.Transfer] = None   # the step's files of the upload in flight
        self.checked: set[int] = set()   # steps the pull checked (checksums, finite flags): the resume trusts them
        self._pushes = collections.deque(maxlen=RECENT_PUSHES)
        self._guess = 0.0
        self._sizes: dict[str, int] = {}          # log files as last uploaded
        # committed steps of the run the stage does not hold (older than the one the resume
        # needs, left in the store by the pull; older than the step just saved, dropped from
        # the stage once uploaded: `defer`): retention lets them go (`let_go`); a resume that
        # needs them fetches them
        self.deferred: set[int] = set()
        # of a multi-process run, the steps pulled in part: {step: {name: (size, its array)}}
        # of the chunk files left in the store, each process fetching those its shards read
        # (`fill`)
        self.left_out: dict[int, dict[str, tuple[int, str]]] = {}
        self._fills = 0   # restores whose fetches the processes agreed on (each its own key)
        # the step whose upload failed and waits for another try (None: none): meanwhile the
        # trainer starts no save but a last one, and training goes on (`policy`)
        self.trying_again: Optional[int] = None
        self._closed = False

    @property
    def deadline(self) -> Optional[float]:
        """The run's deadline (unix seconds; None: none), the pod ending then: the pull and an
        upload that fail are not tried again past it, and a call to the store under way is cut there."""
        return self.store.deadline

    @deadline.setter
    def deadline(self, deadline: Optional[float]) -> None:
        self.store.deadline = deadline

    # -- start

    def open(self) -> "Mirror":
        self.store.check_access()
        self.store.check_not_in_run()
        rundir.check_not_in_run(self.stage)
        try:
            self.stage.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise rundir.io_error("cannot create the stage", self.stage, e, None) from None
        self.lock.acquire()   # before the pull moves anything in the stage
        try:
            if self.lead:
                self.lease.acquire()
        except CheckpointError:
            self.lock.release()
            raise
        except Exception as e:   # noqa: BLE001 - refused writes, a store gone since check_access
            self.lock.release()
            raise CheckpointError(f"{self.url}: cannot take the run's lease ({failure_words(e)}); the credentials "
                                  "must be allowed to write there") from None
        if self.lead and self.store.keeps_deleted():
            self.log(f"warning: {self.store.scheme}://{self.store.bucket} keeps each object deleted or replaced as an "
                     f"older version (versioning is on), and no lifecycle rule deletes those under {self.url}: each "
                     "step retention deletes stays stored, and billed; a rule that expires noncurrent versions under "
                     "that prefix frees them")
        try:
            self.pull()
        except BaseException:
            self.lease.release()
            self.lock.release()
            raise
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fractus-push")
        return self

    def pull(self) -> None:
        """Make the stage the store's committed run: leftovers of cut uploads deleted from the
        store, stage steps the store lacks set aside, the store's steps and logs fetched. A
        store that fails meanwhile is tried again (`Tries`): each try starts over, but for the
        steps and the files fetched whole already (`fetch_step`). The tries end before the
        run's deadline."""
        tries = Tries(self.deadline)
        with self._pulling(tries):   # what the pull deletes in the store is the lease holder's
            tries.run(self._pull, f"the pull of {self.url} into {self.stage}", self.log,
                      again=(lambda: self.lease.check(renew=True)) if self.lead else None)

    @contextlib.contextmanager
    def _pulling(self, tries: Tries):
        """A failure of the store or the disk while fetching into the stage: CheckpointError."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as e:   # noqa: BLE001 - the store or the disk
            raise CheckpointError(f"cannot pull {self.url} into {self.stage}: {failure_words(e)}{tries.words()}") \
                from None

    @property
    def parts(self) -> bool:
        """Each process stages and uploads its own part of each step."""
        return self.count > 1

    def _pull(self) -> None:
        self.deferred, self.checked, self.left_out = set(), set(), {}
        steps = store_steps(self.store)
        for step in sorted(s for s, record in steps.items() if record is None):
            if self.lead:   # the lease holder's to clean; the others only read what is committed
                self.store.remove(CHECKPOINTS, str(step))
                self.log(f"note: removed {self.store.url_of(CHECKPOINTS, str(step))}, left by an upload that did "
                         "not finish")
        if self.lead:
            self._abort_unfinished()
        steps = {s: r for s, r in steps.items() if r is not None}
        local = self.stage / CHECKPOINTS
        parts = {}   # step -> this stage's part of it (a process's own files of a step it saved)
        if local.is_dir():
            for p in sorted(local.iterdir()):
                if not p.name.isdigit():
                    continue
                record = steps.get(int(p.name))
                held = _step_files(p)
                if record is not None and held != record.get("files") and _is_part(held, record.get("files")):
                    parts[int(p.name)] = p
                elif record is None or held != record.get("files"):
                    moved = rundir.move_aside(p, self.stage / UNPUSHED)
                    why = ("does not hold it as committed" if record is None
                           else f"holds step {p.name} committed with other files")
                    self.log(f"note: moved {p} to {moved}: {self.url} {why}")
        # Newest first, until a step verifies (its checksums, its finite flags): a resume needs
        # that step alone. The older ones stay in the store (`deferred`) unless the stage holds
        # them whole; a resume that rejects the step fetches them (`fetch_deferred`).
        resumable = None
        for step in sorted(steps, reverse=True):
            missing = not (local / str(step)).exists() or step in parts
            if resumable is not None:
                if missing:
                    self.deferred.add(step)
                    if step in parts:   # this process's part: the store holds the step whole
                        shutil.rmtree(parts[step])
                continue
            step_dir, files = local / str(step), steps[step]["files"]
            held = step_dir.exists()
            rest = self._fetch(step, files) if missing else {}
            damage = _differs_from_commit(step_dir, files, rest)
            if damage is not None and held:   # this disk's copy: the store's is the one committed
                self.log(f"note: the stage's copy of step {step} is not the one committed ({damage}); fetching "
                         f"it again from {self.url}")
                shutil.rmtree(step_dir)
                rest = self._fetch(step, files)
                damage = _differs_from_commit(step_dir, files, rest)
            if damage is None and ckpt_lib.saved_non_finite(step_dir) is None:
                resumable = step
                self.checked.add(step)
        if self.deferred:
            self._name_the_run()
            left = ", ".join(map(str, sorted(self.deferred)))
            self.log(f"note: step{'s' * (len(self.deferred) > 1)} {left} left in {self.url} (not pulled): the resume "
                     f"needs step {resumable} alone")
        for name in (METRICS, MANIFEST):
            path = self.stage / name
            if path.exists():
                rundir.move_aside(path, self.stage / UNPUSHED)
        if (self.stage / TENSORBOARD).exists():
            rundir.move_aside(self.stage / TENSORBOARD, self.stage / UNPUSHED)
        logs = [n for n in self.store.files() if n == MANIFEST or (
            self.lead and (n == METRICS or n.startswith(TENSORBOARD + "/")))]   # the logs are process 0's
        self.store.get(logs, [self.stage / n for n in logs])
        self._sizes = {n: (self.stage / n).stat().st_size for n in logs}
        self.committed = max(steps) if steps else None
        if self.lead:
            self._remove_gone(set(steps))

    def _abort_unfinished(self) -> None:
        """The lease holder's, before any upload of its own: abort the multipart uploads a
        killed or cut upload left under the run's steps (`Store.unfinished_uploads`). A key
        that may not list or abort them is told once, and the start goes on."""
        for where in (CHECKPOINTS, REJECTED):
            try:
                left = self.store.unfinished_uploads(where)
                held = sum(self.store.abort_upload(key, upload_id, where) for key, upload_id in left)
            except PermissionError as e:
                self.log(f"note: cannot abort the unfinished uploads under {self.store.url_of(where)} "
                         f"({failure_words(e)}): the parts of an upload cut there stay stored until aborted "
                         "(s3:ListBucketMultipartUploads and s3:AbortMultipartUpload let the run abort them, or a "
                         "lifecycle rule's AbortIncompleteMultipartUpload does)")
                return
            if left:
                self.log(f"note: aborted {len(left)} upload{'s' * (len(left) > 1)} to {self.store.url_of(where)} "
                         f"left unfinished (e.g. {left[0][0]}): the {held / 1e6:.1f} MB of parts they held are "
                         "deleted")

    def _fetch(self, step: int, files: dict[str, int]) -> dict[str, tuple[int, str]]:
        """The committed step's files the stage lacks, into it; in a multi-process run, all but
        its arrays' chunk files, which come at the restore (`fill`): returns those, left out."""
        rest = {}
        if self.parts:
            step_dir = self.stage / CHECKPOINTS / str(step)
            held = _step_files(step_dir) if step_dir.is_dir() else {}
            rest = {n: (files[n], array) for n, array in chunk_files(files).items() if held.get(n) != files[n]}
            self.left_out[step] = rest
            self.log(f"note: step {step}'s shards ({sum(size for size, _ in rest.values()) / 1e6:.1f} MB "
                     "not here) are fetched at the restore, each process those it reads")
        fetch_step(self.store, step, {n: size for n, size in files.items() if n not in rest}, self.stage / CHECKPOINTS,
                   self.log)
        return rest

    def fill(self, step: int, arrays: dict) -> None:
        """Before a restore of a step the pull fetched in part: the chunk files that the
        shards of `arrays` ({item/name: the array restored, its sharding the target's}) on
        this process's devices read, fetched and checked against the step's checksums (a
        chunk file missing would fail the restore). An array the step holds that `arrays`
        does not name is fetched whole. Every process of the run calls it for each restore,
        and all agree: a step whose files fail on one process fails on all (CheckpointError:
        the step is rejected everywhere); a store that fails one process's fetch stops every
        process (RunDirIOError: nothing rejected, the same command resumes)."""
        if not self.parts:
            return
        failure = None   # ("bad" | "io", why) of this process
        try:
            why = self._fill(step, arrays)
            if why is not None:
                failure = ("bad", why)
        except CheckpointError as e:   # the store's files are not those committed
            failure = ("bad", str(e))
        except Exception as e:   # noqa: BLE001 - the store, the network, the disk
            failure = ("io", failure_words(e))
        self._fills += 1
        failures = policy.gather_json(f"fractus_jax/fill/{step}/{self._fills}", failure, self.index, self.count)
        failed = [(i, f) for i, f in enumerate(failures) if f is not None]
        failed.sort(key=lambda x: x[1][0] != "io")   # a store that failed first: then nothing is rejected
        if failed:
            (i, (kind, why)), url = failed[0], self.store.url_of(CHECKPOINTS, str(step))
            where = "" if i == self.index else f"process {i}: "
            if kind == "io":
                raise rundir.RunDirIOError(f"cannot fetch the shards of step {step} from {url} ({where}{why}); "
                                           f"{self._store_words()}")
            raise CheckpointError(f"the shards of step {step} in {url} are not those committed ({where}{why})")

    def _fill(self, step: int, arrays: dict) -> Optional[str]:
        """This process's part of `fill`: why a fetched file fails its checksum, or None."""
        left = self.left_out.get(step)
        if not left:
            return None
        step_dir = self.stage / CHECKPOINTS / str(step)
        by_array = collections.defaultdict(set)
        for n, (_, array) in left.items():
            by_array[array].add(n)
        need = set()
        for array, names in by_array.items():
            leaf = arrays.get(array)
            sharding = getattr(leaf, "sharding", None)
            if sharding is None:
                need |= names
                continue
            zarray = json.loads((step_dir / array / ".zarray").read_text())
            read = chunk_names(zarray, sharding.addressable_devices_indices_map(tuple(leaf.shape)).values())
            need |= {n for n in names if n[len(array) + 1:] in read}
        mb = lambda names: sum(left[n][0] for n in names) / 1e6   # noqa: E731
        self.log(f"step {step}: this process's shards read {len(need)} of the {len(left)} chunk files not here "
                 f"({mb(need):.1f} of {mb(left):.1f} MB)")
        if need:
            fetch_step(self.store, step, {n: left[n][0] for n in need}, self.stage / CHECKPOINTS, self.log)
        self.left_out[step] = {n: v for n, v in left.items() if n not in need}
        return ckpt_lib.check_some(step_dir, need)

    def fetch_deferred(self) -> bool:
        """Fetch the committed steps the pull left in the store (a resume rejected every step
        the stage holds), tried again while the store fails as the pull is; False when there
        are none."""
        if not self.deferred:
            return False
        tries = Tries(self.deadline)
        with self._pulling(tries):
            records = tries.run(lambda: store_steps(self.store), f"the read of {self.url}", self.log)
            for step in sorted(self.deferred, reverse=True):
                if records.get(step) is not None:
                    tries.run(lambda: fetch_step(self.store, step, records[step]["files"], self.stage / CHECKPOINTS,
                                                 self.log), f"the fetch of step {step} of {self.url}", self.log)
        self.deferred.clear()
        return True

    def defer(self, step: int) -> None:
        """A step of the run the stage no longer holds (retention keeps in the stage the step
        just saved and the newest good one): the store's copy stays the run's."""
        self.deferred.add(step)
        self._name_the_run()

    def _name_the_run(self) -> None:
        """The stage lacks steps the store holds: it names its run, so that a reader given the
        stage and one of those steps is sent there."""
        rundir.write_json_atomic(self.stage / rundir.STAGED, {"url": self.url})

    def let_go(self, step: int) -> None:
        """Retention let a step the pull left in the store go: retired from the store with the
        next commit."""
        self.deferred.discard(step)

    def resumed(self) -> None:
        """After a resume moved rejected steps aside in the stage: the store's copies moved to
        URL/rejected/ now, before any process uploads a step that may take their numbers."""
        if not self.lead:
            return
        try:
            self.lease.check()
            self._remove_gone(set(store_steps(self.store)))
        except RunDirBusy:
            raise
        except Exception as e:   # noqa: BLE001 - the store or the network
            raise rundir.RunDirIOError(f"cannot move the rejected steps aside in {self.url}: {failure_words(e)}; "
                                       f"{self._store_words()}") from None

    def expect(self, whole_bytes: int) -> None:
        """Uploads will be of a state of this many bytes: until one is timed, the margin's guess."""
        self._pushes.clear()
        self._guess = whole_bytes / UPLOAD_BYTES_PER_SECOND

    # -- after each commit

    def push(self, step: int, files: Optional[dict[str, tuple[int, int]]] = None) -> None:
        """Upload a step the stage committed, in the background (one at a time). files: of a
        multi-process run's step, {name: (size, the process that uploads it)} of every
        process's files (`checkpoint.RunCheckpointer`); None: the stage's step whole."""
        self.settle()
        if self.lead and self.lease.lost:
            self.lease.check()
        self._push, self._push_step = self._pool.submit(self._upload, step, files), step

    def settle(self) -> None:
        """Wait for the upload in flight; raise (RunDirIOError) what made it fail."""
        if self._push is None:
            return
        push, self._push = self._push, None
        # a wait longer than a moment says how far the upload is (the bytes of the step's
        # files; then the logs and the commit, which are small)
        while not concurrent.futures.wait([push], timeout=transfer_lib.PROGRESS_SECONDS).done:
            sending = self._sending   # None while a failed try waits to be tried again
            if sending is not None:
                self.log(sending.words())
        push.result()

    def pushing(self) -> bool:
        return self._push is not None and not self._push.done()

    @property
    def uploading(self) -> Optional[int]:
        """The step whose upload is in flight (tried again included), or None."""
        return self._push_step if self.pushing() else None

    def check(self) -> None:
        """Between steps: an upload whose tries ended failing raises now (`settle`), not at
        the next save."""
        if self._push is not None and self._push.done() and self._push.exception() is not None:
            self.settle()

    def push_seconds(self, owed: int = 1) -> float:
        """The seconds of `owed` uploads to come and of the one in flight, if any (a save
        waits for it first): each the slowest of the last uploads' (the guess before one is
        timed)."""
        seconds = max(self._pushes) if self._pushes else self._guess
        return seconds * (owed + self.pushing())

    def _upload(self, step: int, files) -> None:
        """`_upload_step`, tried again while it fails (`Tries`); each try goes on from where
        the last one stopped. The margin's time is the try that went through."""
        done: set[str] = set()
        tries = Tries(self.deadline)
        try:
            while True:
                started = time.time()
                try:
                    if self.lead:
                        self.lease.check(renew=True)
                    self._upload_step(step, files, done)
                    break
                except Exception as e:   # noqa: BLE001 - the store, the network, the disk
                    if isinstance(e, RunDirBusy) and not isinstance(e, LeaseUnrenewed):
                        raise   # the lease lost
                    words = failure_words(e)
                    wait = tries.failed()
                    if wait is None:
                        raise rundir.RunDirIOError(
                            f"cannot upload step {step} to {self.store.url_of(CHECKPOINTS, str(step))}: "
                            f"{words}{tries.words()}; {self._store_words()}") from None
                    self._sending = None
                    self.trying_again = step
                    self.log(f"warning: the upload of step {step} to {self.url} failed ({words}); trying again in "
                             f"{wait:g} s while training goes on (it stops the run if it still fails "
                             f"{tries.left():.0f} s from now)")
                    time.sleep(wait)
        finally:
            self.trying_again = None
        if tries.count:
            self.log(f"note: step {step} is uploaded to {self.url} (try {tries.count + 1})")
        self._pushes.append(time.time() - started)

    def _store_words(self) -> str:
        if not self.lead:   # process 0 commits: the newest it told (`_tell_committed`)
            try:
                self.committed = int(policy.runtime_client().key_value_try_get(COMMITTED_KEY))
            except Exception:   # noqa: BLE001 - none told yet (the pull's then), or the service gone
                if self.committed is not None:
                    return (f"{self.url} holds step {self.committed}, or a newer one process 0 committed (the same "
                            "command resumes from the newest)")
        if self.committed is None:
            return f"{self.url} holds no committed step yet"
        return f"{self.url} holds step {self.committed} (the same command resumes from it)"

    def _upload_step(self, step: int, parts, done: set[str]) -> None:
        """The step's files, the logs, its commit, the manifest, retention. done: the stages
        an earlier try of this upload finished ("retiring", "retired", "sent", "committed"),
        added to as each one ends: a try goes on from the first stage not done (each object
        the store took is whole, and this holder's lease kept it so)."""
        step_dir = self.stage / CHECKPOINTS / str(step)
        if parts is None:
            files = _step_files(step_dir)
            names = sorted(files)
        else:
            files = {n: size for n, (size, _) in parts.items()}
            names = sorted(n for n, (_, owner) in parts.items() if owner == self.index)
        if self.lead and "retired" not in done:
            # an older save of this step (a resume rejected it and fell back): retired before
            # any file of the new one lands over it (a multi-process run's, at the resume); a
            # try cut inside this finishes it (its commit is deleted first)
            if "retiring" in done or self.store.exists(CHECKPOINTS, str(step), COMMITTED):
                done.add("retiring")
                self.lease.check()
                self._retire(step)
            done.add("retired")
        if "sent" not in done:
            self._sending = transfer_lib.Transfer(
                sum(files[n] for n in names), f"waiting for the upload of step {step} to {self.url}")
            self.store.put([step_dir / n for n in names], [f"{CHECKPOINTS}/{step}/{n}" for n in names],
                           self._sending)
            done.add("sent")
        if not self.lead:
            return
        if "committed" not in done:
            self._upload_logs()
            if parts is not None:
                self._await_parts(step, parts)
            self.lease.check()
            write_commit(self.store, step, files)
            self.committed = step
            done.add("committed")
            if self.parts:
                _tell_committed(step)
        if (self.stage / MANIFEST).is_file():
            self.store.write((self.stage / MANIFEST).read_bytes(), MANIFEST)
        self.lease.check()
        self._remove_gone(set(store_steps(self.store)) - {step})

    def _await_parts(self, step: int, parts: dict[str, tuple[int, int]]) -> None:
        """Until the store holds every process's files of the step, each at its size; raise
        (naming the processes behind) after PARTS_WAIT_SECONDS."""
        deadline = time.monotonic() + PARTS_WAIT_SECONDS
        while True:
            held = self.store.files(CHECKPOINTS, str(step))
            missing = sorted(n for n, (size, _) in parts.items() if held.get(n) != size)
            if not missing:
                return
            if time.monotonic() > deadline:
                behind = sorted({parts[n][1] for n in missing})
                raise TimeoutError(f"process(es) {', '.join(map(str, behind))} did not upload their files of it "
                                   f"within {PARTS_WAIT_SECONDS:.0f} s ({len(missing)} missing, e.g. {missing[0]})")
            time.sleep(PARTS_POLL_SECONDS)

    def _upload_logs(self) -> None:
        """The logs whose size changed since their last upload, each whole."""
        changed = [n for n in _log_files(self.stage) if (self.stage / n).stat().st_size != self._sizes.get(n)]
        for n in changed:
            data = (self.stage / n).read_bytes()
            self.store.write(data, n)
            self._sizes[n] = len(data)

    def _remove_gone(self, in_store: set[int]) -> None:
        """Store steps the stage no longer holds: moved aside where the stage rejected them,
        deleted where retention let them go (their commit first)."""
        local = self.stage / CHECKPOINTS
        held = {int(p.name) for p in local.iterdir() if p.name.isdigit()} if local.is_dir() else set()
        for step in sorted(in_store - held - self.deferred):
            self._retire(step)

    def _retire(self, step: int) -> None:
        """A store step out of the run: its commit removed first, then its files, copied to
        URL/rejected/<step> first when the stage rejected it."""
        prefix = f"{CHECKPOINTS}/{step}"
        if self.store.exists(prefix, COMMITTED):
            self.store.delete(prefix, COMMITTED)
        if (self.stage / REJECTED / str(step)).exists():
            files = self.store.files(prefix)
            for n in files:
                self.store.copy((prefix, n), (REJECTED, str(step), n))
            self.log(f"note: moved the rejected {self.store.url_of(prefix)} to {self.store.url_of(REJECTED, str(step))}")
        self.store.remove(prefix)

    # -- end

    def close(self, quiet: bool = False) -> None:
        """Wait for the upload in flight, upload the logs, release the lease."""
        if self._closed:
            return
        self._closed = True
        try:
            self.settle()
            if self.lead and not self.lease.lost:
                self._upload_logs()
        except Exception as e:   # noqa: BLE001
            if not quiet and isinstance(e, (rundir.RunDirIOError, RunDirBusy)):
                raise   # the upload's own words: the step, the URL, what the store holds
            if not quiet:
                raise rundir.RunDirIOError(f"cannot upload to {self.url}: {failure_words(e)}; "
                                           f"{self._store_words()}") from None
            self.log(f"warning: while stopping: {e}")
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self.lease.release()
            self.lock.release()


def store_steps(store: Store) -> dict[int, Optional[dict]]:
    """{step: its committed.json, or None for a step without one (an upload that was cut)}."""
    steps = {}
    for name in store.listdir(CHECKPOINTS):
        if name.isdigit():
            try:
                steps[int(name)] = json.loads(store.read(CHECKPOINTS, name, COMMITTED))
            except (FileNotFoundError, ValueError):
                steps[int(name)] = None
    return steps


# A zarr array's chunk file, by its path in the array's directory: its index in the chunk grid
# ("0.4", or "0/4" for an array whose dimension separator is a slash).
CHUNK = re.compile(r"^\d+([./]\d+)*$")


def chunk_files(files) -> dict[str, str]:
    """{name: its array's directory} of a step's zarr chunk files (of a multi-process run's
    step, whose arrays are each a directory: .zarray and a file per chunk)."""
    arrays = {n[:-len("/.zarray")] for n in files if n.endswith("/.zarray")}
    chunks = {}
    for n in files:
        keys = n.split("/")
        for k in range(len(keys) - 1, 0, -1):   # the array: the longest prefix holding a .zarray
            array = "/".join(keys[:k])
            if array in arrays:
                if CHUNK.match("/".join(keys[k:])):
                    chunks[n] = array
                break
    return chunks


def chunk_names(zarray: dict, indices) -> set[str]:
    """The chunk files (names in the array's directory) of a zarr array (its .zarray) that
    hold any element of `indices`: a tuple of slices, one per dimension, for each shard."""
    shape, grid = zarray["shape"], zarray["chunks"]
    sep = zarray.get("dimension_separator") or "."
    if not shape:
        return {"0"}
    names = set()
    for index in indices:
        index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
        ranges = []
        for s, n, c in zip(index, shape, grid):
            start, stop, _ = s.indices(n)
            ranges.append(range(start // c, -(-stop // c)) if stop > start else range(0))
        names.update(sep.join(map(str, k)) for k in itertools.product(*ranges))
    return names


def _differs_from_commit(step_dir: Path, files: dict[str, int], absent=frozenset(), items=None) -> Optional[str]:
    """How a step's files differ from those committed (`files`, the commit's sizes, checksums.json
    among them): a file that fails its checksum, or a checksums.json that does not read; None
    when they match. absent, items: as for `checkpoint.check_files`."""
    status, why = ckpt_lib.check_files(step_dir, items, absent)
    if status == "unchecked" and ckpt_lib.CHECKSUMS in files:
        return f"its {ckpt_lib.CHECKSUMS} does not read"
    return why if status == "bad" else None


def _is_part(held: dict[str, int], files: Optional[dict[str, int]]) -> bool:
    """held is some of files, each at its size: a process's own part of a multi-process step."""
    return bool(held) and files is not None and all(files.get(n) == size for n, size in held.items())


@functools.lru_cache(maxsize=None)
def _machine_tag() -> str:
    """`_machine` as a short name: the processes whose pids a fetch's directory name can be
    checked against."""
    return hashlib.sha256((_machine() or socket.gethostname()).encode()).hexdigest()[:12]


def _fetch_tmp(checkpoints: Path, step: int) -> Path:
    """This process's temporary directory for a fetch of the step."""
    return checkpoints / f"{step}{PULL_TMP}-{_machine_tag()}-{os.getpid()}"


def _gone_fetches(checkpoints: Path, step="*") -> list[Path]:
    """The temporary directories of fetches (of the step; "*": of any) left unfinished by a
    process of this machine that has ended (killed, or its tries ended)."""
    return [p for p in sorted(checkpoints.glob(f"{step}{PULL_TMP}-{_machine_tag()}-*"))
            if p.is_dir() and not _alive(p.name.rsplit("-", 1)[1])]


# This process's fetch directories' files taken over from an ended process's fetch and not
# checked yet (a try that fails before the check leaves them so for the next).
_unchecked: dict[Path, set[str]] = {}


def _take_over_fetch(checkpoints: Path, step: int, tmp: Path) -> bool:
    """A fetch of the step that an ended process of this machine left unfinished: its
    directory made this fetch's (`tmp`, which must not exist); True when there was one."""
    for p in _gone_fetches(checkpoints, step):
        try:
            os.replace(p, tmp)
            return True
        except OSError:   # another fetch took it first
            continue
    return False


def fetch_step(store: Store, step: int, files: dict[str, int], checkpoints: Path, log: Log) -> Path:
    """A committed step's files into checkpoints/<step>. The files the directory holds already
    at their size (this process's own part of the step, a reader's weights) stay where they
    are; the rest are fetched into a temporary directory, checked against `files`, and moved
    in only once all are here. A step only ever gains whole files: a command reading it
    meanwhile reads what it read before, and a fetch cut short leaves it as it was (and a
    leftover removed at the next start). The files a fetch cut short received whole stay in
    its temporary directory: this process's next fetch of the step (a try again) fetches the
    others only, and so does the next fetch of it on this machine once that process has ended
    (killed, or its tries ended), which checks the files it finds against the step's
    checksums (fetched again) and fetches again those that differ."""
    dst = checkpoints / str(step)
    held = _step_files(dst) if dst.is_dir() else {}
    kept = {n: size for n, size in held.items() if files.get(n) == size}
    tmp = _fetch_tmp(checkpoints, step)
    # a try cut short: the files that came whole stay; another process's fetch: they stay if
    # the step's checksums are here, or come now, to check them against
    inherited = not tmp.is_dir() and _take_over_fetch(checkpoints, step, tmp)
    left = _step_files(tmp) if tmp.is_dir() else {}
    came = {n: size for n, size in left.items() if files.get(n) == size and n not in kept}
    if inherited:
        checkable = ckpt_lib.CHECKSUMS in files or (dst / ckpt_lib.CHECKSUMS).is_file()
        came = {n: size for n, size in came.items() if checkable and n != ckpt_lib.CHECKSUMS}
        _unchecked[tmp] = set(came)
    unchecked = sorted(_unchecked.get(tmp, set()) & set(came))
    for n in set(left) - set(came):   # cut short themselves (or not to be checked): fetched again
        (tmp / n).unlink()
    names = sorted(set(files) - set(kept) - set(came))
    t0 = time.time()
    size = sum(files[n] for n in names)
    checkpoints.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(checkpoints).free
    if size > free:   # refused before a byte comes, not when the disk fills
        raise CheckpointError(f"cannot pull step {step} of {store.url} into {checkpoints}: it needs "
                              f"{size / 1e9:.2f} GB more and the disk has {free / 1e9:.2f} GB free; free some, "
                              "or put it on a larger disk (the trainer's --stage DIR; FRACTUS_CACHE=DIR for the "
                              "read cache)")
    before = "a fetch that did not finish (checked against the step's checksums)" if unchecked else "the try before"
    log(f"pulling step {step} ({size / 1e6:.1f} MB) from {store.url_of(CHECKPOINTS, str(step))}"
        + (f"; {len(kept)} of its files are here already" if kept else "")
        + (f"; {len(came)} came whole in {before}" if came else ""))
    store.get([f"{CHECKPOINTS}/{step}/{n}" for n in names], [tmp / n for n in names],
              transfer_lib.Transfer(size, f"pulling step {step}", log))
    if unchecked:
        record = ckpt_lib.read_checksums(tmp if (tmp / ckpt_lib.CHECKSUMS).is_file() else dst)
        differ = sorted(ckpt_lib.unmatched(tmp, unchecked, record))
        if differ:
            log(f"note: {len(differ)} of the files of step {step} that a fetch which did not finish left differ "
                f"from its checksums (e.g. {differ[0]}): fetching them again")
            for n in differ:
                (tmp / n).unlink()
            store.get([f"{CHECKPOINTS}/{step}/{n}" for n in differ], [tmp / n for n in differ],
                      transfer_lib.Transfer(sum(files[n] for n in differ), f"pulling step {step}", log))
    _unchecked.pop(tmp, None)
    names = sorted({*names, *came})
    got = _step_files(tmp) if names else {}
    if got != {n: files[n] for n in names}:
        wrong = sorted(n for n in set(names) | set(got) if got.get(n) != files.get(n))
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{store.url_of(CHECKPOINTS, str(step))} does not hold the files its {COMMITTED} "
                              f"names ({len(wrong)} differ, e.g. {wrong[0]}): the store changed under it")
    if held:
        for n in names:   # the step gains whole files, one rename each
            (dst / n).parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp / n, dst / n)
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        try:
            os.replace(tmp, dst)
        except OSError:
            if not dst.is_dir():   # else another reader fetched it first
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.time() - t0
    log(f"pulled step {step} in {seconds:.1f} s ({size / 1e6 / max(seconds, 1e-9):.0f} MB/s)")
    return dst


# The read cache's steps that commands are reading: a shared flock on READ/.../.reading/<step>
# per step, held by each reader until it ends (the kernel drops it however the process ends).
# A step no longer in the store is removed from the cache only when no command holds it.
# The lock's time is when a command last took it: a run's cache keeps the READ_CACHE_STEPS
# steps read last (and any step a command still reads), so that reading step after step of a
# run does not fill the disk (4 GB of weights a step for atom_1b).
READING = ".reading"
READ_CACHE_STEPS = 2
_read_locks: dict[str, int] = {}


def _read_lock(path: Path) -> None:
    """This process reads the cached step `path` names until it ends (or `done_reading`): no
    other command removes it meanwhile."""
    if str(path) not in _read_locks:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)   # waits only while another command removes the step
        _read_locks[str(path)] = fd
    now = time.time_ns()
    os.utime(path, ns=(now, now))


def _read_unlock(path: Path) -> None:
    fd = _read_locks.pop(str(path), None)
    if fd is not None:
        os.close(fd)


def done_reading() -> None:
    """The steps this process read from the read cache may leave it (a process that reads one
    step after another: each held until it ends otherwise)."""
    while _read_locks:
        os.close(_read_locks.popitem()[1])


def _remove_unread(step_dir: Path, lock: Path) -> bool:
    """Remove a cached step unless a command reads it (then False: it stays, for another time)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        shutil.rmtree(step_dir, ignore_errors=True)
        return True
    finally:
        os.close(fd)   # the lock with it


def _evict(local: Path, want: int, log: Log) -> None:
    """The cached steps of a run beyond the READ_CACHE_STEPS read last (`want` among them)
    removed, unless a command reads them; so are the fetches of other steps that processes of
    this machine left unfinished."""
    def last_read(step: str) -> int:
        try:
            return (local / READING / step).stat().st_mtime_ns
        except FileNotFoundError:
            return 0
    others = sorted((p.name for p in (local / CHECKPOINTS).iterdir() if p.name.isdigit() and p.name != str(want)),
                    key=last_read, reverse=True)
    for name in others[READ_CACHE_STEPS - 1:]:
        if _remove_unread(local / CHECKPOINTS / name, local / READING / name):
            log(f"note: removed step {name} from the read cache {local} (it keeps the {READ_CACHE_STEPS} steps "
                "of a run read last)")
    for p in _gone_fetches(local / CHECKPOINTS):   # the step read now's is this fetch's to take over
        if not p.name.startswith(f"{want}{PULL_TMP}-"):
            shutil.rmtree(p, ignore_errors=True)
            log(f"note: removed {p}, left by a fetch that did not finish")


_STEP_URL = re.compile(r"^(.*)/" + CHECKPOINTS + r"/(\d+)$")


def readable(value: str, step: Optional[int] = None, log: Log = print, items=None) -> str:
    """The --ckpt of a command that reads a run (eval, generate, convert export, grow): a local
    path as it is; a URL's run, or its URL/checkpoints/<step>, fetched into the read cache
    (FRACTUS_CACHE/read/...): the step named, or --step, or the newest the store holds as
    committed, and the manifest. items: the step's items the command reads (the weights alone:
    `checkpoint.WEIGHTS_ITEMS`), fetched with the step's own files and no others; None: all.
    Takes no lease: a committed step's files never change. A cached step only gains files, and
    stays in the cache while a command reads it (`READING`), also once the store has dropped it.
    The files of the items read that the cache holds already are checked against their
    checksums (`checkpoint.verified`: the command's own check does not hash them again); a
    step that fails is fetched again.
    Returns the local path to read; CheckpointError when the store cannot serve it."""
    if scheme_of(value) is None:
        return value
    url, named = value.rstrip("/"), None
    m = _STEP_URL.match(url)
    if m:
        url, named = m.group(1), int(m.group(2))
    try:
        src = Store(url)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    src.check_access()
    tries = Tries()
    try:
        steps = {s: r for s, r in tries.run(lambda: store_steps(src), f"the read of {url}", log).items()
                 if r is not None}
        want = named if named is not None else step
        if want is None:
            if not steps:
                raise CheckpointError(f"{url} holds no committed checkpoint")
            want = max(steps)
        if want not in steps:
            raise CheckpointError(f"{url} has no committed checkpoint at step {want} (steps: {sorted(steps)})")
        local = rundir.cache_dir() / "read" / src.scheme / src.root
        checkpoints = local / CHECKPOINTS
        checkpoints.mkdir(parents=True, exist_ok=True)
        for p in checkpoints.iterdir():   # the cache holds some of what the store still commits, as it has it
            if not p.name.isdigit():
                continue
            record = steps.get(int(p.name))
            if record is not None and _is_part(_step_files(p), record["files"]):
                continue
            removed = _remove_unread(p, local / READING / p.name)   # not while another command reads it
            if not removed and int(p.name) == want:
                raise CheckpointError(f"the read cache's step {want} of {url} ({p}) differs from the store's, "
                                      "and another command reads it: run this one again once it ends")
        lock = local / READING / str(want)
        _read_lock(lock)
        _evict(local, want, log)
        files = steps[want]["files"]
        needed = {n: size for n, size in files.items()
                  if items is None or "/" not in n or n.split("/", 1)[0] in items}
        step_dir = checkpoints / str(want)
        held = _step_files(step_dir) if step_dir.is_dir() else {}
        whole = set()   # the items read whose files the cache held already, and found sound
        if held:   # checked, as it is read: a file damaged on this disk since it came is fetched again
            kinds = {n.split("/", 1)[0] for n in needed if "/" in n}
            check = {k for k in kinds if any(n.startswith(k + "/") for n in held)}
            absent = set(needed) - set(held)
            ckpt_lib.verified(step_dir, ())
            why = _differs_from_commit(step_dir, files, frozenset(absent), check)
            if why is None:
                whole = {k for k in check if not any(n.startswith(k + "/") for n in absent)}
            else:
                log(f"note: the read cache's copy of step {want} of {url} is not the one committed ({why}); "
                    f"fetching it again ({step_dir})")
                _read_unlock(lock)
                if not _remove_unread(step_dir, lock):
                    raise CheckpointError(f"the read cache's copy of step {want} of {url} ({step_dir}) is not the "
                                          f"one committed ({why}), and another command reads it: run this one "
                                          "again once it ends")
                _read_lock(lock)
                held = {}
        if set(needed) - set(held):
            tries.run(lambda: fetch_step(src, want, {**held, **needed}, checkpoints, log),
                      f"the fetch of step {want} of {url}", log)
        ckpt_lib.verified(step_dir, whole)   # the command's own check hashes the rest only
        manifest = tries.run(lambda: src.read(MANIFEST) if src.exists(MANIFEST) else None,
                             f"the read of {src.url_of(MANIFEST)}", log)
        if manifest is not None:
            rundir.write_text_atomic(local / MANIFEST, manifest.decode())
    except CheckpointError:
        raise
    except Exception as e:   # noqa: BLE001 - the store or the disk
        raise CheckpointError(f"cannot fetch {value}: {failure_words(e)}{tries.words()}") from None
    return str(checkpoints / str(want)) if named is not None else str(local)


@contextlib.contextmanager
def new_run(value: str, log: Log = print) -> Iterator[str]:
    """The --out of a command that writes a new run directory (grow, convert import): a local
    path as it is; for a URL, the lease is taken (the URL must hold no run), a temporary stage
    is given to the command to write in, and once it has written, every step it committed
    is uploaded and committed in the store, the lease released and the stage removed. A
    command that fails leaves the URL as it was."""
    if scheme_of(value) is None:
        yield value
        return
    stage = Path(tempfile.mkdtemp(prefix="fractus-new-run-"))
    try:
        mirror = open_mirror(value, stage / "run", log=log)
        try:
            if mirror.committed is not None:
                raise CheckpointError(f"{mirror.url} holds a run already (step {mirror.committed}): give a new path")
            mirror.lock.release()   # the command locks the (private) stage as its run directory
            yield str(mirror.stage)
            checkpoints = mirror.stage / CHECKPOINTS
            for step in sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()):
                mirror.push(step)
            mirror.close()
        finally:
            mirror.close(quiet=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


# of a multi-process run: the newest step process 0 committed in the store, which the other
# processes' error lines name
COMMITTED_KEY = "fractus_jax/store/committed"


def _tell_committed(step: int) -> None:
    try:
        policy.runtime_client().key_value_set(COMMITTED_KEY, str(step), allow_overwrite=True)
    except Exception:   # noqa: BLE001 - the words of another process's error line only
        pass


def write_commit(store: Store, step: int, files: dict[str, int]) -> None:
    """The step's commit in the store: its files and sizes, written after them and the logs."""
    store.write(json.dumps({"step": step, "files": files}, sort_keys=True).encode(), CHECKPOINTS, str(step), COMMITTED)


def open_mirror(url: str, stage=None, log: Log = print, deadline: Optional[float] = None) -> Mirror:
    """The mirror of a URL's run, lease taken and stage pulled (CheckpointError when it cannot).
    In a run of several processes each stages in STAGE/process-<k>, and none trains before
    every stage is pulled. deadline: the run's (unix seconds), which the pull's tries end
    before, as the uploads' do."""
    stage = Path(stage if stage is not None else default_stage(url))
    index, count = jax.process_index(), jax.process_count()
    mirror = Mirror(url, stage if count == 1 else stage / f"process-{index}", log, index, count)
    mirror.deadline = deadline
    mirror.open()
    if count == 1:
        return mirror
    # a barrier of the coordination service, not of the devices: process 0 comes to it later
    # (the lease), and a first device collective gives up when the processes are far apart
    policy.runtime_client().wait_at_barrier("fractus_jax: every stage pulled", policy.WAIT_MS)
    return mirror
