"""A face: the caches and per-stream control, re-exported from their homes in `dense_armor.nn`
(this module defines nothing of its own)."""

from ...nn.models.stream import Stream as Stream
from ...nn.state.cache import FixedKVCache as FixedKVCache
from ...nn.state.cache import KeyValueCache as KeyValueCache
from ...nn.state.cache import KVCache as KVCache
from ...nn.state.cache import KVUpdate as KVUpdate
from ...nn.state.cache import MeanCache as MeanCache
from ...nn.state.cache import PositionCache as PositionCache
from ...nn.state.cache import RingKVCache as RingKVCache
from ...nn.state.counter import OVERFLOW_MODES as OVERFLOW_MODES
from ...nn.state.counter import Counter as Counter
from ...nn.state.counter import validate_overflow_mode as validate_overflow_mode
from ...nn.state.streams import batch_streams as batch_streams
from ...nn.state.streams import reset as reset
