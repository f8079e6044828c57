"""``python -m fractus_jax.atom {build,stats,decode,validate,encode,bench}``: a thin
command line over importable functions. Errors a user can cause print
``error: <message>`` and exit 2, without a traceback (as every command here)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fractus_jax.atom import build, corpus, stream
from fractus_jax.atom.bench import bench_encode
from fractus_jax.atom.reader import CorpusError
from fractus_jax.urls import local_path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fractus_jax.atom",
                                description="The Atom id stream: corpora and inspection.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="encode text files into a corpus (incremental)")
    b.add_argument("--src", nargs="+", required=True, metavar="PATH", type=local_path,
                   help="files or directories: .txt .md .py .jsonl, or those .gz")
    b.add_argument("--out", required=True, metavar="FILE_OR_DIR", type=local_path,
                   help="the corpus: a file (.u16 or .i16), or a directory of shards (a path without "
                        "that suffix: new sources become new shards after its last one)")
    b.add_argument("--shard-mb", type=float, default=build.SHARD_BYTES / 2**20, metavar="MB",
                   help="source text per shard, for a directory (default %(default)g)")
    b.add_argument("--field", default="text", help="the text field of .jsonl records")
    b.add_argument("--force", action="store_true", help="rebuild from scratch")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    s = sub.add_parser("stats", help="boundary histogram, documents, bytes per id")
    s.add_argument("file", type=local_path, help="a corpus file, or shards: a directory, a glob or a .list file")
    s.add_argument("--json", action="store_true")
    d = sub.add_parser("decode", help="show ids of a corpus as text")
    d.add_argument("file", type=local_path)
    d.add_argument("--offset", type=int, default=0)
    d.add_argument("--count", type=int, default=512)
    d.add_argument("--markers", action="store_true", help="show special ids inline")
    d.add_argument("--ids", action="store_true", help="print the raw ids")
    v = sub.add_parser("validate", help="check every id is in 0-265")
    v.add_argument("file", type=local_path, help="a corpus file, or shards: a directory, a glob or a .list file")
    e = sub.add_parser("encode", help="encode a text argument, print the ids")
    e.add_argument("text")
    e.add_argument("--open", action="store_true", help="the open (prompt) form")
    n = sub.add_parser("bench", help="encode speed on mixed text (MB/s, one core)")
    n.add_argument("--mb", type=float, default=16.0)
    n.add_argument("--json", action="store_true")
    return p


def run(args) -> int:
    if args.cmd == "build":
        if Path(args.out).suffix.lower() in build.OUT_SUFFIXES:
            corpus.build_corpus(args.src, args.out, field=args.field, force=args.force,
                                progress=not args.quiet)
        else:
            if args.force:
                raise CorpusError(f"{args.out}: --force rebuilds a file; for a directory of shards, "
                                  "build into a new directory")
            corpus.build_shards(args.src, args.out, field=args.field, shard_bytes=int(args.shard_mb * 2**20),
                                progress=not args.quiet)
    elif args.cmd == "stats":
        st = corpus.open_corpus(args.file).stats()
        if args.json:
            print(json.dumps(st, indent=1))
        else:
            shards = f" in {st['shards']} shards" if "shards" in st else ""
            print(f"{st['path']}: {st['n_ids']} ids{shards}, {st['n_docs']} documents, "
                  f"{st['n_text_bytes']} text bytes, {st['bytes_per_id']:.3f} bytes/id, "
                  f"{st['bytes_per_packet']:.2f} bytes/packet")
            for name, count in st["boundaries"].items():
                share = count / st["packets"] if st["packets"] else 0.0
                print(f"  {name:12s} {count:12d}  {100 * share:5.1f}%")
    elif args.cmd == "decode":
        ids = corpus.open_corpus(args.file).read(args.offset, args.count)
        if args.ids:
            print(" ".join(map(str, ids.tolist())))
        else:
            print(stream.render(ids) if args.markers else stream.decode(ids))
    elif args.cmd == "validate":
        c = corpus.open_corpus(args.file)
        c.validate()
        shards = f" in {len(c.shards)} shards" if hasattr(c, "shards") else ""
        print(f"{c.path}: ok, {c.n_ids} ids{shards}")
    elif args.cmd == "encode":
        fn = stream.encode_open if args.open else stream.encode
        print(" ".join(map(str, fn(args.text).tolist())))
    elif args.cmd == "bench":
        bench_encode(mb=args.mb, json=args.json)
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except (CorpusError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
