"""Importers: existing reference curves (Megatron-LM golden values, torchtitan loss files,
CSV, TensorBoard event files, MLPerf Training result logs) recorded as ordinary refrun runs
(backend ``import``).  Each validates the whole file
before creating a run, so a bad file writes nothing; the run is written directly (curves
artifact with every point, a bounded view in MLflow's metric history) and is FINISHED
when the call returns.  Never imports a training framework.
"""

import importlib
from typing import Any

from refrun.importers.csv import import_csv, parse_csv
from refrun.importers.curves import ImportedCurves
from refrun.importers.megatron import import_megatron, parse_megatron
from refrun.importers.record import create_run
from refrun.importers.torchtitan import import_torchtitan, parse_torchtitan

__all__ = [
    "ImportedCurves", "create_run", "import_csv", "import_megatron", "import_mlperf",
    "import_tensorboard", "import_torchtitan", "parse_csv", "parse_megatron", "parse_mlperf",
    "parse_tensorboard", "parse_torchtitan",
]

# The TensorBoard and MLPerf importers need the `importers` extra (tensorboard,
# google-crc32c, mlperf-logging): imported on first use, so the other importers work
# without it.
_LAZY = {"import_mlperf": "mlperf", "parse_mlperf": "mlperf",
         "import_tensorboard": "tensorboard", "parse_tensorboard": "tensorboard"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"refrun.importers.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'refrun.importers' has no attribute {name!r}")
