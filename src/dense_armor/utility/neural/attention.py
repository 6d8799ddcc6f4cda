"""A face: the attention page's module, re-exported from their homes in `dense_armor.nn` (this
module defines nothing of its own)."""

from ...nn.blocks.decoder_block import DecoderCache as DecoderCache
from ...nn.blocks.decoder_block import TransformerDecoderBlock as TransformerDecoderBlock
from ...nn.blocks.mixer_block import Gate as Gate
from ...nn.blocks.transformer_block import TransformerBlock as TransformerBlock
from ...nn.kernels.materialised import attention_weights as attention_weights
from ...nn.kernels.materialised import scaled_dot_product_attention as scaled_dot_product_attention
from ...nn.layers.positions import sinusoidal_encoding as sinusoidal_encoding
from ...nn.layers.positions import sinusoidal_positions as sinusoidal_positions
from ...nn.mixers.cross_attention import ContextCache as ContextCache
from ...nn.mixers.cross_attention import MultiHeadCrossAttention as MultiHeadCrossAttention
from ...nn.mixers.self_attention import MultiHeadSelfAttention as MultiHeadSelfAttention
