"""Atom: the byte-level id stream of the Fractus engine (docs/spec.md §5).

Ids 0-255 are raw UTF-8 bytes, 256 PAD, 257 BOS, 258 EOS, 259-265 boundaries
closing each packet. ``encode`` / ``encode_open`` / ``decode`` work on text,
``encode_bytes`` / ``decode_bytes`` on arbitrary bytes; ``atom_features`` gives
the 320-d packet features; ``fractus_jax.atom.corpus`` reads and builds corpora.
Command line: ``python -m fractus_jax.atom {build,stats,decode,validate,encode,bench}``.
"""
from fractus_jax.atom.features import atom_features, packet_features
from fractus_jax.atom.ids import (
    B_FLUSH, B_GENERATED, B_MAXSPAN, B_NEWLINE, B_PUNCT, B_TRANSITION, B_WHITESPACE, BOS,
    BOUNDARIES, EOS, FEAT_DIM, MAX_SPAN, NAMES, PAD, VOCAB, is_boundary,
)
from fractus_jax.atom.stream import (
    StreamEncoder, check_ids, decode, decode_bytes, encode, encode_batch, encode_bytes, encode_open,
    encode_open_bytes, render,
)

__all__ = [
    "B_FLUSH", "B_GENERATED", "B_MAXSPAN", "B_NEWLINE", "B_PUNCT", "B_TRANSITION",
    "B_WHITESPACE", "BOS", "BOUNDARIES", "EOS", "FEAT_DIM", "MAX_SPAN", "NAMES", "PAD",
    "VOCAB", "StreamEncoder", "atom_features", "check_ids", "decode", "decode_bytes",
    "encode", "encode_batch", "encode_bytes", "encode_open", "encode_open_bytes",
    "is_boundary", "packet_features", "render",
]
