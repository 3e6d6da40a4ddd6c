"""Keras semantics under a pipeline: every feature of docs/keras_semantics.md against plain Keras.

Cases in `scripts/conformance_cases.py`: 2 ranks, the stage cut forced through the feature,
`History`, every weight and `evaluate` compared at rtol 1e-5, atol 1e-6. The default run takes
every feature at 4 microbatches under `interleaved` and the features whose behaviour depends on
the schedule or on one part per step under the other variants too; ``TFSMP_FULL_TESTS=1`` (set
by CI, `.ci/run`) runs the whole matrix: every feature at m = 1 and 4 under `interleaved` and
`zb-h1`. The refusals are checked against the error texts docs/keras_semantics.md quotes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.mpihelp import FULL, SCRIPTS, assert_ok, run_cases

pytestmark = pytest.mark.mpi
DOC = Path(__file__).resolve().parents[2] / "docs" / "keras_semantics.md"
CASES = ["case_full" if FULL else "case_default", "case_refusals",
         "case_scalar_neither_at_one_part", "case_state_warning"]


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    found = run_cases(2, SCRIPTS / "conformance_cases.py", CASES, timeout=1800 if FULL else 900)
    assert_ok(found)
    return found


def _rank0(results: dict[str, Any], case: str) -> Any:
    return results[case][0]["result"]


def test_every_feature_trains_equal_to_plain_keras(results: dict[str, Any]) -> None:
    outcome = _rank0(results, CASES[0])
    bad = {k: v for k, v in outcome.items() if not v["ok"]}
    assert not bad, bad
    assert outcome == results[CASES[0]][1]["result"]  # both ranks saw the same numbers


def test_every_feature_ran_in_every_variant_it_names(results: dict[str, Any]) -> None:
    outcome = _rank0(results, CASES[0])
    features = {k.split("@")[0] for k in outcome}
    documented = set(re.findall(r"^\| `(\w+)` \|", DOC.read_text(), re.M))
    assert features <= documented  # the hooks table's names are in `documented` too
    if FULL:
        assert {k.split("@")[1] for k in outcome} == {"m1", "m4", "zb1", "zb4"}


def test_refusals_say_what_the_docs_quote(results: dict[str, Any]) -> None:
    """Each refusal, on every rank alike, before any step: the first sentence the doc quotes."""
    quoted = dict(re.findall(r"^\| `(\w+)` \| (.+?) \|$", DOC.read_text().split(
        "## Refused, with the error")[1].split("##")[0], re.M))
    for rank in (0, 1):
        errors = results["case_refusals"][rank]["result"]
        assert set(errors) == set(quoted)
        for name, text in errors.items():
            assert text.startswith("StepError: [rank"), (name, text)
            assert quoted[name].rstrip(".") in text, (name, text)
            assert "Received:" in text, (name, text)


def test_a_loss_neither_sum_nor_mean_trains_equal_with_one_part(results: dict[str, Any]) -> None:
    assert _rank0(results, "case_scalar_neither_at_one_part")["ok"]


def test_a_layer_updating_its_state_in_call_warns_once(results: dict[str, Any]) -> None:
    """Once, on the rank whose stage holds the layer."""
    warned = [w for rank in (0, 1) for w in results["case_state_warning"][rank]["result"]]
    assert len(warned) == 1, warned
    assert "['counter']" in warned[0] and "once per microbatch" in warned[0]
