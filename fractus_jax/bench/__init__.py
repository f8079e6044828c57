"""Benchmarks of the engine: `python -m fractus_jax.bench SUBCOMMAND ...`.

One module per subcommand (`fractus_jax.bench.<name>` with a `main(argv)` that returns an
exit status); `fractus_jax.bench.__main__` dispatches to them, importing only the one asked
for. Shared timing lives in `fractus_jax.bench.timing`.
"""
