"""A face: the recurrent layers, re-exported from their homes in `dense_armor.nn` (this module
defines nothing of its own)."""

from ...nn.mixers.recurrent import GRU as GRU
from ...nn.mixers.recurrent import LSTM as LSTM
from ...nn.mixers.recurrent import RECURRENT as RECURRENT
from ...nn.mixers.recurrent import HiddenState as HiddenState
from ...nn.mixers.recurrent import LSTMState as LSTMState
from ...nn.mixers.recurrent import MinGRU as MinGRU
from ...nn.mixers.recurrent import Recurrent as Recurrent
