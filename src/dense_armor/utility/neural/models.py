"""A face: the attention page's module of composition and factories, re-exported from their homes
in `dense_armor.nn` (this module defines nothing of its own)."""

from ...nn.layers.positions import AddPositions as AddPositions
from ...nn.models.decoder import TransformerDecoder as TransformerDecoder
from ...nn.models.decoder import transformer_decoder as transformer_decoder
from ...nn.models.encoder import attention_maps as attention_maps
from ...nn.models.encoder import transformer_encoder as transformer_encoder
from ...nn.models.sequential import Sequential as Sequential
