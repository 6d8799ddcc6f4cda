"""The layers of dense_armor. Every public name is re-exported here."""

from .attention import MultiHeadSelfAttention as MultiHeadSelfAttention
from .attention import TransformerBlock as TransformerBlock
from .attention import scaled_dot_product_attention as scaled_dot_product_attention
from .attention import sinusoidal_encoding as sinusoidal_encoding
from .attention import sinusoidal_positions as sinusoidal_positions
from .cache import FixedKVCache as FixedKVCache
from .cache import KVCache as KVCache
from .cache import MeanCache as MeanCache
from .cache import PositionCache as PositionCache
from .core import Layer as Layer
from .core import Param as Param
from .core import Pointwise as Pointwise
from .core import ShapeError as ShapeError
from .layers import Dense as Dense
from .layers import Dropout as Dropout
from .layers import FeedForward as FeedForward
from .layers import LayerNorm as LayerNorm
from .layers import MeanOverTime as MeanOverTime
from .layers import ReLU as ReLU
from .models import AddPositions as AddPositions
from .models import Sequential as Sequential
from .models import transformer_encoder as transformer_encoder
from .positions import LearnedPositions as LearnedPositions
from .positions import PositionalEncoding as PositionalEncoding
