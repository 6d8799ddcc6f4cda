"""A face: blocked attention, re-exported from their homes in `dense_armor.nn` (this module defines
nothing of its own)."""

from ...nn.kernels.blocked import BLOCKED_MIN_LENGTH as BLOCKED_MIN_LENGTH
from ...nn.kernels.blocked import blocked_attention as blocked_attention
from ...nn.kernels.blocked import use_blocked as use_blocked
