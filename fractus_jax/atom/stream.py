"""Atom encode / decode (docs/spec.md §5), vectorised with numpy.

The cut rule of the spec is sequential, but it factors into two parts that
vectorise:

* *hard cuts* that depend only on a byte and its neighbour: after every
  whitespace / newline / punctuation byte (those classes are ASCII, so one byte is
  one character), and between a letter and a digit (a class transition). They
  split the stream into *segments*: a run of same-class letters or digits
  followed by at most one separator. Every segment starts with an empty span.
* *max-span cuts* inside a segment's run: greedy packing of whole UTF-8
  characters into spans of at most ``MAX_SPAN`` bytes. Runs of at most 32 bytes
  need no packing; longer runs whose characters all have one length L cut
  every 32 // L * L bytes; other long runs follow a pointer chain over character
  starts (``_chain``). A span that becomes exactly full is closed by the max-span id,
  which then replaces a transition / flush id at the same place.

``reference_encode_bytes`` is the spec's loop written out literally; the tests
check the fast path against it id for id.
"""
from __future__ import annotations

from typing import Iterable, Sequence, Union

import numpy as np

from fractus_jax.atom.ids import (
    B_FLUSH, B_MAXSPAN, B_NEWLINE, B_PUNCT, B_TRANSITION, B_WHITESPACE, BOS, EOS,
    MAX_SPAN, PAD, TAGS, VOCAB,
)

BytesLike = Union[bytes, bytearray, memoryview, np.ndarray]

# Character classes, by a character's first byte.
C_NEWLINE, C_WHITESPACE, C_PUNCT, C_DIGIT, C_LETTER = 0, 1, 2, 3, 4
CLASS = np.full(256, C_PUNCT, np.uint8)
CLASS[0x0A] = C_NEWLINE
CLASS[[0x20, 0x09, 0x0D, 0x0B, 0x0C]] = C_WHITESPACE
CLASS[0x30:0x3A] = C_DIGIT
CLASS[0x41:0x5B] = C_LETTER
CLASS[0x61:0x7B] = C_LETTER
CLASS[0x80:] = C_LETTER
_SEP_ID = {C_NEWLINE: B_NEWLINE, C_WHITESPACE: B_WHITESPACE, C_PUNCT: B_PUNCT}
# Per byte: the boundary id a separator byte closes its span with, else 0.
SEP_BOUNDARY = np.array([_SEP_ID.get(int(c), 0) for c in CLASS], np.uint16)

def _as_u8(data: BytesLike) -> np.ndarray:
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise TypeError(f"expected a uint8 array of bytes, got {data.dtype}")
        return data.reshape(-1)
    return np.frombuffer(memoryview(data).cast("B"), np.uint8)


def utf8_char_starts(g: np.ndarray) -> np.ndarray:
    """Boolean mask: which bytes of ``g`` start a character. A character is one
    valid UTF-8 sequence (as Python's strict decoder: no overlongs, surrogates or
    code points above U+10FFFF), or one byte of anything else."""
    n = g.size
    gp = np.zeros(n + 3, np.uint8)
    gp[:n] = g
    c = (gp & np.uint8(0xC0)) == 0x80  # continuation bytes
    b1, c1, c2, c3 = gp[1:n + 1], c[1:n + 1], c[2:n + 2], c[3:n + 3]
    l2 = (g >= 0xC2) & (g <= 0xDF) & c1
    l3 = (g >= 0xE0) & (g <= 0xEF) & c1 & c2
    l3 &= ((g != 0xE0) | (b1 >= 0xA0)) & ((g != 0xED) | (b1 <= 0x9F))
    l4 = (g >= 0xF0) & (g <= 0xF4) & c1 & c2 & c3
    l4 &= ((g != 0xF0) | (b1 >= 0x90)) & ((g != 0xF4) | (b1 <= 0x8F))
    covered = np.zeros(n + 3, bool)
    l34 = l3 | l4
    covered[1:n + 1] = l2 | l34
    covered[2:n + 2] |= l34
    covered[3:n + 3] |= l4
    return ~covered[:n]


