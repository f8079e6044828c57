"""The host allocator's detection and advice (fractus_jax/hostmem.py, scripts/with_tcmalloc).

What tcmalloc does to a step's speed is measured by `bench train`, not asserted here."""
import os
import pathlib
import subprocess
import sys

import pytest

from fractus_jax import hostmem

ROOT = pathlib.Path(__file__).resolve().parents[1]
TCMALLOC = hostmem.find_tcmalloc()
needs_tcmalloc = pytest.mark.skipif(TCMALLOC is None, reason="no tcmalloc on this machine")


def _allocator_of(cmd_prefix=(), env=None):
    out = subprocess.run([*cmd_prefix, sys.executable, "-m", "fractus_jax.hostmem"], env=env,
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return out.stdout.strip()


@pytest.mark.skipif(hostmem.allocator() != "glibc", reason="another malloc may reuse pages")
def test_minor_faults_count_pages_touched_for_the_first_time():
    before = hostmem.minor_faults()
    # 64 MiB, zero-filled: 16,384 pages of 4 KiB, freshly mapped (glibc maps every block
    # over 32 MiB; smaller ones may reuse freed heap pages once its threshold has risen).
    # A bytearray, not numpy, which asks the kernel for 2 MiB pages on large arrays.
    block = bytearray(64 * 2**20)
    after = hostmem.minor_faults()
    assert len(block) == 64 * 2**20
    assert after - before >= 10_000


def test_a_plain_process_runs_on_glibc_and_is_advised_only_when_it_faults():
    """Checked in a process of its own without LD_PRELOAD, so it runs on glibc whatever
    malloc this test process has."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    assert _allocator_of(env=env) == "glibc"
    check = ("from fractus_jax import hostmem\n"
             "assert hostmem.allocator() == 'glibc'\n"
             "assert hostmem.advice(10) is None\n"
             "note = hostmem.advice(65_000)\n"
             "assert '65,000 page faults per step' in note and 'with_tcmalloc' in note, note\n"
             "assert 'with_tcmalloc' in hostmem.cpu_training_note('cpu')\n"
             "assert hostmem.cpu_training_note('gpu') is None\n")
    r = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


@needs_tcmalloc
def test_with_tcmalloc_preloads_it():
    assert _allocator_of([str(ROOT / "scripts" / "with_tcmalloc")]) == "tcmalloc"
    env = {**os.environ, "LD_PRELOAD": TCMALLOC}
    assert _allocator_of(env=env) == "tcmalloc"


def test_with_tcmalloc_without_a_command_is_a_usage_error():
    r = subprocess.run([str(ROOT / "scripts" / "with_tcmalloc")], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr


def test_with_tcmalloc_without_the_library_runs_nothing_and_says_how_to_install(tmp_path):
    # A PATH with bash and awk but no ldconfig: no library can be found.
    import shutil
    for tool in ("bash", "awk"):
        (tmp_path / tool).symlink_to(shutil.which(tool))
    marker = tmp_path / "ran"
    r = subprocess.run([str(ROOT / "scripts" / "with_tcmalloc"), "touch", str(marker)],
                       env={"PATH": str(tmp_path)}, capture_output=True, text=True)
    assert r.returncode == 3 and "apt-get install libtcmalloc-minimal4" in r.stderr
    assert not marker.exists()


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert hostmem.thp_mode(str(f)) == "madvise"
    f.write_text("always madvise [never]\n")
    assert hostmem.thp_mode(str(f)) == "never"
    assert hostmem.thp_mode(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("tunables, on", [
    ("", False), ("glibc.malloc.hugetlb=1", True), ("glibc.malloc.arena_max=2:glibc.malloc.hugetlb=2", True),
    ("glibc.malloc.hugetlb=0", False), ("glibc.malloc.hugetlb=10", False),
])
def test_hugetlb_tunable_is_read_from_the_environment(monkeypatch, tunables, on):
    monkeypatch.setenv("GLIBC_TUNABLES", tunables)
    assert hostmem.hugetlb_tunable() is on


def test_advice_offers_glibc_huge_pages_only_where_they_can_help(monkeypatch):
    monkeypatch.setattr(hostmem, "allocator", lambda: "glibc")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    for mode, offered in (("madvise", True), ("always", True), ("never", False), (None, False)):
        monkeypatch.setattr(hostmem, "thp_mode", lambda mode=mode: mode)
        note = hostmem.advice(65_000)
        assert "with_tcmalloc" in note
        assert (hostmem.HUGETLB_TUNABLE in note) is offered, mode
    # already started with it: tcmalloc is still offered, the tunable no longer
    monkeypatch.setattr(hostmem, "thp_mode", lambda: "madvise")
    monkeypatch.setenv("GLIBC_TUNABLES", hostmem.HUGETLB_TUNABLE)
    note = hostmem.cpu_training_note("cpu")
    assert "with_tcmalloc" in note and "GLIBC_TUNABLES" not in note
