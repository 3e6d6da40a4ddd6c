"""The import-linter contracts in setup.cfg hold, catch a forbidden import, and place every module."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# `lint-imports` without its logo and cache; it puts its working directory first on sys.path, so
# run in a copy of the tree it analyses that copy.
_LINT = ("import sys; from importlinter.cli import lint_imports; "
         "sys.exit(lint_imports(config_filename='setup.cfg', no_cache=True, no_logo=True))")

# Lazy name facades, and the entry point: outside every layer (see setup.cfg).
_UNLAYERED = {"tfsmp", "tfsmp.graph", "tfsmp.__main__"}


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _LINT], cwd=root, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})


def _layer_modules() -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    names = set()
    for line in cfg["importlinter:contract:layers"]["layers"].split("\n"):
        for part in line.replace("|", ":").split(":"):
            if part.strip():
                names.add(part.strip().strip("()"))
    return names


def _modules(root: Path) -> list[str]:
    out = []
    for path in sorted((root / "tfsmp").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def test_contracts_hold() -> None:
    proc = _lint(REPO)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_a_forbidden_import_breaks_the_layers_contract(tmp_path: Path) -> None:
    shutil.copytree(REPO / "tfsmp", tmp_path / "tfsmp",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "setup.cfg", tmp_path / "setup.cfg")
    actions = tmp_path / "tfsmp" / "schedule" / "actions.py"
    # Inside a function, as a lazy import: the linter must see those too.
    actions.write_text(actions.read_text() + "\n\ndef _late():\n    import tfsmp.keras\n")
    proc = _lint(tmp_path)
    assert proc.returncode != 0, proc.stdout[-4000:]
    broken = proc.stdout.split("Broken contracts", 1)[-1]
    assert "Layers: pure core < comm < tracer < runtime < API < checkpoint < launch" in broken
    assert "tfsmp.schedule is not allowed to import tfsmp.keras" in broken
    assert "tfsmp.schedule.actions -> tfsmp.keras" in broken


def test_every_module_is_in_a_layer() -> None:
    layers = _layer_modules()
    unplaced = [m for m in _modules(REPO) if m not in _UNLAYERED
                and not any(m == name or m.startswith(name + ".") for name in layers)]
    assert not unplaced, (
        f"Every module of tfsmp must belong to a layer of the import-linter contract. Received: "
        f"{unplaced} in none. Fix: add its package to `layers` in setup.cfg "
        f"([importlinter:contract:layers]).")
