"""Keras's own tests as the judge of `DistributedModel` (issue 26): what passes in plain Keras
passes with every compiled model wrapped at partitions=2 on 2 ranks, or is a documented refusal.

CI (``TFSMP_FULL_TESTS=1``) judges a small subset (`SUBSET`: 22 tests, 3 min measured at load average ~3,
whose judged tests all pass wrapped in the run of 2026-12-04 22:54 UTC, docs/keras_tests.md);
``TFSMP_KERAS_JUDGE=1`` judges every default file (tests/mpi/keras_judge/runner.py, `DEFAULT_FILES`; about 100 min
measured under heavy load, most of it relaunches after one-rank failures) and writes its report
into the test's temporary directory. The whole report: `python -m tests.mpi.keras_judge`
(docs/keras_tests.md).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.mpi.keras_judge import report, runner
from tests.mpi.keras_judge.__main__ import judge
from tests.mpi.keras_judge.runner import Outcome, RunResult
from tests.mpihelp import REPO_ROOT

REFUSALS = Path(runner.JUDGE_DIR) / "refusals.json"

# Small and fast, and touching each area the issue names with models of two layers or more:
# callbacks that read the logs and metrics and stop training, a NaN loss, learning-rate
# callbacks through the optimizer and History, ModelCheckpoint's saving and loading.
SUBSET = (
    "callbacks/early_stopping_test.py",
    "callbacks/terminate_on_nan_test.py",
    "callbacks/learning_rate_scheduler_test.py",
    "callbacks/model_checkpoint_test.py",
)


def refusals() -> dict[str, str]:
    """Test id -> the refused feature and where docs/keras_semantics.md gives the reason."""
    data: dict[str, Any] = json.loads(REFUSALS.read_text())
    return dict(data["refusals"])


def _regressions(data: dict[str, Any]) -> list[str]:
    """Tests that pass plain and fail wrapped without being a listed refusal."""
    allowed = refusals()
    return [f"{test_id}: {rec['reason']}" for test_id, rec in data["tests"].items()
            if rec["plain"] == "passed" and rec["wrapped"] == "failed" and test_id not in allowed]


def _judge_and_check(groups: list[list[str]], workdir: Path) -> dict[str, Any]:
    start = time.monotonic()
    data = judge(groups, None, workdir, log=print)
    (workdir / "keras_tests.md").write_text(report.markdown(data))
    print(f"judged {len(data['tests'])} tests in {time.monotonic() - start:.0f} s; report: "
          f"{workdir / 'keras_tests.md'}")
    assert data["tests"], "the judge ran no test: collection failed (see the report)"
    assert any(rec["wrapped"] == "passed" for rec in data["tests"].values()), \
        "no test passed wrapped: the shim or the launch is broken, not a single feature"
    bad = _regressions(data)
    assert not bad, (
        f"{len(bad)} of Keras's own tests pass in plain Keras and fail with the model wrapped "
        f"in DistributedModel (partitions=2, 2 ranks), and are not refusals listed in "
        f"{REFUSALS.relative_to(REPO_ROOT)} (with their reason in docs/keras_semantics.md):\n"
        + "\n".join(bad))
    return data


@pytest.mark.full  # 3 min: CI runs it (TFSMP_FULL_TESTS=1); the default run stays in budget
@pytest.mark.timeout(1800)
def test_keras_subset_passes_wrapped_as_plain(tmp_path: Path) -> None:
    _judge_and_check([runner.resolve_files(SUBSET)], tmp_path)


@pytest.mark.skipif(os.environ.get("TFSMP_KERAS_JUDGE") != "1",
                    reason="every default file takes over an hour on 2 cores, beyond CI's budget: "
                           "TFSMP_KERAS_JUDGE=1 runs it (or python -m tests.mpi.keras_judge)")
@pytest.mark.timeout(7200)
def test_keras_tests_pass_wrapped_as_plain(tmp_path: Path) -> None:
    _judge_and_check([runner.resolve_files([p]) for p in runner.DEFAULT_FILES], tmp_path)


def test_refusals_name_a_test_and_a_reason() -> None:
    root = runner.keras_src()
    for test_id, why in refusals().items():
        assert (root / test_id.split("::")[0]).is_file(), f"no such Keras test file: {test_id}"
        assert "keras_semantics.md" in why, f"{test_id}: the reason must cite docs/keras_semantics.md"


def _result(**per_test: dict[int, Outcome]) -> RunResult:
    return RunResult(tests={f"a_test.py::{name}": outcomes for name, outcomes in per_test.items()})


def test_a_test_passes_wrapped_only_on_every_rank_and_only_if_wrapped() -> None:
    """The verdicts the counts rest on ([Note: verdicts] in keras_judge/report.py)."""
    compiled = {"judge": {"compiled": ["Sequential"]}}
    wrapped = {"judge": {"compiled": ["Sequential"], "wrapped": ["Sequential"],
                         "not_wrapped": [], "used": True}}
    single = {"judge": {"compiled": ["Sequential"], "wrapped": ["Sequential"],
                        "not_wrapped": ["PartitionError: a model with 1 layers"], "used": True}}
    plain = _result(**{name: {0: Outcome("passed", props=compiled)}
                       for name in ("both", "one", "single", "died")},
                    nomodel={0: Outcome("passed", props={"judge": {"compiled": []}})})
    ranks = _result(
        both={0: Outcome("passed", props=wrapped), 1: Outcome("passed", props=wrapped)},
        one={0: Outcome("passed", props=wrapped), 1: Outcome("failed", "call: E", props=wrapped)},
        single={0: Outcome("passed", props=single), 1: Outcome("passed", props=single)},
        died={0: Outcome("failed", "rank 0 died or hung in this test"),
              1: Outcome("failed", "call: StepError: x", props=wrapped)})
    v = report.verdicts(plain, ranks)
    assert {k.split("::")[1]: rec["wrapped"] for k, rec in v.items()} == {
        "both": "passed", "one": "failed", "single": "not wrapped", "died": "failed",
        "nomodel": "no model"}
    assert v["a_test.py::one"]["reason"] == "[rank 1] call: E"
    assert v["a_test.py::died"]["reason"] == "[rank 1] call: StepError: x"  # the real error
    counts = report.summarize(v, {})["a_test.py"]
    assert (counts["pass wrapped"], counts["fail wrapped"], counts["not wrapped"],
            counts["no model"], counts["regressions"]) == (1, 2, 1, 1, 2)
