"""Bad data and bad checkpoints on 2 ranks: the same clear error on every rank, no state change, no hang.

Two launches (cases in `scripts/bad_input_cases.py`): the data, model and checkpoint cases on 2
stages; then the inputs that only some ranks would notice (targets of another length on 2
stages, a replica that runs out of data on 2 replicas). The bound: each launch
ends within its hard timeout (a hang fails the test with everyone's output) and each bad call
raises within CHECK_BOUND seconds. The rest of the catalogue, which needs no MPI, is in
tests/pure/test_bad_input_catalogue.py and tests/tf/test_bad_input_model.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.mpihelp import SCRIPTS, run_cases

pytestmark = pytest.mark.mpi
CASES = SCRIPTS / "bad_input_cases.py"
LAUNCH_BOUND = 240.0  # s, the whole 2-rank launch, TF start-up included (shared 2-core CI)
AGREE_BOUND = 120.0  # s, the second launch: 2 cases
CHECK_BOUND = 30.0    # s, from a bad call to its error on every rank

# check -> (exception type, pattern the message must match after the rank tag)
EXPECTED: dict[str, tuple[str, str]] = {
    # data
    # Keras's own data adapters read the data (Keras's wording, as plain Keras raises it)
    "shape_changes_between_batches": (
        "InvalidArgumentError", r".*Generator yielded an element of shape \(16, 9\) where an "
        r"element of shape \(None, 8\) was expected"),
    "string_inputs": ("ValueError", r"^could not convert string to float"),
    "too_many_inputs": ("StepError", r"^The inputs must match the model's 1 inputs \['x'\]\. "
                        r"Received: 2 values \(list\)\."),
    "ragged_inputs": ("StepError", r"^A pipelined model trains on dense tensors: .* Received: a "
                      r"tf\.RaggedTensor as inputs \(shape \(16, None\)\)\. Fix: pad it"),
    # Keras's trainer_test.py fits, evaluates and predicts on SciPy and tf sparse matrices
    "sparse_inputs": ("StepError", r"^A pipelined model takes dense tensors: .* Received: a "
                      r"tf\.SparseTensor \(or a SciPy sparse matrix\) as inputs \(shape \(16, "
                      r"8\)\)\. Fix: pass it dense"),
    "sparse_inputs_to_predict": ("StepError", r"^A pipelined model takes dense tensors: .* "
                                 r"Received: a tf\.SparseTensor"),
    "optional_input_none": (
        "StepError", r"^A pipelined model needs a value for every input: .* Received: None for "
        r"input\(s\) \['o'\] \(optional inputs\)\. Fix: pass a tensor for them"),
    "no_targets": ("StepError", r"^The loss needs targets\. Received: y=None\. Pass y to fit\(\)"),
    "targets_batch_differs": (
        "StepError", r"^Targets and sample weights must have one row per input row\. Received: "
        r"inputs with batch size 16, targets with batch size 12\."),
    "sample_weight_batch_differs": (
        "StepError", r"^Targets and sample weights must have one row per input row\. Received: "
        r"inputs with batch size 16, sample_weight with batch size 12\."),
    "validation_split": ("ValueError", r"^Argument `validation_split` is only supported for "
                         r"tensors or NumPy arrays\."),
    "class_weight": ("ValueError", r"^You cannot `class_weight` and `sample_weight` at the same "
                     r"time\."),
    "unknown_fit_argument": ("TypeError", r"^TensorFlowTrainer\.fit\(\) got an unexpected "
                             r"keyword argument 'epochz'"),
    # Keras ignores batch_size for a dataset; the generator's third batch is then the bad one
    "labels_longer_than_inputs": ("ValueError", r"^Data cardinality is ambiguous\. Make sure all "
                                  r"arrays contain the same number of samples\."),
    "labels_shorter_than_inputs": ("ValueError", r"^Data cardinality is ambiguous\. Make sure "
                                   r"all arrays contain the same number of samples\."),
    "dataset_batch_size_not_int": (
        "InvalidArgumentError", r".*`generator` yielded an element of shape \(16, 9\) where an "
        r"element of shape \(None, 8\) was expected"),
    "fit_before_compile": ("StepError", r"^fit needs a loss and an optimizer\. .*Call "
                           r"model\.compile\(optimizer=\.\.\., loss=\.\.\.\) first\."),
    # the last stage's compiled metric raises: the other rank raises the same, as a copy
    "metric_update_fails": ("ValueError", r"^injected metric failure: this metric cannot update"),
    # model
    "boundary_shape_unknown": (
        "StepError", r"^The shape of a tensor crossing stages must follow from the shapes of the "
        r"model's inputs\. Received: '[^']+' has per-sample shape \(None.*\) .* Partition the "
        r"model so that this tensor stays inside one stage"),
    # checkpoints (a damaged file: CorruptFileError, a CheckpointError and an OSError, so that
    # Keras's BackupAndRestore(double_checkpoint=True) falls back to its previous copy)
    "truncated_array": ("CorruptFileError", r"^A checkpoint file has the wrong size \(truncated\?\)"
                        r"\. Received: file '.*/truncated_array/ckpt-1/model/d2_kernel\..*\.npy' "
                        r"for variable 'd2/kernel' has 1144 bytes, the manifest says 1152\."),
    "checksum_mismatch": ("CorruptFileError", r"^A checkpoint file does not match its checksum "
                          r"\(corrupted\)\. Received: file '.*' for variable 'd2/kernel'"),
    "missing_array": ("CorruptFileError", r"^A checkpoint file is missing\. Received: file '.*' "
                      r"for variable 'd2/kernel' does not exist\."),
    "manifest_not_json": ("CorruptFileError", r"^A checkpoint manifest must be valid JSON\. "
                          r"Received: '.*/manifest_not_json/ckpt-1/manifest\.json' does not parse"),
    "foreign_manifest": ("CheckpointError", r"^The manifest must be a tfsmp checkpoint manifest\. "
                         r"Received: format='orbax'"),
    "newer_format_version": ("CheckpointError", r"^This tfsmp reads checkpoint format versions up "
                             r"to 1\. Received: format_version=99"),
    "path_outside_checkpoint": ("CheckpointError", r"^A manifest file path must stay inside the "
                                r"checkpoint directory\. Received: file='\.\./\.\./\.\./\.\./etc/"
                                r"passwd'"),
    "tensorflow_checkpoint": ("CheckpointError", r"^restore_prefix must name a complete "
                              r"checkpoint\. Received: restore_prefix='.*/tf_native/ckpt-1'"),
    # (a restore_prefix naming no checkpoint is a logged no-op, as in SMP: tests/tf/test_export_ckpt_smp.py)
    "wrong_shapes": ("CheckpointError", r"^A checkpoint variable must have the model variable's "
                     r"shape\. Received: 'd0/kernel' has shape \(8, 16\) .* the model's is "
                     r"\(8, 32\)\."),
    "missing_variable": ("CheckpointError", r"^Every variable of the model must be in the "
                         r"checkpoint\. Received: 'd_extra/kernel' is missing"),
    "weights_file_wrong_shapes": ("CheckpointError", r"^Weight shapes must match\. Received: "
                                  r"'.*' in '.*/wide\.weights\.h5' has shape \(8, 32\), variable "
                                  r"'d0/kernel' has \(8, 16\)\."),
    "weights_file_not_hdf5": ("CorruptFileError", r"^The weights file must be a Keras \.weights\.h5 "
                              r"or \.keras file\. Received: '.*/notes\.weights\.h5' cannot be read"),
    # a replica runs out of data (its own launch)
    "replica_runs_out_of_data": (
        "StepError", r"^Every rank's dataset must yield the same number of batches\. Received: "
        r"rank\(s\) \[1\] \(data replica\(s\) \[1\]\) ran out of data at step 2 of epoch 0 "
        r"while the others had a batch\."),
}
STAGES_CASES = ["case_not_compiled", "case_data", "case_unknown_boundary_shape", "case_checkpoints"]
# Inputs only some ranks would notice (so their peers would wait forever): the ranks must agree
# first. A separate launch, so that a hang here does not hide the results above.
AGREEMENT_CASES = ["case_lengths_differ", "case_replica_runs_out"]
AGREEMENT_CHECKS = {"targets_batch_differs", "sample_weight_batch_differs",
                    "replica_runs_out_of_data"}


def _checks(results: dict[str, dict[int, dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """check name -> its outcome on rank 0 and rank 1."""
    out: dict[str, list[dict[str, Any]]] = {}
    for case, per_rank in results.items():
        for rank in (0, 1):
            rec = per_rank[rank]
            assert rec["ok"], f"{case} on rank {rank}:\n{rec['error']}"
            for name, outcome in rec["result"].items():
                out.setdefault(name, []).append(outcome)
    return out


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bad_input")


@pytest.fixture(scope="module")
def staged(directory: Path) -> dict[str, list[dict[str, Any]]]:
    env = {"TFSMP_BAD_INPUT_DIR": str(directory)}
    return _checks(run_cases(2, CASES, STAGES_CASES, env=env, timeout=LAUNCH_BOUND))


@pytest.fixture(scope="module")
def agreed(directory: Path) -> dict[str, list[dict[str, Any]]]:
    env = {"TFSMP_BAD_INPUT_DIR": str(directory)}
    return _checks(run_cases(2, CASES, AGREEMENT_CASES, env=env, timeout=AGREE_BOUND))


_TAG = re.compile(r"^\[rank \d+ \| pp_rank \d+\] ")


def _untagged(error: str) -> str:
    kind, _, message = error.partition(": ")
    return f"{kind}: {_TAG.sub('', message)}"


def test_every_catalogued_check_ran(staged: dict[str, list[dict[str, Any]]],
                                    agreed: dict[str, list[dict[str, Any]]]) -> None:
    assert sorted(staged) == sorted(set(EXPECTED) - AGREEMENT_CHECKS)
    assert sorted(agreed) == sorted(AGREEMENT_CHECKS)


@pytest.mark.parametrize("check", sorted(EXPECTED))
def test_bad_input_gives_its_error_on_every_rank_and_changes_nothing(
        request: pytest.FixtureRequest, check: str) -> None:
    kind, pattern = EXPECTED[check]
    launch = "agreed" if check in AGREEMENT_CHECKS else "staged"
    per_rank = request.getfixturevalue(launch)[check]
    assert len(per_rank) == 2
    for outcome in per_rank:
        error = _untagged(outcome["error"])
        assert error.startswith(f"{kind}: "), outcome["error"]
        assert re.search(pattern, error.split(": ", 1)[1]), outcome["error"]
        assert outcome["unchanged"], f"{check}: state changed on a rank"
        assert outcome["seconds"] < CHECK_BOUND
    # the same sentence on both ranks (rank tags and per-rank file lists aside)
    first = [_untagged(o["error"]).split(" (and ")[0] for o in per_rank]
    assert first[0] == first[1]


def test_a_copy_of_the_last_stages_error_is_marked_as_its(
        staged: dict[str, list[dict[str, Any]]]) -> None:
    # [Note: echoes defer] in tfsmp/failure.py: rank 0 raises the last stage's error again,
    # marked as rank 1's, so that a job ending on it prints rank 1's traceback
    first, last = staged["metric_update_fails"]
    assert (first["echo_of"], last["echo_of"]) == (1, None)
    assert all(o["echo_of"] is None for name, per_rank in staged.items()
               if name != "metric_update_fails" for o in per_rank), "only copies are marked"
