"""The host's memory allocator, as it bears on a step's speed on a CPU.

XLA:CPU allocates a compiled program's temporary buffer (265 MB for the bench_small train
step) anew at every execution and frees it after. glibc's malloc serves a block that large
with a fresh mmap and unmaps it on free, so every step first-touches every page again: 65k
page faults per bench_small step, each a kernel trap that zeroes 4 KiB. An allocator that
keeps freed memory (tcmalloc) serves the same pages again: ~0 faults, and the bench_small
step ran 1.2-1.5x faster in the runs of docs/performance.md. The allocator is the
process's, chosen when it starts (LD_PRELOAD), so this module only detects and advises:
`scripts/with_tcmalloc CMD...` runs a command with it. Without tcmalloc, glibc itself can
back its large blocks with 2 MiB transparent huge pages when the process starts with
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (glibc >= 2.35, the kernel's THP mode `madvise` or
`always`): ~200 faults per step instead of 65k, the pages still zeroed; 1.15-1.38x faster
steps than plain glibc in the runs of docs/performance.md, tcmalloc 1.34-1.49x in the same runs.
"""
from __future__ import annotations

import ctypes.util
import os
import re
import resource

_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


def allocator() -> str:
    """The malloc this process runs on: 'tcmalloc', 'jemalloc' or 'mimalloc' when one of them
    is mapped into it (preloaded or linked), else 'glibc' on Linux, 'unknown' elsewhere."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "unknown"
    return next((name for name in _ALLOCATORS if name in maps), "glibc")


def find_tcmalloc() -> str | None:
    """The soname of a tcmalloc library the dynamic linker knows (its `ldconfig -p` cache,
    where scripts/with_tcmalloc looks too), or None."""
    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def minor_faults() -> int:
    """Minor page faults of this process so far (pages first touched, not read from disk)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


HUGETLB_TUNABLE = "glibc.malloc.hugetlb=1"
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = _THP_ENABLED) -> str | None:
    """The kernel's transparent huge page mode ('always', 'madvise' or 'never'), None if unknown."""
    try:
        with open(path) as f:
            m = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return None
    return m.group(1) if m else None


def hugetlb_tunable() -> bool:
    """Whether this process was started with glibc's malloc asked for huge pages."""
    return re.search(r"(^|:)glibc\.malloc\.hugetlb=[12](:|$)", os.environ.get("GLIBC_TUNABLES", "")) is not None


def _how() -> str:
    lib = find_tcmalloc()
    how = (f"run it as `scripts/with_tcmalloc python -m ...` (LD_PRELOAD={lib})" if lib else
           "install tcmalloc (Debian/Ubuntu: apt-get install libtcmalloc-minimal4) and run it as "
           "`scripts/with_tcmalloc python -m ...`")
    if not hugetlb_tunable() and thp_mode() in ("always", "madvise"):
        how += (f"; with nothing to install, start it as `GLIBC_TUNABLES={HUGETLB_TUNABLE} python -m ...` "
                "(2 MiB pages: about half of tcmalloc's gain)")
    return how


def advice(faults_per_step: float) -> str | None:
    """One line for a user whose steps spend their time on page faults, or None."""
    if allocator() != "glibc" or faults_per_step < 1000:
        return None
    return (f"note: {faults_per_step:,.0f} page faults per step: glibc's malloc maps the step's "
            f"temporary buffer anew every step; {_how()} (docs/performance.md)")


def cpu_training_note(backend: str) -> str | None:
    """The trainer's one short line at start when it computes on the CPU under glibc's malloc."""
    if backend != "cpu" or allocator() != "glibc":
        return None
    how = ("scripts/with_tcmalloc" if find_tcmalloc() else
           "scripts/with_tcmalloc (after apt-get install libtcmalloc-minimal4)")
    return f"note: glibc's malloc slows CPU steps; {how} ran bench_small's 1.2-1.5x faster (docs/performance.md)"


if __name__ == "__main__":
    print(allocator())   # `python -m fractus_jax.hostmem`: this process's malloc
