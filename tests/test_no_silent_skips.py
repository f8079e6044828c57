"""conftest's guards against skips that hide a broken setup: a preset XLA_FLAGS keeps its
flags and gains the 8 fake devices; a `devices(8)` test fails on a CPU with fewer; a failing
import of this project's own code fails, while a missing third-party module still skips.
Each case runs in a pytest subprocess with tests/conftest.py as its plugin."""
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

PROBES = {
    "test_imports.py": '''
import pytest

def test_a_project_import():
    pytest.importorskip("fractus_jax.no_such_module")

def test_a_third_party_import():
    pytest.importorskip("no_such_third_party_module")
''',
    "test_module_import.py": '''
import pytest
pytest.importorskip("fractus_jax.no_such_module")

def test_never_collected():
    pass
''',
    "test_devices.py": '''
import os
import jax
import pytest

@pytest.mark.devices(8)
def test_eight_devices():
    assert jax.device_count() == 8
    print("XLA_FLAGS=" + os.environ["XLA_FLAGS"])
''',
}


def _pytest(tmp_path, xla_flags, *files):
    for name, text in PROBES.items():
        (tmp_path / name).write_text(text)
    env = {**os.environ, "XLA_FLAGS": xla_flags,
           "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-c", os.devnull, "--rootdir",
                          str(tmp_path), "-p", "no:cacheprovider", "-rA", "-s", "--continue-on-collection-errors",
                          *files], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return out.stdout + out.stderr


def test_a_preset_xla_flags_keeps_its_flags_and_gains_the_fake_devices(tmp_path):
    out = _pytest(tmp_path, "--xla_backend_optimization_level=0", "test_devices.py")
    assert "PASSED test_devices.py::test_eight_devices" in out, out
    line = next(x for x in out.splitlines() if "XLA_FLAGS=" in x)
    flags = line.split("XLA_FLAGS=", 1)[1].split()
    # the preset flag first and unchanged (conftest's own -O0 not added beside it), the fake devices last
    assert flags[0] == "--xla_backend_optimization_level=0" and flags[-1] == "--xla_force_host_platform_device_count=8", flags
    assert sum(f.startswith("--xla_backend_optimization_level") for f in flags) == 1, flags


def test_missing_devices_and_the_project_s_failing_imports_fail_loudly(tmp_path):
    out = _pytest(tmp_path, "--xla_force_host_platform_device_count=2", *PROBES)
    assert "ERROR test_devices.py::test_eight_devices" in out, out
    assert "this test needs 8 devices and JAX has 2 CPU devices" in out, out
    assert "FAILED test_imports.py::test_a_project_import" in out, out
    assert "ERROR test_module_import.py" in out, out
    assert "could not import 'fractus_jax.no_such_module'" in out, out
    assert "SKIPPED [1] test_imports.py" in out and "no_such_third_party_module" in out, out
    assert "SKIPPED" not in out.replace("SKIPPED [1] test_imports.py", ""), out   # that one skip only
