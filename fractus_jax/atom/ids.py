"""The Atom alphabet (docs/spec.md §5): the special ids and sizes, named once.

Ids 0-255 are the raw bytes of UTF-8 text; 256-265 are the special ids below.
Every other module (the engine's config and model included) imports these names rather
than writing the numbers; this module imports nothing, so the engine can import it
without loading the encoder.
"""
from __future__ import annotations

VOCAB = 266  # V: ids 0..265; anything else is refused

PAD = 256  # never in a stream
BOS = 257
EOS = 258

# Boundary ids: each packet is its payload bytes followed by one of these.
B_WHITESPACE = 259
B_PUNCT = 260
B_NEWLINE = 261
B_TRANSITION = 262  # letter <-> digit
B_MAXSPAN = 263  # the span reached MAX_SPAN bytes
B_FLUSH = 264  # end-of-stream flush of a closed encode
B_GENERATED = 265  # emitted by a generator, never by the encoder

BOUNDARY_FIRST = B_WHITESPACE
BOUNDARY_LAST = B_GENERATED
BOUNDARIES = tuple(range(BOUNDARY_FIRST, BOUNDARY_LAST + 1))
N_BOUNDARIES = len(BOUNDARIES)  # 7

MAX_SPAN = 32  # bytes of payload in one packet, at most

FEAT_DIM = 320  # the packet features' width (fractus_jax.atom.features; the engine's atom_feat_dim)

NAMES = {
    PAD: "PAD",
    BOS: "BOS",
    EOS: "EOS",
    B_WHITESPACE: "whitespace",
    B_PUNCT: "punctuation",
    B_NEWLINE: "newline",
    B_TRANSITION: "transition",
    B_MAXSPAN: "max_span",
    B_FLUSH: "flush",
    B_GENERATED: "generated",
}

# Short tags used when rendering a stream for inspection.
TAGS = {
    PAD: "PAD",
    BOS: "BOS",
    EOS: "EOS",
    B_WHITESPACE: "ws",
    B_PUNCT: "pu",
    B_NEWLINE: "nl",
    B_TRANSITION: "tr",
    B_MAXSPAN: "ms",
    B_FLUSH: "fl",
    B_GENERATED: "gen",
}


def is_boundary(i: int) -> bool:
    return BOUNDARY_FIRST <= int(i) <= BOUNDARY_LAST
