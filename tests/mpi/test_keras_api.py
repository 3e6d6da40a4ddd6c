"""DistributedModel behaves like a Keras model on 2 ranks (2 stages): one launch, many cases."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import pytest

from tests.mpihelp import SCRIPTS, case_results, run_cases, run_mpi
from tfsmp.launch.output import TF_STARTUP

pytestmark = pytest.mark.mpi
ROOT = Path(__file__).resolve().parents[2]
CASES = [
    "case_fit_history_matches_keras", "case_callbacks_act_on_every_rank",
    "case_evaluate_and_predict_match_keras", "case_weights_roundtrip",
    "case_dataset_and_generator_inputs", "case_bad_batches_fail_on_every_rank",
    "case_nonfinite_raise_and_skip", "case_mixed_precision",
    "case_profile_and_post_partition_hook", "case_jit_compile_switches_xla",
    "case_layer_with_trainer_mixed_in", "case_a_bad_batch_fails_alike_where_a_replica_has_no_rows",
    "case_tensorboard_logs_weights_as_keras",
    "case_a_tensorboard_failing_while_it_logs_weights_fails_every_rank",
    "case_a_writer_failing_on_rank_0_fails_every_rank",
]


@pytest.fixture(scope="module")
def results() -> dict:
    return run_cases(2, SCRIPTS / "keras_api_cases.py", CASES, timeout=420)


def test_fit_history_equals_plain_keras(results: dict) -> None:
    for r in case_results(results, "case_fit_history_matches_keras"):
        assert r["keys"] == r["ref_keys"] == ["accuracy", "loss", "val_accuracy", "val_loss"]
        assert all(r["same"].values()), r["same"]
    a, b = case_results(results, "case_fit_history_matches_keras")
    assert a["loss"] == b["loss"]  # every rank has the same logs


def test_callbacks_run_alike_on_every_rank(results: dict) -> None:
    a, b = case_results(results, "case_callbacks_act_on_every_rank")
    assert a == b
    assert a["epochs_run"] == 2 and a["batches"] == 8  # EarlyStopping after patience 1
    assert a["lr"] == pytest.approx(0.025)              # LearningRateScheduler on every rank
    # TensorBoard writes one events file (train) into the folder every rank shares, as plain
    # Keras does: world rank 0 writes, the other ranks' writers do not run
    assert a["tensorboard_event_files"] == 1


def test_evaluate_predict_and_call_equal_plain_keras(results: dict) -> None:
    a, b = case_results(results, "case_evaluate_and_predict_match_keras")
    assert a["eval_same"] and a["pred_same"] and a["call_same"]
    assert a["pred_sum"] == b["pred_sum"]  # outputs are returned on every rank


def test_weights_gather_set_and_summary(results: dict) -> None:
    a, b = case_results(results, "case_weights_roundtrip")
    assert a["same"] and b["same"] and a["all_zero"] and b["all_zero"]
    assert a["summary_has_stage"]
    assert a["held"] != b["held"]  # each rank holds only its own stage


def test_dataset_and_generator_inputs_equal_plain_keras(results: dict) -> None:
    for r in case_results(results, "case_dataset_and_generator_inputs"):
        assert r["dataset_same"] and r["generator_same"]


def test_bad_batches_give_the_same_clear_error_on_every_rank(results: dict) -> None:
    a, b = case_results(results, "case_bad_batches_fail_on_every_rank")
    for r in (a, b):
        # any batch size trains, as in Keras: microbatches of unequal sizes and a partial last
        # batch (their equality with plain Keras: tests/mpi/test_keras_semantics.py)
        assert r["not_divisible"] == "no error" and r["fit_last_batch"] == "no error"
        assert "per-sample shape the model was traced with" in r["other_shape"]
        assert "Received: input 'x' with shape (12,), expected (10,)" in r["other_shape"]
        assert "The loss needs targets. Received: y=None" in r["no_targets"]
    strip = [{k: v.split("] ", 1)[-1] for k, v in r.items()} for r in (a, b)]
    assert strip[0] == strip[1]


def test_nonfinite_loss_raises_naming_microbatch_or_skips_everywhere(results: dict) -> None:
    for r in case_results(results, "case_nonfinite_raise_and_skip"):
        # the NaN sits in microbatch 1; whether the loss is NaN too depends on the kernels'
        # ReLU (oneDNN maps NaN to 0), but stage 0's gradients are always named
        assert ("Non-finite values at step 1: loss of microbatch(es) [1]" in r["raised"]
                or "Non-finite values at step 1: loss of microbatch(es) none" in r["raised"])
        assert "gradients of stage 0 from microbatch 1" in r["raised"]
        assert "nonfinite='skip'" in r["raised"]
        assert r["skip_unchanged"] and r["then_trains"] and r["skipped"] == 1


def test_mixed_precision_policies_train_like_keras(results: dict) -> None:
    for r in case_results(results, "case_mixed_precision"):
        assert r["mixed_bfloat16"]["boundary_dtype"] == "bfloat16"
        assert r["mixed_float16"]["boundary_dtype"] == "float16"
        assert r["mixed_bfloat16"]["close"], r["mixed_bfloat16"]
        assert r["mixed_float16"]["close"], r["mixed_float16"]


def test_profile_measures_layers_and_hooks_run_once_after_partitioning(results: dict) -> None:
    a, b = case_results(results, "case_profile_and_post_partition_hook")
    for r in (a, b):
        assert r["hook_calls"] == [r["own_variables"]]  # once, with the stage already taken
    assert a["measured_on_rank0"] is True  # world rank 0 plans, with measured times


@pytest.mark.timeout(300)
def test_readme_main_job_trains_the_example_on_two_ranks(tmp_path: Path) -> None:
    # oneDNN on, as on a user's machine: its start-up notice is one of the lines tfsmp run drops
    res = run_mpi(2, [str(ROOT / "examples" / "train_pipeline.py"), "--epochs", "2",
                      "--model-dir", str(tmp_path)], launcher="tfsmp", timeout=240,
                  env={"TF_ENABLE_ONEDNN_OPTS": "1"})
    assert res.returncode == 0, res.describe()
    assert "validation loss" in res.stdout and "Epoch 2/2" in res.stdout
    accuracy = float(res.stdout.rsplit("accuracy", 1)[1].split()[0])
    assert accuracy > 0.5, res.stdout[-2000:]
    assert "Epoch 1/2" not in res.ranks.get(1, "")  # progress is printed by rank 0 only
    saved = tmp_path / "digits_cnn.keras"   # a .keras file is a zip of config and weights
    assert f"saved the model to {saved} (" in res.stdout and zipfile.is_zipfile(saved)
    untagged = [re.sub(r"^\[\d+,\d+\]<\w+>: ?", "", t) for t in res.stderr.splitlines()]
    assert not [t for t in untagged if any(p.match(t) for p in TF_STARTUP)], res.stderr[-3000:]


def test_a_layer_with_keras_trainer_mixed_in_trains_as_in_keras(results: dict) -> None:
    # Keras's trainer_test.py models: a Dense and a dict-in, dict-out layer, Trainer mixed in
    for r in case_results(results, "case_layer_with_trainer_mixed_in"):
        for name in ("dense", "struct"):
            assert all(r[name].values()), (name, r[name])


def test_a_bad_batch_without_rows_on_a_replica_fails_on_every_rank(results: dict) -> None:
    for r in case_results(results, "case_a_bad_batch_fails_alike_where_a_replica_has_no_rows"):
        assert r["errors"] == ["per-sample shape"] * 3, r["errors"]  # fit's validation, predict,
        assert r["val_loss"]                                          # train_on_batch; then fit


def test_jit_compile_compiles_the_stage_programs_with_xla(results: dict) -> None:
    for r in case_results(results, "case_jit_compile_switches_xla"):
        assert [s["jit_compile"] for s in r["seen"]] == [True, False, True]
        assert [s["programs"] for s in r["seen"]] == [[True], [False], [True]]
        assert all(s["same"] for s in r["seen"]), r["seen"]
        assert [s["limit"] for s in r["seen"]] == [500.0, 501.0, 502.0]  # the config's, each step
        assert r["same_weights"]


def test_tensorboard_logs_every_weight_as_plain_keras_at_two_partitions(results: dict) -> None:
    """Weight histograms and images read every layer's weights, which no one pipeline rank
    holds: rank 0's TensorBoard gets each layer's from the ranks that hold it, and the events
    equal plain Keras's, tag for tag ([Note: TensorBoard's weights])."""
    a, b = case_results(results, "case_tensorboard_logs_weights_as_keras")
    assert a == b
    assert a["weight_tags"] == 8 * 2  # 4 Dense layers' kernel and bias, histogram and image
    assert a["missing"] == [] and a["extra"] == [], (a["missing"], a["extra"])
    assert a["different"] == []
    assert a["model_json_same"]  # the wrapped Functional's config, as plain Keras writes it
    assert a["epochs_trained"] == 3
    # a callback's self.model.layers and get_layer are the user's model's, as in plain Keras
    assert a["layers"] == {"names": a["ref_layers"], "get_layer": "h2"}
    assert a["ref_layers"] == ["x", "h1", "h2", "h3", "out"]
    assert a["checkpoints"] == a["ref_checkpoints"] != []  # the projector's, epochs 0 and 2
    assert a["checkpoints_same"]  # the whole model's weights, as plain Keras's checkpoint
    # evaluate(callbacks=[TensorBoard]) writes one events file of the evaluation, as plain
    # Keras (every rank wrote its own, [Note: one writer of the logs]), beside the model's
    # summary (train); predict writes only that summary
    assert a["eval_files"]["tfsmp_eval"] == a["eval_files"]["plain_eval"] == ["train",
                                                                              "validation"]
    assert a["eval_same"]
    assert a["eval_files"]["tfsmp_predict"] == ["train"]
    assert a["epochs_seen"] == [0, 0, 1, 1, 2, 2]


def test_a_tensorboard_failing_on_rank_0_while_it_logs_weights_fails_every_rank(
        results: dict) -> None:
    a, b = case_results(results, "case_a_tensorboard_failing_while_it_logs_weights_fails_every_rank")
    told = ".on_epoch_end failed on world rank 0, the one rank that runs the log writers and " \
           "the progress bar: "
    for mine, theirs in zip(a["errors"], b["errors"]):
        assert mine.startswith("RuntimeError: no "), mine
        assert theirs.startswith("StepError: [rank 1"), theirs
        assert told + mine in theirs, (theirs, mine)
    assert a["errors"][0] == "RuntimeError: no image for h3/kernel/image"
    assert a["errors"][1] == "RuntimeError: no scalars"
    assert a["trained_after"] == b["trained_after"] == 1
    # the watchdog names the exchange a stalled rank waits in ([Note: collective labels])
    assert a["labels"] == [["DistributedModel.fit", "TensorBoard's weights at an epoch's end"]]


def test_a_log_writer_or_progress_bar_failing_on_rank_0_fails_every_rank(results: dict) -> None:
    """[Note: a writer failing on rank 0]: before, rank 0 raised alone and rank 1 waited in the
    next step's collectives (the launch timed out)."""
    a, b = case_results(results, "case_a_writer_failing_on_rank_0_fails_every_rank")
    where = {"csv": "CSVLogger.on_train_begin", "keras_bar": "ProgbarLogger.on_train_batch_end",
             "user_bar": "ProgbarLogger.on_train_batch_end",
             "board": "BrokenBatch.on_train_batch_end",
             "evaluate": "ProgbarLogger.on_test_batch_end",
             "predict": "ProgbarLogger.on_predict_batch_end",
             "rank0_only": "BrokenBatch.on_train_batch_end"}
    assert set(a["errors"]) == {*where, "rank0_only_works", "savers_differ", "rank0_own_callback"}
    # and where rank 0 also passes a callback of its own: the peers go among the saves
    assert a["errors"]["rank0_own_callback"] == b["errors"]["rank0_own_callback"] == ""
    assert a["mixed_csv_rows"] == 3
    # Horovod's idiom (writers on rank 0 only, verbose=0 elsewhere) trains, one writer of the CSV
    assert a["errors"]["rank0_only_works"] == b["errors"]["rank0_only_works"] == ""
    assert a["csv_rows"] == 3  # header + 2 epochs
    # checkpoint saves on rank 0 only: refused on every rank before any step (they hung)
    for r, mine in enumerate((a, b)):
        assert mine["errors"]["savers_differ"] == (
            f"StepError: [rank {r} | pp_rank {r}] Every rank must pass fit the same checkpointing "
            "callbacks: a pipelined model's saves are collective (every rank sends its stages' "
            "weights, world rank 0 writes the file). Received: rank 0: ['ModelCheckpoint']; "
            "rank 1: []. Fix: pass them on every rank (the file is still written once); the log "
            "writers (CSVLogger, RemoteMonitor, TensorBoard, ProgbarLogger) may be passed on "
            "rank 0 only.")
    assert a["errors"]["csv"].startswith("FileNotFoundError: ")
    assert a["errors"]["board"] == a["errors"]["rank0_only"] == "RuntimeError: no batch scalars"
    for bar in ("keras_bar", "user_bar", "evaluate", "predict"):
        assert a["errors"][bar] == "BrokenPipeError: [Errno 32] Broken pipe", bar
    for case, hook in where.items():
        assert b["errors"][case] == (
            f"StepError: [rank 1 | pp_rank 1] {hook} failed on world rank 0, the one rank that "
            f"runs the log writers and the progress bar: {a['errors'][case]}"), case
    # the ranks go on together; the progress bar prints on rank 0 only, and fit's History is
    # the model's (tfsmp appends the History and the bar where Keras would)
    assert a["trained_after"] == b["trained_after"] == 2
    assert a["history_is_models"] and b["history_is_models"]
    assert a["history_keys"] == b["history_keys"] == ["learning_rate", "loss"]
    # a ProgbarLogger subclass passed by the user is the bar (before: tfsmp added a second)
    assert a["own_bar_epoch_lines"] == 1 and b["own_bar_epoch_lines"] == 0
    assert a["printed"] and not b["printed"]