def _chain(f: np.ndarray, first: np.ndarray, is_end: np.ndarray, step: int = 64) -> np.ndarray:
    """All nodes visited by following ``f`` from each node of ``first`` until an end
    node (a fixed point of ``f``); end nodes excluded. Chains of up to ``step``
    nodes are walked directly; longer ones by jumps of ``f^step`` (checkpoints),
    whose gaps are then filled in, all vectorised over the chains."""
    def walk(fn, cur, limit):
        seen = [cur]
        for _ in range(limit):
            cur = fn[cur]
            cur = cur[~is_end[cur]]
            if cur.size == 0:
                break
            seen.append(cur)
        return seen, cur

    seen, cur = walk(f, first, step)
    if cur.size:
        fk = f
        for _ in range(step.bit_length() - 1):  # f^step by squaring
            fk = fk[fk]
        checkpoints, _ = walk(fk, cur, f.size)
        filled, _ = walk(f, np.concatenate(checkpoints), step - 1)
        on = np.zeros(f.size, bool)
        for q in seen + filled:
            on[q] = True
        return np.flatnonzero(on)
    return np.sort(np.concatenate(seen))


def _periodic(s: np.ndarray, r: np.ndarray, width) -> tuple:
    """Runs whose characters all have one length: a cut every ``width`` bytes."""
    width = np.broadcast_to(width, s.shape)
    m = (r - s - 1) // width
    k = np.arange(int(m.sum()), dtype=np.int64) - np.repeat(np.cumsum(m) - m, m) + 1
    return np.repeat(s, m) + np.repeat(width, m) * k, s + width * m


