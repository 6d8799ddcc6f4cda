"""Blocks: the residual structure written once (`mixer_block`), the Transformer encoder,
recurrent and decoder blocks."""
