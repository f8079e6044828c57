"""The Atom id stream (docs/spec.md §5): worked examples id for id, round trips,
the fast encoder against the spec's literal loop, and the packet features."""
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fractus_jax import atom
from fractus_jax.atom import features, ids as I
from fractus_jax.atom.stream import (
    CLASS, StreamEncoder, iter_chars, reference_encode_bytes, utf8_char_starts,
)

SETTINGS = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def run(text):
    return list(text.encode())


# ---- the spec's worked examples, id for id ------------------------------------

def test_spec_example_bonjour():
    want = ([257] + run("Bonjour,") + [260] + run(" ") + [259] + run("le ") + [259]
            + run("monde ") + [259] + run("2026!") + [260] + run("\n") + [261] + [258])
    assert atom.encode("Bonjour, le monde 2026!\n").tolist() == want


def test_spec_example_transitions():
    want = [257] + run("abc") + [262] + run("123") + [262] + run("def") + [264, 258]
    assert atom.encode("abc123def").tolist() == want


def test_spec_example_max_span_keeps_a_character_whole():
    want = [257] + run("a" * 31) + [263] + run("é") + [264, 258]
    assert atom.encode("a" * 31 + "é").tolist() == want


def test_special_ids_are_named_once():
    assert (I.PAD, I.BOS, I.EOS) == (256, 257, 258)
    assert I.BOUNDARIES == tuple(range(259, 266)) and I.VOCAB == 266
    assert (I.B_WHITESPACE, I.B_PUNCT, I.B_NEWLINE, I.B_TRANSITION, I.B_MAXSPAN,
            I.B_FLUSH, I.B_GENERATED) == (259, 260, 261, 262, 263, 264, 265)


@pytest.mark.parametrize("text,want", [
    ("", [257, 258]),
    ("a" * 32, [257] + [97] * 32 + [263, 258]),  # exactly full: max span, no flush
    ("a" * 32 + "1", [257] + [97] * 32 + [263, 49, 264, 258]),  # no transition after
    ("a" * 31 + ",", [257] + [97] * 31 + [44, 260, 258]),  # separator checked first
    ("a" * 32 + ",", [257] + [97] * 32 + [263, 44, 260, 258]),
    ("x\r\n", [257, 120, 13, 259, 10, 261, 258]),
    ("\t1a", [257, 9, 259, 49, 262, 97, 264, 258]),
])
def test_edge_cases(text, want):
    assert atom.encode(text).tolist() == want
    assert reference_encode_bytes(text.encode()) == want


def test_open_form():
    assert atom.encode_open("").tolist() == [257]
    assert atom.encode_open("abc1").tolist() == [257] + run("abc") + [262, 49]
    assert atom.encode_open("hi ").tolist() == [257, 104, 105, 32, 259]
    assert atom.encode_open("a" * 32).tolist() == [257] + [97] * 32 + [263]


# ---- round trips ----------------------------------------------------------------

