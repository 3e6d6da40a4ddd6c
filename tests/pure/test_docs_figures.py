"""The docs cannot drift: every marked figure in README.md and docs/*.md equals benchmarks/results.json
(or the code), and results tables hold no number without a marker ([Note: docs figures] in
benchmarks/figures.py). After a benchmark run: `python benchmarks/run.py --write-docs`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import figures

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results.json"
FIX = "Fix: `python benchmarks/run.py --write-docs` (or put the number's <!--fig:KEY--> marker)."


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    return json.loads(RESULTS.read_text())


@pytest.fixture(scope="module")
def values(results: dict[str, Any]) -> dict[str, float]:
    return figures.all_figures(results)


def _docs() -> list[Path]:
    return figures.doc_paths(REPO)


def test_results_json_holds_the_figures_of_its_own_results(results: dict[str, Any]) -> None:
    assert results.get("figures") == figures.figures(results), (
        "benchmarks/results.json's figures are stale. " + FIX)


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_marked_figure_equals_its_source(doc: Path, values: dict[str, float]) -> None:
    problems = figures.check_text(doc.read_text(), values, str(doc.relative_to(REPO)))
    assert not problems, "\n".join([*problems, FIX])


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_results_tables_have_no_number_without_a_marker(doc: Path) -> None:
    problems = figures.unmarked_in_tables(doc.read_text(), str(doc.relative_to(REPO)))
    assert not problems, "\n".join(problems)


def test_the_docs_quote_the_counted_and_measured_figures() -> None:
    """The figures the issue found disagreeing are now marked where they are quoted."""
    text = {p.relative_to(REPO).as_posix(): p.read_text() for p in _docs()}
    for doc in ("README.md", "docs/faults.md"):
        assert "<!--fig:code.bad_input.total-->" in text[doc], doc
    assert "<!--fig:speedup.zb.m4.gain-->" in text["README.md"]
    assert "<!--fig:multihost.1MB.ratio-->" in text["docs/multihost.md"]
    assert "<!--fig:p2p.1MB.ratio-->" in text["docs/multihost.md"]
    marked = sum(len(figures.MARKER.findall(t)) for t in text.values())
    assert marked >= 100, marked


def test_counts_come_from_the_catalogues(values: dict[str, float]) -> None:
    parts = ["config", "estimator", "schedules", "model", "boundary", "data", "checkpoints"]
    assert values["code.bad_input.total"] == sum(values[f"code.bad_input.{k}"] for k in parts)
    assert all(values[f"code.bad_input.{k}"] >= 1 for k in parts)


def test_a_disagreeing_or_unknown_figure_is_found_and_rewritten() -> None:
    values = {"a.ratio": 1.0366, "b.count": 71.0}
    text = "x 1.04<!--fig:a.ratio--> y 74<!--fig:b.count--> z 3<!--fig:nope-->"
    problems = figures.check_text(text, values, "d.md")
    assert problems == ["d.md:1: b.count is 71 in benchmarks/results.json (or the code), the doc "
                        "says 74", "d.md:1: unknown figure key 'nope'"]
    fixed = figures.rewrite_text(text, values)
    assert fixed == "x 1.04<!--fig:a.ratio--> y 71<!--fig:b.count--> z 3<!--fig:nope-->"
    assert figures.rewrite_text("1.037<!--fig:a.ratio-->", values) == "1.037<!--fig:a.ratio-->"
    assert figures.rewrite_text("1.0<!--fig:a.ratio-->", values) == "1.0<!--fig:a.ratio-->"


def test_a_results_column_with_an_unmarked_number_is_found() -> None:
    text = "\n".join([
        "| benchmark | result | goal |",
        "|---|---|---|",
        "| Dense(1024)×8, m = 8 | 1.21<!--fig:s.x-->× of 1F1B, zb-h1 1.27× | ≥ 1.05 |",
        "| p2p, 256 KB | 0.218<!--fig:p.x--> [0.19, `0.2`], m = 4, ≤ 0.9 | 0.9 |",
        "",
        "| a | b |", "|---|---|", "| 1 | 2 |",   # no marker: not a results table
    ])
    problems = figures.unmarked_in_tables(text, "d.md")
    assert problems == [
        "d.md:3: '1.27' in column 'result' has no <!--fig:KEY--> marker",
        "d.md:4: '0.19' in column 'result' has no <!--fig:KEY--> marker",
    ]
