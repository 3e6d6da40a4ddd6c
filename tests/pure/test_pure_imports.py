"""The pure layers import neither TensorFlow, Keras nor mpi4py, not even indirectly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Imports each named module in turn, then every module found under the pure packages (which grow
# as the project does; `tfsmp` itself is not walked: it holds the TF layers too), and records which heavy modules are loaded after each import, so a leak is
# pinned on the first module that caused it.
_PROBE = """
import importlib, json, pkgutil, sys
HEAVY = ("tensorflow", "keras", "mpi4py")
seen = {}
def leaked():
    return sorted({m.split(".")[0] for m in sys.modules if m.split(".")[0] in HEAVY})
def visit(name, recurse):
    if name not in seen:
        module = importlib.import_module(name)
        seen[name] = leaked()
    if not recurse:
        return
    for info in sorted(pkgutil.iter_modules(module.__path__), key=lambda i: i.name):
        if info.name != "__main__":
            visit(f"{name}.{info.name}", info.ispkg)
for name in ["tfsmp", "tfsmp.config", "tfsmp.topology", "tfsmp.graph.ir", "tfsmp.partitioning.plan"]:
    visit(name, False)
for name in ["tfsmp.partitioning", "tfsmp.schedule", "tfsmp.timeline"]:
    visit(name, True)
print(json.dumps(seen))
"""

REQUIRED = ["tfsmp", "tfsmp.config", "tfsmp.topology", "tfsmp.graph.ir", "tfsmp.partitioning.plan",
            "tfsmp.partitioning", "tfsmp.schedule", "tfsmp.timeline"]


def _probe() -> dict[str, list[str]]:
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, f"importing the pure layers failed:\n{proc.stderr}"
    result: dict[str, list[str]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_pure_layers_do_not_import_tensorflow_keras_or_mpi4py() -> None:
    seen = _probe()
    assert set(REQUIRED) <= set(seen)
    offenders = [f"{name} -> {heavy}" for name, heavy in seen.items() if heavy]
    # `seen` is in import order, so the first offender is the module that pulled them in.
    assert not offenders, "pure modules imported heavy packages: " + "; ".join(offenders)
