"""lm-eval task definitions (QuALITY, RULER, LongBench): YAML files with small helper modules.

The folder is the source of the ``arckv_press.tasks`` package (``pyproject.toml`` maps it), so the
helpers import one another normally and the YAMLs ship in the wheel. lm-eval finds them through
the start-up hook of :mod:`arckv_press.lm_eval` (see ``tasks/README.md``).
"""

from pathlib import Path

#: the folder holding the task YAMLs (what lm-eval's ``include_path`` takes)
TASKS_DIR = Path(__file__).resolve().parent
