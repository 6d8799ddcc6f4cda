"""Layers without a sequence mixer: `Dense`, `LayerNorm`, the feed-forward, ... (`basic`) and
the positional encodings (`positions`)."""
