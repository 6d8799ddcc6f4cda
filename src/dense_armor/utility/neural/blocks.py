"""A face: the blocks, re-exported from their homes in `dense_armor.nn` (this module defines
nothing of its own)."""

from ...nn.blocks.decoder_block import DecoderCache as DecoderCache
from ...nn.blocks.decoder_block import TransformerDecoderBlock as TransformerDecoderBlock
from ...nn.blocks.mixer_block import Gate as Gate
from ...nn.blocks.mixer_block import MixerBlock as MixerBlock
from ...nn.blocks.recurrent_block import RecurrentBlock as RecurrentBlock
from ...nn.blocks.transformer_block import TransformerBlock as TransformerBlock
