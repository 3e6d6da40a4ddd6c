"""`tfsmp schedule`: the staircase, bubble and peak activations as text, JSON, or a picture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tfsmp.launch.cli import main


def test_text_output_has_the_staircase_bubble_and_peaks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "--partitions", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].startswith("rank 0: F0 F1 F2 F3 .")
    assert "bubble fraction: 0.2727 (formula (p-1)/(v*m+p-1) = 0.2727)" in out
    assert "peak activations per rank: [4, 3, 2, 1]" in out


def test_json_output_is_one_object(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "-p", "4", "-m", "8", "--pipeline", "interleaved",
                 "--virtual-stages", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bubble_fraction"] == pytest.approx(3 / 19)
    assert data["formula_bubble_fraction"] == pytest.approx(3 / 19)
    assert data["makespan"] == pytest.approx(24 + 3 * 3 / 2)
    assert data["peak_activations"] == [11, 9, 7, 5]


def test_simple_holds_every_microbatch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "-p", "4", "-m", "8", "--pipeline", "simple", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["peak_activations"] == [8, 8, 8, 8]
    assert data["bubble_fraction"] == pytest.approx(3 / 11)


def test_lowered_schedule_and_picture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out_file = tmp_path / "s.svg"
    assert main(["schedule", "-p", "2", "-m", "2", "--lowered", "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "0: 0F0 0SEND_F0>1 0F1 0SEND_F1>1" in out and f"wrote {out_file}" in out
    assert out_file.exists()


def test_bad_arguments_exit_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "-p", "0", "-m", "8"]) == 2
    assert "num_ranks must be a positive integer. Received: num_ranks=0" in capsys.readouterr().err
    assert main(["schedule", "-p", "2", "-m", "2", "--out", "x.txt"]) == 2
    assert "--out must end in .png, .svg, .pdf. Received: --out=x.txt" in capsys.readouterr().err
