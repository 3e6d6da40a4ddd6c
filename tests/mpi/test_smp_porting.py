"""SMP scripts that were silently wrong: metrics updated inside `@smp.step` (rank 0 read the
zero outputs of a dry run), hybrid ``horovod: False`` (each replica applied its own gradient)
and unseeded replicas (different initial weights); plus SMP's porting names. Every value is
compared with plain Keras on the same weights and data (tolerance 1e-5)."""

from __future__ import annotations

import pytest

from tests.mpihelp import SCRIPTS, assert_ok, run_cases

pytestmark = pytest.mark.mpi
CASES = SCRIPTS / "smp_metric_cases.py"
TOL = 1e-5


@pytest.mark.timeout(400)
def test_smp_script_cases_on_two_stages_two_replicas() -> None:
    """One launch, 4 ranks (2 stages × 2 replicas, ``horovod: False``, no seed)."""
    names = ["case_num_microbatches", "case_metrics_inside_step",
             "case_get_gradients_trains_like_keras", "case_unsyncable_variable_raises",
             "case_hybrid_replicas"]
    results = run_cases(4, CASES, names,
                        config={"partitions": 2, "microbatches": 2, "horovod": False},
                        timeout=360)
    assert_ok(results)
    for rank in range(4):
        assert results["case_num_microbatches"][rank]["result"] == 2
        metrics = results["case_metrics_inside_step"][rank]["result"]
        for call in ("eager", "graph"):
            assert metrics["got"][call] == pytest.approx(metrics["ref"], rel=TOL, abs=TOL), (
                rank, call, metrics)
        train = results["case_get_gradients_trains_like_keras"][rank]["result"]
        assert train["losses"] == pytest.approx(train["ref_losses"], rel=TOL, abs=TOL)
        assert train["max_weight_err"] <= TOL, train
        assert train["opt_variables_callable"]
        assert "works only inside an smp.step" in train["outside_error"]
        assert "tape.gradient(loss, params)" in train["outside_error"]
        error = results["case_unsyncable_variable_raises"][rank]["result"]
        assert "must be a model weight or belong to a Keras metric" in error
        assert "Received: counting_step updated" in error
        hybrid = results["case_hybrid_replicas"][rank]["result"]
        assert hybrid["start_equal"] and hybrid["end_equal"], (rank, hybrid)
        assert hybrid["max_weight_err"] <= TOL, (rank, hybrid)
