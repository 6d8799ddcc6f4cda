"""A face: the base classes, errors and argument checks, re-exported from their homes in
`dense_armor.nn` (this module defines nothing of its own)."""

from ...nn.core import CannotStream as CannotStream
from ...nn.core import Layer as Layer
from ...nn.core import NotAnInteger as NotAnInteger
from ...nn.core import Param as Param
from ...nn.core import Pointwise as Pointwise
from ...nn.core import ShapeError as ShapeError
from ...nn.core import check_steps as check_steps
from ...nn.core import is_integer as is_integer
from ...nn.core import python_scalar as python_scalar
from ...nn.core import require_bool as require_bool
from ...nn.core import require_int as require_int
from ...nn.core import require_key as require_key
from ...nn.core import require_positive as require_positive
from ...nn.core import require_rate as require_rate
from ...nn.core import shape_checked as shape_checked
from ...nn.core import type_checked as type_checked
