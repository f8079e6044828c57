"""A real S3 API on this machine for the tests: moto's server in a subprocess, and a TCP relay
in front of it that a test can cut (the store "stopped") and restore without losing the
server's objects."""
from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

import boto3

KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
# A store that stops answering fails an upload within seconds, not after minutes of retries.
FAST_FAIL = {"AWS_MAX_ATTEMPTS": "2", "AWS_RETRY_MODE": "standard"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """A store's server in a subprocess listening on 127.0.0.1:`port`; `close` stops it."""

    port: int
    proc: subprocess.Popen

    def _wait_listening(self, name: str) -> None:
        deadline = time.monotonic() + 60
        while True:   # a connection, not a request: requests are counted when keys are checked
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:   # not listening yet
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not start (exit {self.proc.poll()})") from None
                time.sleep(0.1)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class S3Server(LocalServer):
    """moto's S3 server on a free port of 127.0.0.1, for as long as the object lives."""

    def __init__(self, checks_keys_after: Optional[int] = None):
        """checks_keys_after=N: the server checks each request's key and signature against
        its IAM users after its first N requests (moto's INITIAL_NO_AUTH_ACTION_COUNT)."""
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        if checks_keys_after is not None:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(checks_keys_after)
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(self.port)], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_listening("moto's server")

    def user_key(self) -> tuple[str, str]:
        """(access key id, secret) of a new IAM user allowed everything (3 requests)."""
        iam = boto3.client("iam", endpoint_url=self.endpoint, aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
                           aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"], region_name=KEYS["AWS_DEFAULT_REGION"])
        iam.create_user(UserName="run")
        key = iam.create_access_key(UserName="run")["AccessKey"]
        iam.put_user_policy(UserName="run", PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        return key["AccessKeyId"], key["SecretAccessKey"]

    def client(self, endpoint=None):
        return boto3.client("s3", endpoint_url=endpoint or self.endpoint, aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"], region_name=KEYS["AWS_DEFAULT_REGION"])

    def env(self, endpoint=None) -> dict:
        """The variables a client reads to reach this server (the standard ones)."""
        return {**KEYS, **FAST_FAIL, "AWS_ENDPOINT_URL": endpoint or self.endpoint}

    def bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def versioned(self, bucket: str) -> None:
        """Versioning on: a deleted or replaced object stays as a noncurrent version."""
        self.client().put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def read(self, bucket: str, key: str) -> bytes:
        return self.client().get_object(Bucket=bucket, Key=key)["Body"].read()


class Relay:
    """127.0.0.1:<port> relayed to the server; `cut()` refuses new connections and drops the
    open ones (the store stopped), `restore()` listens again on the same port; `stall()`
    answers nothing; `deaf(n)` stops reading what a connection sends past its first n bytes."""

    def __init__(self, target_port: int):
        self.target = target_port
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = None
        self._stalled = threading.Event()
        self._deaf_after: Optional[int] = None
        self.restore()

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:   # the server closed: the client sees its connection dropped
                client.close()
                continue
            with self._lock:
                self._conns += [client, server]
            threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()

    def _pipe(self, a, b) -> None:
        sent = 0   # by the client (a) on this connection
        try:
            while True:
                limit = self._deaf_after
                ready, _, _ = select.select([b] if limit is not None and sent >= limit else [a, b], [], [], 1.0)
                for s in ready:
                    data = s.recv(65536 if s is b or limit is None else min(65536, max(1, limit - sent)))
                    if not data:
                        return
                    sent += len(data) if s is a else 0
                    if not self._stalled.is_set():
                        (b if s is a else a).sendall(data)
        except (OSError, ValueError):   # ValueError: a socket `cut` closed meanwhile (its fd -1)
            return
        finally:
            for s in (a, b):
                try:
                    s.close()
                except OSError:
                    pass

    def stall(self, on: bool = True) -> None:
        """Connections accepted and held, what comes in read and dropped, nothing answered (a
        store that stopped answering without closing anything); off again with on=False."""
        (self._stalled.set if on else self._stalled.clear)()

    def deaf(self, after: Optional[int]) -> None:
        """Each connection's bytes past its first `after` left unread, the connection open (a
        store that stopped reading a body: once the buffers fill, the client's send waits on a
        shut window); None reads everything again (on new connections)."""
        self._deaf_after = after

    def cut(self) -> None:
        try:   # wakes the accepting thread: a close alone leaves it listening until one more connection
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass


# the variables through which the stores' clients find their credentials and endpoints
STORE_VARIABLES = ("AWS_", "GOOGLE_", "STORAGE_EMULATOR_HOST")


def set_env(monkeypatch, env: dict) -> None:
    """This process's store variables (AWS_*, GOOGLE_*, STORAGE_EMULATOR_HOST): env's, and no
    other (a profile or endpoint of the machine's own must not reach the test server's clients)."""
    for k in [k for k in os.environ if k.startswith(STORE_VARIABLES)]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def child_env(env: dict) -> dict:
    """A child process's environment: this one's, its store variables replaced by env's."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(STORE_VARIABLES)}, **env}
