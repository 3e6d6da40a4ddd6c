"""Models whose boundary shapes are known only at run time train and infer on 2 ranks as plain
Keras does (one launch, `tests/mpi/scripts/dynamic_cases.py`).

Before run-time shape resolution ([Note: dynamic boundaries] in tfsmp/runtime/dynamic_shapes.py)
every case here raised "Tensors crossing stages need fully known per-sample shapes", and an eager
`smp.step` on a per-token model failed in its dry run (its zeros had length 1).

Tolerance: per weight, max |Δ| ≤ 1e-4 · max |w| after training. Attention key biases are held to
an absolute 1e-7 instead: their gradient is zero in exact arithmetic (softmax ignores a shift
shared by all keys), so their values are round-off noise (~1e-9) that differs with summation order.
"""

from __future__ import annotations

import pytest

from tests.mpihelp import SCRIPTS, case_results, run_cases, with_full

pytestmark = pytest.mark.mpi
CASES = with_full(["case_transformer_two_lengths", "case_predict_evaluate_new_length",
                   "case_step_two_lengths"], ["case_bert_fit_equals_keras"])
REL, NOISE = 1e-4, 1e-7


@pytest.fixture(scope="module")
def results() -> dict:
    return run_cases(2, SCRIPTS / "dynamic_cases.py", CASES, timeout=600)


def _assert_weights_equal(errors: dict[str, list[float]]) -> None:
    assert errors
    bad = {path: (diff, scale) for path, (diff, scale) in errors.items()
           if diff > (NOISE if path.endswith("key/bias") else REL * scale)}
    assert not bad, bad


@pytest.mark.full  # keras_hub BERT; the default run trains a Transformer at two lengths
def test_bert_classifier_fit_equals_plain_keras(results: dict) -> None:
    a, b = case_results(results, "case_bert_fit_equals_keras")
    assert a == b
    assert a["dynamic"]  # the cut really carries a tensor of run-time length
    _assert_weights_equal(a["errors"])
    assert a["loss"] == pytest.approx(a["ref_loss"], rel=1e-5)


def test_transformer_trains_on_two_lengths_tracing_each_program_at_most_twice(results: dict) -> None:
    """Relaxed shapes ([Note: relaxed shapes] in stage.py): per Python-argument combination a
    program traces once for the first length and once, relaxed, at the second; no later length,
    new (16) or seen (12), traces again."""
    a, b = case_results(results, "case_transformer_two_lengths")
    assert a["dynamic"]
    _assert_weights_equal(a["errors"])
    traces = {**a["traces_after_two_lengths"], **b["traces_after_two_lengths"]}
    # memory mode: forward (training=True) and recompute-backward (first microbatch or not);
    # the fused last stage (first microbatch or not)
    assert traces == {"0_fwd": 2, "0_bwd_recompute": 4, "1_fused": 4}
    assert a["traces_after_more"] == a["traces_after_two_lengths"]
    assert b["traces_after_more"] == b["traces_after_two_lengths"]


def test_predict_evaluate_and_call_at_new_lengths_equal_plain_keras(results: dict) -> None:
    a, b = case_results(results, "case_predict_evaluate_new_length")
    _assert_weights_equal(a["errors"])
    for r in (a, b):
        assert r["10"]["shape"] == [8, 10, 40] and r["6"]["shape"] == [10, 6, 40]
        for length in ("10", "6"):
            assert r[length]["pred_err"] < 1e-5 and r[length]["call_err"] < 1e-5
            assert r[length]["eval_err"] < 1e-5


def test_step_at_two_lengths_eager_and_in_a_tf_function_equals_plain_keras(results: dict) -> None:
    for r in case_results(results, "case_step_two_lengths"):
        assert set(r) == {"eager8", "eager12", "graph12", "graph8"}
        for got in r.values():
            assert got["grad_err"] < 1e-6 and got["loss_err"] < 1e-5
