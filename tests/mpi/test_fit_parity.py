"""Keras `fit` parity and the same-batch check on 2 ranks (one launch, many cases).

Cases in `scripts/fit_parity_cases.py`: validation_split, class_weight, per-output losses and
metrics (History keys and values, evaluate's return), Dropout with a partial last batch at m=1,
and ranks that get different data (fit on arrays, fit on a dataset, `@smp.step`) — which must
raise one clear StepError on every rank, promptly, where before they trained on inputs paired
with another sample's labels.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.mpihelp import SCRIPTS, case_results, run_cases

pytestmark = pytest.mark.mpi
CASES = [
    "case_validation_split", "case_class_weight", "case_multi_output_dict",
    "case_multi_output_list", "case_dropout_partial_last_batch", "case_unseeded_permutation_fit",
    "case_unseeded_dataset_fit", "case_step_inputs_differ", "case_fit_replicas_share_one_batch",
    "case_checksum_cost",
]
PROMPT = 10.0  # s, from the call with bad data to its error on every rank
SAME_BATCH = (r"Ranks that train on one batch together must get the same batch from the "
              r"script \(each stage reads only its part: .*\)\. Received: "
              r"rank\(s\) \[1\] got a different batch than rank 0 {where} \({kind}\)\. This "
              r"happens when the data is shuffled or sampled without a seed .* Seed it alike on "
              r"every rank .* or load the same data on every rank\.")


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    return run_cases(2, SCRIPTS / "fit_parity_cases.py", CASES, timeout=420)


def _same_history(r: dict[str, Any]) -> None:
    assert r["keys"] == r["ref_keys"], (r["keys"], r["ref_keys"])
    assert all(r["same"].values()), r["values"]


def test_validation_split_is_the_arrays_tail_as_in_keras(results: dict[str, Any]) -> None:
    a, b = case_results(results, "case_validation_split")
    for r in (a, b):
        _same_history(r)
        assert r["shuffled_val_is_tail"]  # shuffling never mixes the validation rows in
        assert r["dataset_error"] == r["ref_dataset_error"]
        assert "`validation_split` is only supported for tensors or NumPy arrays" in \
            r["dataset_error"]
        assert "not sufficient to split it" in r["too_few"]
    assert a["values"] == b["values"]


def test_class_weight_weighs_samples_as_keras_does(results: dict[str, Any]) -> None:
    for r in case_results(results, "case_class_weight"):
        _same_history(r)
        assert r["weights_same"] and r["onehot_same"]
        assert r["with_sample_weight"] == r["ref_with_sample_weight"]


def test_per_output_losses_and_metrics_named_as_keras(results: dict[str, Any]) -> None:
    a, b = case_results(results, "case_multi_output_dict")
    for r in (a, b):
        _same_history(r)
        assert {"cls_loss", "reg_loss", "val_cls_loss", "cls_accuracy", "reg_mae"} <= set(r["keys"])
        assert r["evaluate_same"], (r["evaluate"], r["ref_evaluate"])
        _same_history(r["evaluate_dict"])
    assert a["values"] == b["values"]  # every rank logs the same
    for r in case_results(results, "case_multi_output_list"):
        _same_history(r)
        assert {"cls_out_loss", "reg_out_loss"} <= set(r["keys"])
        mine, ref = r["train_on_batch"]
        assert len(mine) == len(ref) == 5 and mine[0] == pytest.approx(ref[0], rel=1e-5)


def test_dropout_with_a_partial_last_batch_equals_keras_at_m1(results: dict[str, Any]) -> None:
    for r in case_results(results, "case_dropout_partial_last_batch"):
        for mode in ("speed", "memory"):
            _same_history(r[mode])
            assert r[mode]["max_weight_err"] <= 1e-6, r[mode]


def test_unseeded_permutation_fails_clearly_on_every_rank(results: dict[str, Any]) -> None:
    import re

    for rank, r in enumerate(case_results(results, "case_unseeded_permutation_fit")):
        assert r["error"].startswith(f"StepError: [rank {rank} | pp_rank {rank}] ")
        assert re.search(SAME_BATCH.format(where="at step 0 of epoch 0",
                                           kind="the contents differ"), r["error"]), r["error"]
        assert r["seconds"] < PROMPT
        assert r["then_trains"]


def test_unseeded_dataset_and_batch_sizes_fail_clearly(results: dict[str, Any]) -> None:
    import re

    for r in case_results(results, "case_unseeded_dataset_fit"):
        assert re.search(SAME_BATCH.format(where="at step 0 of epoch 0",
                                           kind="the contents differ"), r["error"]), r["error"]
        assert re.search(SAME_BATCH.format(where="at step 1 of epoch 0",
                                           kind="batch sizes differ: rank 0: 16, rank 1: 8"),
                         r["size_error"]), r["size_error"]
        assert r["seconds"] < PROMPT


def test_step_inputs_checked_within_the_pipeline_only(results: dict[str, Any]) -> None:
    import re

    for r in case_results(results, "case_step_inputs_differ"):
        assert re.search(SAME_BATCH.format(where="in smp.step call 2", kind="the contents differ"),
                         r["error"]), r["error"]
        assert r["seconds"] < PROMPT
        assert r["replicas_ok"]  # p=1, d=2: each replica its own shard, no error


def test_fit_replicas_split_one_global_batch(results: dict[str, Any]) -> None:
    a, b = case_results(results, "case_fit_replicas_share_one_batch")
    assert a["loss"] == b["loss"]
    assert "got a different batch than rank 0 at step 0 of epoch 0" in a["error"]


def test_batch_checksum_is_cheap(results: dict[str, Any]) -> None:
    for r in case_results(results, "case_checksum_cost"):
        # 256×28×28 float32 + labels: ~0.4 ms alone, a few ms on the loaded test machine
        assert r["ms_per_batch"] < 20.0 and r["ms_per_step_check"] < 40.0, r
