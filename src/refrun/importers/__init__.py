"""Importers: existing reference curves (Megatron-LM golden values, torchtitan loss files,
CSV) recorded as ordinary refrun runs (backend ``import``).  Each validates the whole file
before creating a run, so a bad file writes nothing; the run is written directly (curves
artifact with every point, a bounded view in MLflow's metric history) and is FINISHED
when the call returns.  Never imports a training framework.
"""

from refrun.importers.csv import import_csv, parse_csv
from refrun.importers.curves import ImportedCurves
from refrun.importers.megatron import import_megatron, parse_megatron
from refrun.importers.record import create_run
from refrun.importers.torchtitan import import_torchtitan, parse_torchtitan

__all__ = [
    "ImportedCurves", "create_run", "import_csv", "import_megatron", "import_torchtitan",
    "parse_csv", "parse_megatron", "parse_torchtitan",
]
