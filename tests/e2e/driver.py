"""Run trainer runs in this process, in order: ``python tests/e2e/driver.py PLAN.json``.

PLAN.json: a list of runs, each {"trainer": "speculators" | "nemo", ...}: the rest is
that trainer's run (speculators_driver.py, nemo_driver.py). Both trainers in one
process share its imports (torch, transformers, the patched dflash2_kernels), most of a
run's cost here; speculators' runs come first (they never start torch.distributed, whose
one-process group NeMo's recipe leaves behind).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.e2e import nemo_driver, speculators_driver  # noqa: E402

DRIVERS = {"speculators": speculators_driver, "nemo": nemo_driver}


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    del sys.argv[1:]  # NeMo's recipe reads overrides from argv: none
    prepared = set()
    for spec in plan:
        driver = DRIVERS[spec["trainer"]]
        if spec["trainer"] not in prepared:
            driver.prepare()
            prepared.add(spec["trainer"])
        driver.run(spec)


if __name__ == "__main__":
    main()
