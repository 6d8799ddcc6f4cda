"""The export stage: StableHLO artifacts of an encoder and of its cached step.

`export_model(model, config, out)` or `export_checkpoint(checkpoint_dir, out)` write an artifact
directory; `load(out)` returns its functions (`forward`, `init_cache`, `step`), after checking the
manifest and the sha256 of every file. Loading needs only jax, numpy and safetensors: the loader
is `dense_armor/export/standalone.py`, which every artifact carries as `run.py`.
"""

from .exporter import PLATFORMS as PLATFORMS
from .exporter import ExportSummary as ExportSummary
from .exporter import export_checkpoint as export_checkpoint
from .exporter import export_model as export_model
from .standalone import Artifact as Artifact
from .standalone import ArtifactError as ArtifactError
from .standalone import check_golden as check_golden
from .standalone import load as load
