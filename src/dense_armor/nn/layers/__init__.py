"""Layers without a sequence mixer: `Dense`, `LayerNorm`, the feed-forward, ... (`basic`), the
positional encodings (`positions`) and the layers of a token language model (`language`)."""
