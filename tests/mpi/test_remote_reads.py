"""Reads of another stage's variables return the holder's value ([Note: remote reads]).

One launch of 2 ranks (p = 2) runs `scripts/remote_read_cases.py`. Before remote reads, every
read here of a variable held by the other rank raised ``StepError: This variable's storage was
released on this rank``, so every test failed.
"""

from __future__ import annotations

import pytest

from tests.mpihelp import CASES_RUNNER, SCRIPTS, run_mpi

pytestmark = pytest.mark.mpi
CASES = ["case_every_rank_reads_every_variable",
         "case_one_rank_reads_while_the_other_waits_in_a_collective",
         "case_reads_in_a_callback_see_each_steps_values",
         "case_a_compiled_read_is_refused",
         "case_a_holder_that_does_not_answer_times_out_and_its_late_answer_is_dropped",
         "case_a_read_of_a_variable_the_holder_lacks_is_refused",
         "case_the_service_does_not_keep_a_dropped_model_alive",
         "case_the_optimizer_lists_its_variables_as_keras_does",
         "case_a_recompiled_model_lists_its_new_optimizers_variables",
         "case_sharded_optimizer_state_lists_every_slot"]


@pytest.fixture(scope="module")
def job() -> dict:
    res = run_mpi(2, [CASES_RUNNER, SCRIPTS / "remote_read_cases.py", *CASES], timeout=600)
    assert res.returncode == 0, res.output[-4000:]
    records: dict = {"late": []}
    for rank in range(2):
        for rec in res.json_lines(rank):
            if "case" in rec:
                assert rec["ok"], rec["error"]
                records.setdefault(rec["case"], {})[rank] = rec["result"]
            elif "late_read" in rec:
                records["late"].append(rec)
    return records


def test_every_rank_reads_the_values_the_holders_have(job: dict) -> None:
    for rank, r in job["case_every_rank_reads_every_variable"].items():
        assert r["released"], f"rank {rank} holds every variable: nothing was read remotely"
        assert r["max_diff"] == 0.0 and r["moving_mean_diff"] == 0.0, r
        assert r["still_released"], r  # a read does not keep a copy (memory stays per stage)
    held = [set(r["released"]) for r in job["case_every_rank_reads_every_variable"].values()]
    assert not held[0] & held[1]  # each variable is held by one of the two ranks


def test_a_read_on_one_rank_is_answered_while_the_holder_waits_in_a_collective(job: dict) -> None:
    r = job["case_one_rank_reads_while_the_other_waits_in_a_collective"]
    assert r[0]["diff"] == 0.0 and r[1]["diff"] is None
    assert r[0]["loss"] == r[1]["loss"]


def test_reads_in_a_callback_see_the_values_after_each_batch_as_in_keras(job: dict) -> None:
    r = job["case_reads_in_a_callback_see_each_steps_values"][0]
    assert r["reads"] == r["expected"] == 8
    assert r["max_diff"] <= 1e-5, r


def test_a_read_inside_a_compiled_function_is_refused(job: dict) -> None:
    for r in job["case_a_compiled_read_is_refused"].values():
        assert r["error"] and "compiled function cannot read another stage's variable" in r["error"]
        assert "inside a tf.function" in r["error"]


def test_a_holder_that_does_not_answer_ends_the_read_with_a_clear_error(job: dict) -> None:
    r = job["case_a_holder_that_does_not_answer_times_out_and_its_late_answer_is_dropped"][0]
    assert r["error"] and "no answer from world rank 1 for variable 'out/kernel' in 1s" in r["error"]
    assert "TFSMP_REMOTE_READ_TIMEOUT" in r["error"]
    assert r["diff"] == 0.0  # the next read's answer, not the late one


def test_a_read_the_holder_cannot_match_is_refused(job: dict) -> None:
    error = job["case_a_read_of_a_variable_the_holder_lacks_is_refused"][0]["error"]
    assert error and "world rank 1 holds no variable 'nowhere/kernel'" in error
    assert "same models in the same order" in error


def test_a_dropped_model_is_freed_on_the_ranks_that_held_it(job: dict) -> None:
    for r in job["case_the_service_does_not_keep_a_dropped_model_alive"].values():
        assert r["held"] > 0 and r["alive"] == 0, r


@pytest.mark.parametrize("case", ["case_the_optimizer_lists_its_variables_as_keras_does",
                                  "case_sharded_optimizer_state_lists_every_slot"])
def test_the_optimizer_lists_keras_variables_with_values_equal_to_plain_keras(
        job: dict, case: str) -> None:
    """[Note: the optimizer as Keras lists it]: the same names in the same order as plain
    Keras's on every rank, values within float32 rounding of plain Keras's, each rank holding a
    share (together every slot once), an assign to another rank's slot refused."""
    reports = job[case]
    held = [set(r["held"]) for r in reports.values()]
    for r in reports.values():
        assert r["names"] == r["ref_names"] and len(r["names"]) == 2 + 2 * 8, r["names"]
        assert r["max_diff"] <= 1e-5, r
        assert r["callable"]
        assert len(r["held"]) < len(r["names"])
        assert r["assign"] and "assigned only on the rank that holds it" in r["assign"]
    slots = {n for n in reports[0]["names"] if n not in ("iteration", "learning_rate")}
    assert (held[0] | held[1]) >= slots and not (held[0] & held[1]) & slots


def test_a_recompiled_models_new_optimizer_lists_every_slot_with_its_holders_values(
        job: dict) -> None:
    reports = job["case_a_recompiled_model_lists_its_new_optimizers_variables"]
    held = {**reports[0]["held"], **reports[1]["held"]}
    for r in reports.values():
        assert r["names"] == r["ref_names"] and len(r["names"]) == 2 + 2 * 8, r["names"]
        assert len(r["held"]) < len(r["names"])
        assert r["listed"] == {n: held[n] for n in r["listed"]}


def test_a_rank_whose_script_ended_still_answers(job: dict) -> None:
    assert len(job["late"]) == 1 and job["late"][0]["late_read"] == 0.0, job["late"]
