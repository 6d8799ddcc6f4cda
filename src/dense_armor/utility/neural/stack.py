"""A face: scan over layers, re-exported from their homes in `dense_armor.nn` (this module defines
nothing of its own)."""

from ...nn.models.stack import Stack as Stack
from ...nn.models.stack import stack_layers as stack_layers
from ...nn.models.stack import unstack_layers as unstack_layers
