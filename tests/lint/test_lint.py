"""ruff over the whole tree, mypy (strict where pyproject.toml says), and the private-access rule.

The lint tier (`python -m pytest -m lint`): subprocesses only, no TensorFlow in this process.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def test_ruff_passes() -> None:
    proc = _run("ruff", "check", "tfsmp", "tests", "benchmarks", "examples", "scripts")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(900)
def test_mypy_passes() -> None:
    proc = _run("mypy")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def test_a_reach_into_private_state_fails_the_lint(tmp_path: Path) -> None:
    """SLF001 (pyproject.toml) guards the seams: checkpoint code that reads a model's private
    state instead of its public accessors is refused, with the line named."""
    shutil.copytree(ROOT / "tfsmp", tmp_path / "tfsmp", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    assert _run("ruff", "check", "--no-cache", "tfsmp", cwd=tmp_path).returncode == 0
    store = tmp_path / "tfsmp" / "checkpoint" / "store.py"
    store.write_text(store.read_text() + "\n\ndef _late(dm):\n    return dm._state\n")
    proc = _run("ruff", "check", "--no-cache", "tfsmp", cwd=tmp_path)
    assert proc.returncode != 0, proc.stdout
    assert "SLF001" in proc.stdout and "store.py" in proc.stdout and "_state" in proc.stdout, \
        proc.stdout

def test_test_modules_have_unique_basenames() -> None:
    """The test directories are not packages, so pytest imports each test file by its basename:
    two files of one name in different tiers stop collection of the whole suite."""
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(ROOT)} and {path.relative_to(ROOT)}")
        seen.setdefault(path.name, path)
    assert not clashes, "test files share a basename: " + "; ".join(clashes)
