"""Streaming state: the counter of fixed caches and positions (`counter`), the caches that own
their writes (`cache`), and per-stream control (`streams`)."""
