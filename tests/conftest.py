"""Test setup: 8 fake CPU devices (for the sharding tests) before JAX initialises, XLA:CPU
code generation at -O0 with the elemental fusion emitters, and a persistent compilation cache
for the test processes and the CLI subprocesses they start, so that each program is compiled
once per machine (the README's two pytest-xdist workers share it).

No silent skips: the device-count flag is added to an XLA_FLAGS already set (one that names
a count of its own keeps it); a test marked `devices(n)` fails on a CPU with fewer devices
(the flag went missing), and skips, saying so, only on another platform; a skip for a
failing import of this project's own code (`pytest.importorskip("fractus_jax...")`) is
reported as a failure."""
import os
import subprocess
import sys
import tempfile

FAKE_DEVICES = 8
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# XLA:CPU's code generation at -O0 and with its older fusion emitters: the tests' programs
# are tiny, and compiling them, not running them, is most of the suite's time. XLA's own
# passes (fusion, layout, sharding) still run; LLVM's optimisation of the machine code is
# skipped, and each fusion is emitted by the elemental emitter, which takes a tiny train
# step's first call (trace, compile, run) from 10.2 s to 6.8 s (README, the test command).
# Results differ from the defaults' by rounding only (another order of float32 sums); every
# comparison in the suite is between programs compiled alike or within a tolerance. A level
# or emitter choice already set is kept.
OPT_LEVEL_FLAG = "--xla_backend_optimization_level"
EMITTER_FLAG = "--xla_cpu_use_fusion_emitters"


def _jaxlib_knows(flag: str) -> bool:
    """XLA aborts the process on a flag it does not know: try it once, in a subprocess."""
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"],
                          env=env, capture_output=True).returncode == 0


_flags = os.environ.get("XLA_FLAGS", "")
_compile_flags = []   # what a subprocess that sets its own device count is given
if OPT_LEVEL_FLAG not in _flags:
    _compile_flags.append(f"{OPT_LEVEL_FLAG}=0")
if EMITTER_FLAG not in _flags and _jaxlib_knows(f"{EMITTER_FLAG}=false"):
    _compile_flags.append(f"{EMITTER_FLAG}=false")
_flags = " ".join([_flags, *_compile_flags]).strip()
if DEVICE_COUNT_FLAG not in _flags:
    _flags = f"{_flags} {DEVICE_COUNT_FLAG}={FAKE_DEVICES}"
os.environ["XLA_FLAGS"] = _flags
# pytest-xdist's workers inherit the controller's environment: they find the flags set and
# neither probe nor add them again.
os.environ.setdefault("FRACTUS_TEST_SUBPROCESS_XLA_FLAGS",
                      " ".join(f for f in _flags.split() if not f.startswith(DEVICE_COUNT_FLAG)))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# gs:// runs are tested against fake-gcs-server (gcs_testing.py), which does not serve the gRPC
# control API that gcsfs asks, at import, whether a bucket is zonal: regular buckets only.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
# A persistent compilation cache, read and written by the test processes (both pytest-xdist
# workers) and the CLI subprocesses they start (they inherit it through the environment): a
# program that several tests compile (the same step, another run directory, another worker)
# is compiled once per machine. Processes share it safely because it has a size limit: JAX
# then takes a file lock around each read and write (jax._src.lru_cache), so no process
# reads an entry half written. The key leaves out the cache's directory (JAX puts it in the
# GPU autotuning options of every key unless that cache is off, and these are CPU programs).
# (Test processes writing into it crashed in jaxlib's serialisation late in full runs before
# _release_compiled_programs below kept each process under the kernel's memory-map limit;
# with it, full runs pass with the cache on.)
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ.setdefault(
    "FRACTUS_TEST_XLA_CACHE", os.path.join(tempfile.gettempdir(), "fractus_jax_test_xla_cache"))
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(64 << 30))
os.environ.setdefault("JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES", "none")
# What is cached: every program of the processes the tests start (a CLI process compiles many
# quick ones, the initialisation, the metrics, the probes: the next process loads them all
# instead), and in the test processes themselves only programs that took 1 s or more to
# compile (they also compile thousands of single operations, quicker to compile than to
# write). A level set by the caller is kept for both.
os.environ.setdefault("FRACTUS_TEST_MIN_COMPILE_SECS", os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402

jax.config.update("jax_persistent_cache_min_compile_time_secs", float(os.environ["FRACTUS_TEST_MIN_COMPILE_SECS"]))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory):
    """936,001 ids of real text and code: this package's 91 Python sources of 2026-12-04, read
    in sorted order and encoded with the Atom encoder, kept in tests/data/corpus.u16.xz. Kept
    rather than rebuilt from today's sources: the tests' data then does not change with the
    code, and neither do the figures that depend on it (a float32 step's distance from
    PyTorch's)."""
    import lzma
    from pathlib import Path

    path = tmp_path_factory.mktemp("corpus") / "small.u16"
    path.write_bytes(lzma.decompress((Path(__file__).parent / "data" / "corpus.u16.xz").read_bytes()))
    return path


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's caches of compiled programs after each test module. Each XLA:CPU
    executable holds a few memory maps of its own; a full run compiles thousands, and a
    process that reached the kernel's map limit (vm.max_map_count) crashed inside XLA's
    compiler instead of failing a test."""
    yield
    jax.clear_caches()


# ----------------------------------------------------------------------------- no silent skips

def pytest_configure(config):
    config.addinivalue_line("markers", "devices(n): needs n devices; on CPU, fewer fails the test "
                                       "(conftest's fake devices went missing)")


def require_devices(n: int) -> None:
    """Fail when this CPU has fewer than n (fake) devices; skip, naming the platform, on another."""
    have, platform = jax.device_count(), jax.default_backend()
    if have >= n:
        return
    if platform == "cpu":
        pytest.fail(f"this test needs {n} devices and JAX has {have} CPU devices: XLA_FLAGS is "
                    f"{os.environ.get('XLA_FLAGS')!r} (conftest adds {DEVICE_COUNT_FLAG}={FAKE_DEVICES} "
                    "unless a count is set already)", pytrace=False)
    pytest.skip(f"needs {n} devices; this {platform} machine has {have}")


def pytest_runtest_setup(item):
    for mark in item.iter_markers("devices"):
        require_devices(*mark.args)


PROJECT_IMPORT_SKIP = "could not import 'fractus_jax"   # pytest.importorskip's reason, for our modules


def _project_import_skip(report) -> bool:
    longrepr = report.longrepr
    return report.skipped and isinstance(longrepr, tuple) and PROJECT_IMPORT_SKIP in str(longrepr[2])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _project_import_skip(report):
        report.outcome = "failed"
        report.longrepr = f"a failing import of the project's own code is a failure, not a skip: {report.longrepr[2]}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if _project_import_skip(report):
        report.outcome = "failed"
        report.longrepr = f"a failing import of the project's own code is a failure, not a skip: {report.longrepr[2]}"


@pytest.fixture(scope="module")
def straight(corpus_file, tmp_path_factory):
    """(cfg to step 6, the directory of tiny trained to step 6 uninterrupted, save_every=2):
    the run a killed or cut one must end equal to (test_kills.py, test_store.py)."""
    from test_faults import tiny, train

    cfg6 = tiny(corpus_file, "max_steps=6")
    d = tmp_path_factory.mktemp("straight") / "straight"
    train(cfg6, d)
    return cfg6, d
