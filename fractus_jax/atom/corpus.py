"""The corpus API the trainer uses (one import for reading and building).

Reading lives in ``reader.py``, building in ``build.py``; this module only
gathers their public names.
"""
from fractus_jax.atom.build import (
    build_corpus, build_default_corpus, build_shards, default_sources, encode_source, expand_sources,
)
from fractus_jax.atom.reader import (
    FORMAT, FORMAT_VERSION, SUFFIXES, Corpus, CorpusError, JoinedIds, ShardedCorpus, index_path,
    is_shard_set, open_corpus, read_index,
)

__all__ = [
    "Corpus", "CorpusError", "FORMAT", "FORMAT_VERSION", "JoinedIds", "SUFFIXES", "ShardedCorpus",
    "build_corpus", "build_shards", "build_default_corpus", "default_sources", "encode_source", "expand_sources",
    "index_path", "is_shard_set", "open_corpus", "read_index",
]
