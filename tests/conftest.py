"""Test setup: 8 fake CPU devices (for the sharding tests) before JAX initialises, and a
persistent compilation cache for the CLI subprocesses, so that each of their programs is
compiled once per machine."""
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Subprocesses (CLI tests) inherit these through the environment.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "fractus_jax_test_xla_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")

import jax  # noqa: E402

# The long test process itself neither reads nor writes that cache: serialising a compiled
# CPU executable into it crashed jaxlib 0.10.2 (SIGSEGV or SIGABRT inside
# put_executable_and_time) late in full runs, taking the whole run down. Programs compiled
# here are reused in-process anyway; the short CLI subprocesses keep the cache.
jax.config.update("jax_enable_compilation_cache", False)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory):
    """~60k ids of real text and code (this package's sources), built with the Atom encoder."""
    from pathlib import Path

    import numpy as np

    from fractus_jax.atom import encode

    path = tmp_path_factory.mktemp("corpus") / "small.u16"
    root = Path(__file__).resolve().parents[1] / "fractus_jax"
    texts = [p.read_text() for p in sorted(root.rglob("*.py"))]
    np.concatenate([encode(t) for t in texts]).astype("<u2").tofile(path)
    return path


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's caches of compiled programs after each test module. Each XLA:CPU
    executable holds a few memory maps of its own; a full run compiles thousands, and a
    process that reached the kernel's map limit (vm.max_map_count) crashed inside XLA's
    compiler instead of failing a test."""
    yield
    jax.clear_caches()
