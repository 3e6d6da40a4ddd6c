"""Tied weights across stages: copies train like plain Keras, stay identical, checkpoint once.

One launch of 4 ranks runs every case of `scripts/tied_cases.py`. Before tied copies, each of
these models failed to partition (``PartitionError: ... this model has only 1 group`` for the
tied LM at p=2 and p=4, ``2 groups`` for the shared Dense at p=4), so every test here failed.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.mpihelp import SCRIPTS, case_results, run_cases, with_full

pytestmark = pytest.mark.mpi
RANKS = 4
TOL = 1e-4  # max |Δ| <= TOL * max |w|, per weight, after an epoch
TRAIN = ["case_tied_lm_p4_adam", "case_tied_lm_p2_dp2_sgd", "case_shared_dense_p4_sgd",
         "case_twin_embedding_p4_adam", "case_loss_scaled_p2_dp2", "case_nonfinite_skip_p2_dp2"]
GPT2 = ["case_gpt2_p2_adam", "case_gpt2_p4_sgd"]
CASES = with_full([*TRAIN, "case_weights_api_one_value_per_weight", "case_checkpoint_save_p2",
                   "case_checkpoint_restore_p4"], GPT2)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("tied")
    return run_cases(RANKS, SCRIPTS / "tied_cases.py", CASES, timeout=900,
                     env={"TFSMP_TIED_DIR": str(folder)})


def _copies_agree(reports: list[dict[str, Any]], holders: int) -> None:
    """Every tied variable (and optimizer slot) has the same bytes on every rank holding it,
    and at least ``holders`` ranks hold it."""
    seen: dict[str, set[str]] = {}
    count: dict[str, int] = {}
    for r in reports:
        for key, digest in r["tied"].items():
            seen.setdefault(key, set()).add(digest)
            count[key] = count.get(key, 0) + 1
    assert seen, "no rank holds a tied copy"
    assert all(len(d) == 1 for d in seen.values()), seen
    assert min(count.values()) >= holders, count


@pytest.mark.parametrize(("case", "copies", "holders"), [
    ("case_tied_lm_p4_adam", [[0, 3]], 2),
    ("case_tied_lm_p2_dp2_sgd", [[0, 1]], 4),    # 2 stages x 2 replicas
    ("case_twin_embedding_p4_adam", [[0, 3]], 2),  # sparse + sparse gradients
    ("case_loss_scaled_p2_dp2", [[0, 1]], 4),
])
def test_tied_copies_train_like_keras_and_stay_identical(results: dict, case: str,
                                                          copies: list, holders: int) -> None:
    reports = case_results(results, case)
    for r in reports:
        assert r["err"] <= TOL, r
        assert r["copies"] == copies and r["finite"]
        assert r["num_weights"] == r["ref_num_weights"]
    _copies_agree(reports, holders)


def test_a_dense_called_far_apart_trains_on_four_stages(results: dict) -> None:
    reports = case_results(results, "case_shared_dense_p4_sgd")
    for r in reports:
        assert r["err"] <= TOL, r
        assert len(r["copies"][0]) == 2 and r["stage_of"]["shared"] == 0
    _copies_agree(reports, 2)


def test_a_skipped_step_is_skipped_by_every_copy(results: dict) -> None:
    reports = case_results(results, "case_nonfinite_skip_p2_dp2")
    for r in reports:
        assert r["skipped"] == 1 and r["finite"]
        assert r["err"] <= TOL, r  # == plain Keras trained without the NaN batch
    _copies_agree(reports, 4)


def test_weights_api_sees_one_value_per_weight(results: dict) -> None:
    reports = case_results(results, "case_weights_api_one_value_per_weight")
    for r in reports:
        assert r["num"] == r["ref_num"] and r["equal"]
    _copies_agree(reports, 2)


def test_checkpoint_writes_one_copy_and_restores_every_copy(results: dict) -> None:
    saved = case_results(results, "case_checkpoint_save_p2")
    a = saved[0]
    assert a["copies"] == [[0, 1]]
    assert a["variables"] == sorted(a["ref_weights"])  # one entry per weight, none per copy
    assert a["slots"].count("emb/embeddings/momentum") == 1
    restored = case_results(results, "case_checkpoint_restore_p4")  # another partition count
    for r in restored:
        assert r["copies"] == [[0, 3]] and r["all_equal"]
        assert all(r["local_equal"].values())
    assert sum(1 for r in restored if r["local_equal"]) == 2  # stage 0's and stage 3's copies
    _copies_agree(restored, 2)
    exported = restored[0]["exported"]
    assert exported == {"num": len(a["ref_weights"]), "equal": True}  # plain Keras loads it


@pytest.mark.full  # the default run trains tied keras_hub models (Gemma, BART, T5) at p = 2
def test_gpt2_causal_lm_trains_like_keras_at_p2_and_p4(results: dict) -> None:
    for case, copies in zip(GPT2, ([[0, 1]], [[0, 3]])):
        reports = case_results(results, case)
        for r in reports:
            assert r["copies"] == copies
            assert r["err"] <= TOL, r
        _copies_agree(reports, 2)
