"""A face: the pointwise layers and `MeanOverTime`, re-exported from their homes in
`dense_armor.nn` (this module defines nothing of its own)."""

from ...nn.layers.basic import COMPUTE_DTYPES as COMPUTE_DTYPES
from ...nn.layers.basic import Cast as Cast
from ...nn.layers.basic import Dense as Dense
from ...nn.layers.basic import Dropout as Dropout
from ...nn.layers.basic import FeedForward as FeedForward
from ...nn.layers.basic import LayerNorm as LayerNorm
from ...nn.layers.basic import MeanOverTime as MeanOverTime
from ...nn.layers.basic import ReLU as ReLU
