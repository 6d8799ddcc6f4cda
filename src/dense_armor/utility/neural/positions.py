"""A face: the attention page's module of positional encodings, re-exported from their homes in
`dense_armor.nn` (this module defines nothing of its own)."""

from ...nn.layers.positions import AddPositions as AddPositions
from ...nn.layers.positions import LearnedPositions as LearnedPositions
from ...nn.layers.positions import PositionalEncoding as PositionalEncoding
from ...nn.layers.positions import sinusoidal_encoding as sinusoidal_encoding
from ...nn.layers.positions import sinusoidal_positions as sinusoidal_positions
