"""ruff over the whole tree and mypy (strict on the pure layers) are part of the test command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_ruff_passes() -> None:
    proc = _run("ruff", "check", "tfsmp", "tests", "benchmarks", "examples")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(900)
def test_mypy_passes() -> None:
    proc = _run("mypy")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


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
