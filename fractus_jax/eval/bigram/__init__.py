"""``python -m fractus_jax.eval.bigram``: the bigram baseline of a config's held-out slice
(the command line; the library is `fractus_jax.bigram`)."""
