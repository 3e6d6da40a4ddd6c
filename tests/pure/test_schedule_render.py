"""Pictures: the staircase text and the timeline image; the schedule package stays import-clean."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tfsmp.schedule import generate, render_staircase, render_timeline, simulate

REPO = Path(__file__).resolve().parents[2]


def test_staircase_shows_idle_cells_and_long_backwards() -> None:
    result = simulate(generate("interleaved", 2, 2), forward_time=1.0, backward_time=2.0)
    assert render_staircase(result) == (
        "rank 0: F0 F1 .  .  B0 -  .  B1 -\n"
        "rank 1: .  F0 B0 -  F1 B1 -  .  .")


def test_staircase_prefixes_stages_when_ranks_hold_several() -> None:
    result = simulate(generate("interleaved", 2, 2, virtual_stages=2), forward_time=0.5,
                      backward_time=0.5)
    first = render_staircase(result).splitlines()[0]
    assert first.startswith("rank 0: 0F0 0F1 2F0 2F1")


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_timeline_image_is_written(tmp_path: Path, suffix: str) -> None:
    pytest.importorskip("matplotlib")
    result = simulate(generate("interleaved", 4, 8, virtual_stages=2), forward_time=0.5,
                      backward_time=1.0)
    path = render_timeline(result, tmp_path / f"t{suffix}", title="t")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") if suffix == ".png" else b"<svg" in data[:2000]
    assert b"rank 3" in data or suffix == ".png"


def test_schedule_modules_import_neither_tensorflow_mpi4py_nor_matplotlib() -> None:
    probe = ("import json, sys, tfsmp.schedule, tfsmp.schedule.golden, tfsmp.launch.cmd_schedule;"
             "print(json.dumps(sorted(m for m in ('tensorflow', 'keras', 'mpi4py', 'matplotlib')"
             " if m in sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []
