"""Encode-speed benchmark on realistic mixed text (code, English and French
prose, markdown, a little CJK / emoji, CRLF and tabs), built deterministically
from the standard library's own sources and docstrings. Single process, so the
number is per core."""
from __future__ import annotations

import json as _json
import random
import sysconfig
import time
from pathlib import Path

import numpy as np

from fractus_jax.atom.stream import encode_batch, encode_bytes

_FRENCH = (
    "Le château se dresse au-dessus de la forêt ; à l'aube, les élèves traversent "
    "le pont et rejoignent l'école où l'on étudie la géométrie, l'histoire et le "
    "français. « Où est passée la clé ? » demande-t-elle, inquiète. Il était déjà "
    "trop tard : la réunion de 2026 avait commencé à 9 h 30 précises.\n",
    "Ça fait longtemps que nous n'avons pas vu une telle récolte ; les pêches, les "
    "abricots et les cerises mûrissent ensemble, et l'été s'annonce généreux. Le "
    "maître d'œuvre a noté 12 457 € de dépenses imprévues.\n",
)
_MISC = (
    "## Notes\r\n\r\n- item\tvalue\t42\r\n- ünïcödé ✓ — “quotes” 😀🚀\r\n",
    "中文文本测试：这是一个句子，包含标点。日本語のテキストも少し。한국어 문장.\n",
    "| col | 1234 | x86_64 | 0xDEADBEEF |\n|-----|------|--------|------------|\n",
)


def sample_text(mb: float, seed: int = 0) -> bytes:
    """About ``mb`` MB of mixed text, the same for a given seed on one Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    code = [p.read_bytes() for p in sorted(root.glob("*.py"))[:120]]
    try:
        from pydoc_data.topics import topics
        prose = [t.encode() for _, t in sorted(topics.items())]
    except ImportError:  # pragma: no cover - stripped installs
        prose = [d.encode() for d in (_FRENCH * 20)]
    french = [t.encode() for t in _FRENCH]
    misc = [t.encode() for t in _MISC]
    rng = random.Random(seed)
    target, parts, size = int(mb * 1e6), [], 0
    while size < target:
        pool = rng.choices([code, prose, french, misc], weights=[45, 40, 10, 5])[0]
        piece = rng.choice(pool)
        if len(piece) > 20000:
            start = rng.randrange(len(piece) - 20000)
            piece = piece[start:start + 20000]
        parts.append(piece)
        size += len(piece)
    return b"".join(parts)[:target]


def bench_encode(mb: float = 16.0, json: bool = False, repeat: int = 3, doc_kb: int = 16,
                 seed: int = 0) -> dict:
    """Encode ``mb`` MB of mixed text; report MB/s (best of ``repeat``; wall clock,
    and per CPU second, which a busy machine disturbs less) for one bulk call per
    4 MB block and for batches of ``doc_kb``-KB documents.
    ``json``: print the result as JSON (else a readable line). Returns it."""
    data = sample_text(mb, seed)
    n = len(data)
    blocks = [data[i:i + (4 << 20)] for i in range(0, n, 4 << 20)]
    step = doc_kb * 1024
    docs = [data[i:i + step] for i in range(0, n, step)]
    batches = [docs[i:i + 256] for i in range(0, len(docs), 256)]

    def best(fn):  # best wall time and best CPU time of `repeat` runs
        wall, cpu = [], []
        for _ in range(repeat):
            t, c = time.perf_counter(), time.process_time()
            out = fn()
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        return min(wall), max(min(cpu), 1e-9), out

    w_bulk, c_bulk, n_ids = best(lambda: sum(encode_bytes(b, np.uint16).size for b in blocks))
    w_docs, c_docs, _ = best(lambda: sum(encode_batch(b).size for b in batches))
    mb_ = n / 1e6
    result = {
        "mb": mb_, "bulk_mb_s": mb_ / w_bulk, "docs_mb_s": mb_ / w_docs,
        "bulk_cpu_mb_s": mb_ / c_bulk, "docs_cpu_mb_s": mb_ / c_docs,
        "doc_kb": doc_kb, "ids_per_byte": n_ids / n, "repeat": repeat, "processes": 1,
    }
    if json:
        print(_json.dumps(result))
    else:
        print(f"atom encode: {result['bulk_mb_s']:.1f} MB/s bulk, "
              f"{result['docs_mb_s']:.1f} MB/s in {doc_kb} KB documents "
              f"(per CPU second: {result['bulk_cpu_mb_s']:.1f} bulk, "
              f"{result['docs_cpu_mb_s']:.1f} documents) "
              f"({result['mb']:.1f} MB mixed text, {result['ids_per_byte']:.3f} ids/byte, "
              "one core)")
    return result