SAMPLES = {
    "french": "Où est passée la clé ? « Déjà vu », dit-il à l'élève — ça coûte 12,50 €.\n",
    "english": "The quick brown fox jumps over the lazy dog; it's 2026, isn't it?\n",
    "code": "def f(x: int) -> int:\n    return x**2 + 0x1F  # sq\n\nprint(f(3))\n",
    "accents": "ÀÉÎÕÜàéîõüçñøåæœß" * 3,
    "emoji": "hi 😀🚀👩‍👩‍👧 ok✓",
    "crlf": "line one\r\nline two\r\n\r\n",
    "tabs": "a\tb\t\tc\n\t\tindented",
    "empty": "",
    "cjk": "中文文本测试，这是一个句子。" * 5,
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_round_trip_samples(name):
    text = SAMPLES[name]
    ids = atom.encode(text)
    assert atom.decode(ids) == text
    assert atom.decode(atom.encode_open(text)) == text
    assert ids.tolist() == reference_encode_bytes(text.encode())
    assert ids.min() >= 0 and ids.max() <= 265 and I.PAD not in ids.tolist()


def test_bytes_round_trip_invalid_utf8():
    data = b"\xff\xfe ok \xc3 \xed\xa0\x80 \xf4\x90\x80\x80 \xe2\x82 end\x80"
    ids = atom.encode_bytes(data)
    assert atom.decode_bytes(ids) == data
    assert ids.tolist() == reference_encode_bytes(data)


def test_decode_refuses_ids_outside_the_alphabet():
    with pytest.raises(ValueError, match="id 300 at offset 2"):
        atom.decode([257, 97, 300])
    with pytest.raises(ValueError, match="id -1"):
        atom.decode_bytes(np.array([97, -1]))


def test_render_shows_specials():
    assert atom.render(atom.encode("a b")) == "⟨BOS⟩a ⟨ws⟩b⟨fl⟩⟨EOS⟩"


# ---- the fast path against the spec loop ----------------------------------------

def test_every_byte_and_pair_matches_reference():
    rng = np.random.default_rng(0)
    docs = [bytes([b]) for b in range(256)]
    docs += [bytes(p) for p in rng.integers(0, 256, (3000, 2), dtype=np.uint8)]
    docs += [bytes([a, b]) for a in b"aZ09 \n\t,\x80\xc3" for b in b"aZ09 \n\t,\x80\xa9"]
    want = [i for d in docs for i in reference_encode_bytes(d)]
    assert atom.encode_batch(docs).tolist() == want


def test_classes_follow_spec():
    assert CLASS[0x0A] == 0 and all(CLASS[b] == 1 for b in b" \t\r\x0b\x0c")
    assert all(CLASS[b] == 3 for b in b"0123456789")
    assert all(CLASS[b] == 4 for b in list(b"azAZ") + list(range(0x80, 0x100)))
    assert all(CLASS[b] == 2 for b in b"!,.;@[`{~\x00\x7f")


TOKENS = [b"a", b"Z", b"1", b" ", b"\n", b"\t", b",", b"\r", "é".encode(), "中".encode(),
          "😀".encode(), b"\xc3", b"\x80", b"\xff", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
          b"\xe0\x80", b"\xf0\x9f\x98"]
runs = st.lists(st.tuples(st.sampled_from(TOKENS), st.sampled_from([1, 2, 5, 11, 16, 31, 32, 33, 70])),
                max_size=12).map(lambda ps: b"".join(t * k for t, k in ps))


@SETTINGS
@given(st.lists(st.one_of(runs, st.binary(max_size=80)), min_size=1, max_size=4))
def test_fast_encoder_equals_spec_loop(docs):
    want = [i for d in docs for i in reference_encode_bytes(d)]
    assert atom.encode_batch(docs).tolist() == want
    d = docs[0]
    assert atom.encode_open_bytes(d).tolist() == reference_encode_bytes(d, closed=False)
    assert atom.decode_bytes(atom.encode_bytes(d)) == d


@pytest.mark.parametrize("pieces", [
    ["中"],  # one character length: periodic cuts every 30 bytes
    ["中", "é", "a", "😀"],  # mixed lengths: the pointer chain
])
@pytest.mark.parametrize("n", [40, 400, 6000])  # 6000: past 64 spans, by checkpoints
def test_long_runs_match_reference(pieces, n):
    rng = np.random.default_rng(n)
    text = "".join(rng.choice(pieces, n)) + " " + "".join(rng.choice(pieces, n // 3))
    data = text.encode()
    assert atom.encode_bytes(data).tolist() == reference_encode_bytes(data)


def test_utf8_char_starts_agree_with_python():
    rng = np.random.default_rng(1)
    alphabet = np.frombuffer(b"a\x80\xbf\xc2\xc3\xdf\xe0\xe2\xed\xef\xf0\xf4\xf5\xa0\x9f\x90\x8f",
                             np.uint8)
    for _ in range(50):
        data = bytes(rng.choice(alphabet, 60))
        want = np.zeros(len(data), bool)
        at = 0
        for ch in iter_chars(data):
            want[at] = True
            at += len(ch)
        got = utf8_char_starts(np.frombuffer(data, np.uint8))
        assert (got == want).all(), data


@SETTINGS
@given(st.lists(st.binary(max_size=40), max_size=6))
def test_stream_encoder_equals_one_call(pieces):
    enc = StreamEncoder()
    got = [enc.feed(p) for p in pieces] + [enc.finish()]
    assert np.concatenate(got).tolist() == atom.encode_bytes(b"".join(pieces)).tolist()


# ---- hypothesis properties on text ---------------------------------------------

texts = st.one_of(st.text(), st.text(alphabet="aZ09 \t\r\n,.é中😀ß"),
                  runs.map(lambda b: b.decode("utf-8", "ignore")))


@SETTINGS
@given(texts)
def test_round_trip_property(text):
    ids = atom.encode(text)
    assert atom.decode(ids, errors="strict") == text
    assert ids[0] == I.BOS and ids[-1] == I.EOS
    assert ids.min() >= 0 and ids.max() <= 265 and not (ids == I.PAD).any()
    assert not ((ids == I.BOS).sum() > 1 or (ids == I.EOS).sum() > 1 or (ids == 265).any())


@SETTINGS
@given(texts, texts)
def test_prefix_alignment(prefix, cont):
    p = atom.encode_open(prefix).tolist()
    assert atom.encode(prefix + cont).tolist()[:len(p)] == p


@SETTINGS
@given(texts)
def test_max_span_never_splits_a_character(text):
    ids = atom.encode(text)
    payload = []
    for i in ids.tolist():
        if i < 256:
            payload.append(i)
        elif I.is_boundary(i):
            assert 1 <= len(payload) <= I.MAX_SPAN
            bytes(payload).decode("utf-8")  # a whole number of characters
            payload = []
    assert payload == []  # a closed stream leaves no bytes after the last boundary


# ---- packet features -------------------------------------------------------------

def test_packet_fields_of_a_short_string_are_the_documented_values():
    """Length, byte classes, previous kinds, previous lengths, position and flags of the five
    packets of one string, written out by hand from docs/atom.md's layout."""
    ids = atom.encode("Hi WORLD, été 42")
    pos, f = features.packet_features(ids)
    assert [int(ids[p]) for p in pos] == [259, 260, 259, 259, 264]
    # payload bytes: "Hi ", "WORLD,", " ", "été " (c3 a9 74 c3 a9 20), "42"; lengths / 32
    np.testing.assert_allclose(f[:, features.F_LEN], [3 / 32, 6 / 32, 1 / 32, 6 / 32, 2 / 32])
    # fractions by class: newline, whitespace, punctuation, digit, upper, lower, UTF-8 lead, continuation
    np.testing.assert_allclose(f[:, features.F_CLASSES:features.F_CLASSES + 8], [
        [0, 1 / 3, 0, 0, 1 / 3, 1 / 3, 0, 0],
        [0, 0, 1 / 6, 0, 5 / 6, 0, 0, 0],
        [0, 1, 0, 0, 0, 0, 0, 0],
        [0, 1 / 6, 0, 0, 0, 1 / 6, 2 / 6, 2 / 6],
        [0, 0, 0, 1, 0, 0, 0, 0]], rtol=1e-6)
    # the kinds of the 4 previous packets (one-hot of 7 each, nearest first; none before the first)
    prev = f[:, features.F_PREV_KIND:features.F_PREV_KIND + 28].reshape(5, 4, 7)
    want = np.zeros((5, 4, 7))
    for packet, kinds in enumerate([[], [0], [1, 0], [0, 1, 0], [0, 0, 1, 0]]):
        for h, kind in enumerate(kinds):
            want[packet, h, kind] = 1.0
    np.testing.assert_array_equal(prev, want)
    np.testing.assert_allclose(f[:, features.F_PREV_LEN:features.F_PREV_LEN + 4], [
        [0, 0, 0, 0], [3 / 32, 0, 0, 0], [6 / 32, 3 / 32, 0, 0], [1 / 32, 6 / 32, 3 / 32, 0],
        [6 / 32, 1 / 32, 6 / 32, 3 / 32]])
    # the packet's index n in its document: sin and cos of 2πn/p for p = 8, 64, 512, 4096
    for n in range(5):
        angles = [2 * math.pi * n / p for p in (8, 64, 512, 4096)]
        want_pos = [v for a in angles for v in (math.sin(a), math.cos(a))]
        np.testing.assert_allclose(f[n, features.F_POSITION:features.F_POSITION + 8], want_pos, atol=1e-6)
    # flags: the first byte's class (newline, whitespace, punctuation, digit, letter), capitalised,
    # all caps (2+ upper, no lower), any byte >= 0x80
    np.testing.assert_array_equal(f[:, features.F_FLAGS:features.F_FLAGS + 8], [
        [0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 1, 0],
        [0, 1, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 1, 0, 0, 1],
        [0, 0, 0, 1, 0, 0, 0, 0]])


def test_features_aligned_bounded_deterministic():
    rows = np.stack([atom.encode("Hello, World 2026!\nÇa va? " * 3)[:60],
                     atom.encode("x = f(a1, b2)  # OK\n" * 4)[:60]])
    f = atom.atom_features(rows)
    assert f.shape == (2, 60, features.FEAT_DIM) and f.dtype == np.float32
    isb = (rows >= 259) & (rows <= 265)
    assert (np.abs(f[~isb]).sum() == 0)
    assert (np.abs(f[isb]).sum(-1) > 0).all()
    assert np.abs(f).max() <= 1.0 and np.isfinite(f).all()
    assert np.array_equal(f, atom.atom_features(rows.copy()))
    kind = f[isb][:, features.F_KIND:features.F_KIND + 7].argmax(1)
    assert (kind == rows[isb] - 259).all()
    # rows are independent: row 1 starts mid-document (no BOS to reset the
    # context), so only the row split keeps row 0's packets out of its features
    r = np.stack([rows[0], atom.encode("x = f(a1, b2)  # OK\n" * 4)[1:61]])
    r2 = r.copy()
    r2[0] = atom.encode("Something else entirely; 42 TIMES.\n" * 3)[1:61]
    f1, f2 = atom.atom_features(r), atom.atom_features(r2)
    assert not np.array_equal(f1[0], f2[0])  # row 0's change shows in row 0...
    assert np.array_equal(f1[1], f2[1])  # ...and not in row 1
    assert np.array_equal(f1[1], atom.atom_features(r[1]))


def test_features_of_a_batch_are_each_rows_own():
    """atom_features reads all rows in one pass: each row's features equal packet_features of
    that row alone (its left ids first), bit for bit, whatever the other rows hold (documents
    starting and ending inside rows, rows that start mid-packet, a packet cut by the row's
    start)."""
    ids = atom.encode("def f(x):\n    return x * 2  # twice\n" * 12 + "Ünïcode, ÇA VA? 12 34.\n" * 8)
    ids = np.concatenate([ids, atom.encode("second document: short.")])
    rows = np.stack([ids[s:s + 48] for s in range(0, 16 * 37, 37)])
    left = np.stack([ids[max(s - 9, 0):max(s - 9, 0) + 9] for s in range(0, 16 * 37, 37)])
    assert ((rows == atom.BOS).any(1)).any() and ((rows >= 259) & (rows <= 265)).sum() > 100
    for lf in (None, left):
        got = atom.atom_features(rows, left=lf)
        for r in range(rows.shape[0]):
            seq = rows[r] if lf is None else np.concatenate([lf[r], rows[r]])
            off = 0 if lf is None else lf.shape[1]
            pos, f = features.packet_features(seq)
            want = np.zeros((rows.shape[1], features.FEAT_DIM), np.float32)
            want[pos[pos >= off] - off] = f[pos >= off]
            np.testing.assert_array_equal(got[r], want)


def test_features_context_and_document_reset():
    a = atom.encode("alpha beta gamma delta ")
    b = atom.encode("omega psi chi phi ")
    pos, fa = features.packet_features(a)
    ctx = slice(features.F_CONTEXT, features.F_CONTEXT + features.SKETCH)
    assert np.abs(fa[0, ctx]).sum() == 0  # the first packet has no context
    assert np.abs(fa[1, ctx]).sum() > 0
    pos2, fab = features.packet_features(np.concatenate([a, b]))
    # after BOS the second document starts afresh: same features as alone
    _, fb = features.packet_features(b)
    assert np.allclose(fab[len(pos):], fb)
    # left context reaches the first packet's sketch but gets no features itself
    left = a[None, :5]
    fl = atom.atom_features(a[None, 5:], left=left)
    assert fl.shape == (1, a.size - 5, features.FEAT_DIM)
    full = atom.atom_features(a[None])
    assert np.allclose(fl[0], full[0, 5:])


def test_features_sketch_distinguishes_packets():
    _, f = features.packet_features(atom.encode("cat dog cat "))
    sk = slice(features.F_SKETCH, features.F_SKETCH + features.SKETCH)
    assert np.allclose(f[0, sk], f[2, sk]) and not np.allclose(f[0, sk], f[1, sk])
    assert np.allclose(np.linalg.norm(f[:, sk], axis=1), 1.0)


def test_large_input_is_encoded_in_blocks(monkeypatch):
    from fractus_jax.atom import stream
    text = ("Un texte long, écrit 12345 fois; " * 40 + "x" * 70 + "中" * 50 + "\n") * 3
    want = stream.encode(text).tolist()
    monkeypatch.setattr(stream, "BIG", 100)
    monkeypatch.setattr(stream, "BLOCK", 37)
    assert stream.encode(text).tolist() == want == reference_encode_bytes(text.encode())