def _maxspan_long_runs(a: np.ndarray, s: np.ndarray, r: np.ndarray) -> tuple:
    """Max-span cuts inside runs ``a[s:r]`` longer than MAX_SPAN. Returns the
    internal cut positions and the start of each run's last span."""
    last = s.copy()
    hi = np.concatenate([a >= 0x80, [False]])  # padded: reduceat wants indices < len
    asc = ~np.logical_or.reduceat(hi, np.stack([s, r], 1).ravel())[::2]
    cuts = []
    if asc.any():  # ASCII runs: a cut every 32 bytes
        c, last[asc] = _periodic(s[asc], r[asc], MAX_SPAN)
        cuts.append(c)
    nz = np.flatnonzero(~asc)
    if nz.size == 0:
        return np.concatenate(cuts), last
    # Runs with multi-byte characters: find the character starts.
    sn, rn = s[nz], r[nz]
    zero = np.zeros(1, np.uint8)  # runs joined with a 0 byte: no sequence crosses it
    g = np.concatenate([x for i in range(nz.size) for x in (a[sn[i]:rn[i]], zero)])
    go = np.concatenate([[0], np.cumsum(rn - sn + 1)[:-1]])  # each run's offset in g
    gstart = utf8_char_starts(g)
    gstart[go[1:] - 1] = False
    gstart[-1] = False
    cg = np.flatnonzero(gstart)
    rs = np.searchsorted(go, cg, "right") - 1  # run of each character start
    cs = cg - go[rs] + sn[rs]
    first = np.searchsorted(rs, np.arange(nz.size))
    clen = np.diff(np.append(cs, 0))
    lastc = np.append(first[1:], cs.size) - 1
    clen[lastc] = rn - cs[lastc]
    lo = np.minimum.reduceat(clen, first)
    uni = lo == np.maximum.reduceat(clen, first)
    if uni.any():  # one character length L: a cut every 32 // L * L bytes
        c, last[nz[uni]] = _periodic(sn[uni], rn[uni], MAX_SPAN // lo[uni] * lo[uni])
        cuts.append(c)
    mix = np.flatnonzero(~uni)
    if mix.size:  # mixed lengths: greedy packing, a pointer chain over character starts
        keep = ~uni[rs]
        sm, rm = sn[mix], rn[mix]
        pos, rid = cs[keep], (np.cumsum(~uni) - 1)[rs[keep]]
        at = np.searchsorted(rid, np.arange(mix.size), "right")  # after each run's chars
        pos = np.insert(pos, at, rm)  # character starts, then the run's end
        rid = np.insert(rid, at, np.arange(mix.size))
        key = pos + rid  # strictly increasing over (run, position)
        end_node = at + np.arange(mix.size)
        f = np.minimum(np.searchsorted(key, key + MAX_SPAN, "right") - 1, end_node[rid])
        is_end = np.zeros(key.size, bool)
        is_end[end_node] = True
        start_node = np.concatenate([[0], end_node[:-1] + 1])
        nodes = _chain(f, start_node, is_end)
        internal = nodes[pos[nodes] > sm[rid[nodes]]]
        ip, ir = pos[internal], rid[internal]
        cuts.append(ip)
        lastm = sm.copy()
        j = np.searchsorted(ir, np.arange(mix.size), "right") - 1  # last cut of each run
        ok = (j >= 0) & (ir[np.maximum(j, 0)] == np.arange(mix.size)) if ir.size else j >= 0
        lastm[ok] = ip[j[ok]]
        last[nz[mix]] = lastm
    return np.concatenate(cuts), last


def _cuts(a: np.ndarray, ne: np.ndarray) -> tuple:
    """Sorted byte offsets where a span closes, and the boundary id there.
    ``ne``: the end offsets of the non-empty documents."""
    n = a.size
    dig = (a - np.uint8(0x30)) < 10
    alnum = dig | ((a | np.uint8(0x20)) - np.uint8(0x61) < 26) | (a >= 0x80)
    cutm = np.empty(n + 1, bool)
    cutm[0] = False
    np.logical_not(alnum, out=cutm[1:])
    cutm[1:n] |= alnum[1:] & alnum[:-1] & (dig[1:] != dig[:-1])  # transitions
    cutm[ne] = True  # a document's end closes its span (and nothing crosses it)
    h = np.flatnonzero(cutm)  # hard cuts: segment ends
    ids = SEP_BOUNDARY[a[h - 1]]
    sep = ids != 0
    ids[~sep] = B_TRANSITION
    k = np.searchsorted(h, ne)
    ids[k[~sep[k]]] = B_FLUSH
    s = np.concatenate([[0], h[:-1]])
    r = h - sep  # end of each segment's letter/digit run
    runlen = r - s
    full = runlen == MAX_SPAN  # the last span is exactly full: max-span closes it
    new = []
    long_ = np.flatnonzero(runlen > MAX_SPAN)
    if long_.size:
        internal, last = _maxspan_long_runs(a, s[long_], r[long_])
        full[long_] = (r[long_] - last) == MAX_SPAN
        new.append(internal)
    ids[full & ~sep] = B_MAXSPAN
    new.append(r[full & sep])
    new = np.sort(np.concatenate(new))
    if new.size:
        at = np.searchsorted(h, new)
        h = np.insert(h, at, new)
        ids = np.insert(ids, at, np.uint16(B_MAXSPAN))
    return h, ids


def _encode_docs(a: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Closed encodings of consecutive documents ``a[ends[i-1]:ends[i]]``,
    concatenated (uint16). ``ends`` is non-decreasing and ends at ``a.size``."""
    n = a.size
    ends = np.asarray(ends, np.int64).reshape(-1)
    starts = np.concatenate([[0], ends[:-1]])
    if n:
        cut, ids = _cuts(a, ends[ends > starts])
    else:
        cut, ids = np.zeros(0, np.int64), np.zeros(0, np.uint16)
    # Output order: a boundary at offset p comes before the byte at p; BOS / EOS of
    # each document (empty ones included) in document order, after the boundary
    # that closes the previous document.
    ncut, ndoc = cut.size, ends.size
    dpos = np.stack([starts, ends], 1).ravel()  # BOS_0, EOS_0, BOS_1, ...
    if ndoc == 1:
        cidx = cut + np.arange(1, ncut + 1)
    else:
        per_doc = np.diff(np.searchsorted(cut, ends, "right"), prepend=0)
        cidx = cut + np.arange(ncut) + np.repeat(2 * np.arange(ndoc) + 1, per_doc)
    didx = dpos + np.arange(2 * ndoc) + np.searchsorted(cut, dpos, "right")
    out = np.empty(n + ncut + 2 * ndoc, np.uint16)
    isbyte = np.ones(out.size, bool)
    isbyte[cidx] = False
    isbyte[didx] = False
    low = np.empty(out.size, np.uint8)
    low[isbyte] = a
    out[...] = low
    out[cidx] = ids
    out[didx[0::2]] = BOS
    out[didx[1::2]] = EOS
    return out


def _to_bytes(text: str) -> bytes:
    if not isinstance(text, str):
        raise TypeError(f"expected str, got {type(text).__name__} (use encode_bytes)")
    return text.encode("utf-8", "surrogateescape")


# Inputs above BIG bytes are encoded BLOCK bytes at a time (StreamEncoder): the
# vectorised pass needs about 20 bytes of scratch memory per input byte.
BIG, BLOCK = 32 << 20, 8 << 20


def encode_bytes(data: BytesLike, dtype=np.int32) -> np.ndarray:
    """Closed encode of raw bytes: ``[BOS] + packets + [EOS]``; exact for any bytes."""
    a = _as_u8(data)
    if a.size > BIG:
        enc = StreamEncoder()
        parts = [enc.feed(a[i:i + BLOCK]) for i in range(0, a.size, BLOCK)]
        return np.concatenate(parts + [enc.finish()]).astype(dtype, copy=False)
    return _encode_docs(a, np.array([a.size])).astype(dtype, copy=False)


def encode_open_bytes(data: BytesLike, dtype=np.int32) -> np.ndarray:
    """Open encode of raw bytes: ``[BOS] + committed packets + tail bytes``.

    Prefix alignment holds when ``data`` ends at a character boundary (always
    the case for the bytes of a ``str``)."""
    ids = encode_bytes(data, dtype)[:-1]  # no EOS
    if ids.size > 1 and ids[-1] == B_FLUSH:  # the unfinished tail: no boundary
        ids = ids[:-1]
    return ids


def encode(text: str, dtype=np.int32) -> np.ndarray:
    """Closed encode (training documents): ``[BOS] + packets + [EOS]``."""
    return encode_bytes(_to_bytes(text), dtype)


def encode_open(text: str, dtype=np.int32) -> np.ndarray:
    """Open encode (prompts): ``[BOS] + committed packets + the tail's bytes``."""
    return encode_open_bytes(_to_bytes(text), dtype)


def encode_batch(docs: Sequence[Union[str, BytesLike]], dtype=np.uint16) -> np.ndarray:
    """Closed encodings of many documents, concatenated, in one vectorised pass
    (equal to ``np.concatenate([encode(d) for d in docs])``, much faster for
    small documents)."""
    parts = [d if isinstance(d, bytes) else _to_bytes(d) if isinstance(d, str)
             else bytes(_as_u8(d)) for d in docs]
    if not parts:
        return np.zeros(0, dtype)
    a = np.frombuffer(b"".join(parts), np.uint8)
    ends = np.cumsum([len(p) for p in parts], dtype=np.int64)
    return _encode_docs(a, ends).astype(dtype, copy=False)


def check_ids(ids, where: str = "ids") -> np.ndarray:
    """``ids`` as a 1-D integer array, or ValueError naming the first id outside 0-265."""
    a = np.asarray(ids).reshape(-1)
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{where}: expected integer ids, got dtype {a.dtype}")
    if a.size and (a.min() < 0 or a.max() >= VOCAB):
        i = int(np.flatnonzero((a < 0) | (a >= VOCAB))[0])
        raise ValueError(f"{where}: id {int(a[i])} at offset {i} is outside the Atom "
                         f"alphabet 0-{VOCAB - 1}")
    return a


def decode_bytes(ids) -> bytes:
    """The payload bytes of ``ids``: every id >= 256 dropped. Exact inverse of
    ``encode_bytes``."""
    a = check_ids(ids)
    return a[a < PAD].astype(np.uint8).tobytes()


def decode(ids, errors: str = "replace") -> str:
    """Text of ``ids``: ids >= 256 dropped, the rest UTF-8-decoded.
    ``decode(encode(t)) == t`` for every str (with ``errors="surrogateescape"``
    also for strs that came from undecodable bytes)."""
    return decode_bytes(ids).decode("utf-8", errors)


class StreamEncoder:
    """Closed encode of one document given in pieces (for files too large to hold
    twice in memory). ``feed`` returns the ids committed so far; ``finish`` the
    rest. The concatenation equals ``encode_bytes`` of the joined pieces: input is
    cut only right after a separator byte, where the span is always empty."""

    def __init__(self):
        self._carry = b""
        self._started = False

    def feed(self, data: BytesLike) -> np.ndarray:
        buf = self._carry + bytes(_as_u8(data))
        a = np.frombuffer(buf, np.uint8)
        seps = np.flatnonzero(SEP_BOUNDARY[a[-65536:]]) if a.size else []
        if len(seps) == 0:
            seps = np.flatnonzero(SEP_BOUNDARY[a])
            if seps.size == 0:
                self._carry = buf
                return np.zeros(0, np.uint16)
            cut = int(seps[-1]) + 1
        else:
            cut = a.size - min(a.size, 65536) + int(seps[-1]) + 1
        self._carry = buf[cut:]
        ids = _encode_docs(a[:cut], np.array([cut]))[:-1]
        if self._started:
            ids = ids[1:]
        self._started = True
        return ids

    def finish(self) -> np.ndarray:
        ids = _encode_docs(np.frombuffer(self._carry, np.uint8), np.array([len(self._carry)]))
        self._carry = b""
        return ids[1:] if self._started else ids


def iter_chars(data: bytes) -> Iterable[bytes]:
    """Characters of ``data`` by Python's own strict UTF-8 decoder (an oracle
    independent of ``utf8_char_starts``)."""
    i, n = 0, len(data)
    while i < n:
        size = 1
        if data[i] >= 0x80:
            for k in (2, 3, 4):
                try:
                    if len(data[i:i + k].decode("utf-8")) == 1:
                        size = k
                        break
                except UnicodeDecodeError:
                    pass
        yield data[i:i + size]
        i += size


def reference_encode_bytes(data: bytes, closed: bool = True) -> list:
    """The docs/spec.md §5 cut loop, literally (slow; the tests' oracle)."""
    out, span = [BOS], b""

    def close(boundary):
        nonlocal span
        out.extend(span)
        out.append(boundary)
        span = b""

    def cls(byte):
        return int(CLASS[byte])

    for ch in iter_chars(bytes(data)):
        c = cls(ch[0])
        alnum = (C_DIGIT, C_LETTER)
        if span and c in alnum and cls(span[-1]) in alnum and c != cls(span[-1]):
            close(B_TRANSITION)
        if len(span) + len(ch) > MAX_SPAN:
            close(B_MAXSPAN)
        span += ch
        if c in _SEP_ID:
            close(_SEP_ID[c])
        elif len(span) == MAX_SPAN:
            close(B_MAXSPAN)
    if closed:
        if span:
            close(B_FLUSH)
        out.append(EOS)
    else:
        out.extend(span)
    return out


def render(ids, errors: str = "replace") -> str:
    """``ids`` as text with every special id shown inline as a tag (``⟨BOS⟩``,
    ``⟨ws⟩``, ``⟨pu⟩``, ``⟨nl⟩``, ``⟨tr⟩``, ``⟨ms⟩``, ``⟨fl⟩``, ``⟨gen⟩``, ``⟨EOS⟩``),
    for inspection."""
    a = check_ids(ids)
    special = np.flatnonzero(a >= PAD)
    parts, prev = [], 0
    for i in special:
        parts.append(a[prev:i].astype(np.uint8).tobytes().decode("utf-8", errors))
        parts.append(f"⟨{TAGS[int(a[i])]}⟩")
        prev = i + 1
    parts.append(a[prev:].astype(np.uint8).tobytes().decode("utf-8", errors))
    return "".join(parts)
