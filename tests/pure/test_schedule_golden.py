"""Golden schedules: generated and lowered schedules over a grid of (pipeline, p, m, v).

Includes m < p, m = 1, p = 1, v = 2, m not a multiple of p, and a skip link. After an intended
change, regenerate and review the diff::

    python -m tfsmp.schedule.golden tests/golden/schedules
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tfsmp.schedule import parse_schedule, validate
from tfsmp.schedule.golden import CASES, REGENERATE, GoldenCase, golden_text, main

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "schedules"


@pytest.mark.parametrize("case", CASES, ids=[c.filename for c in CASES])
def test_schedule_matches_its_golden_file(case: GoldenCase) -> None:
    expected = (GOLDEN / case.filename).read_text()
    assert golden_text(case) == expected, f"schedule changed; if intended, run: {REGENERATE}"


def test_every_golden_file_is_a_case_and_parses_and_validates() -> None:
    assert sorted(p.name for p in GOLDEN.glob("*.txt")) == sorted(c.filename for c in CASES)
    placements = {c.filename: c.placement for c in CASES}  # zb-v's V placement
    for path in GOLDEN.glob("*.txt"):
        text = path.read_text().replace("[lowered]", "[compute]").replace("[forward only]", "[compute]")
        _, compute, lowered, forward = text.split("[compute]")
        assert forward.strip(), path.name
        validate(parse_schedule(compute), placement=placements[path.name])
        if "skip" not in path.name:
            validate(parse_schedule(lowered), placement=placements[path.name])


def test_the_grid_covers_the_corner_cases() -> None:
    keys = {(c.pipeline, c.p, c.m, c.v) for c in CASES}
    for pipeline in ("simple", "interleaved"):
        assert {(pipeline, 4, 1, 1), (pipeline, 4, 2, 1), (pipeline, 1, 8, 1)} <= keys
    assert {("interleaved", 4, 2, 2), ("interleaved", 1, 4, 2)} <= keys


def test_regenerate_command_writes_the_same_files(tmp_path: Path) -> None:
    assert main([str(tmp_path)]) == 0
    for case in CASES:
        assert (tmp_path / case.filename).read_text() == (GOLDEN / case.filename).read_text()
