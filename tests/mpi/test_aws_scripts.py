"""AWS's own SMP TF2 training scripts, unchanged but for the import line and data loading, under
mpirun: amazon-sagemaker-examples `tf2.py` / `tf2_hvd.py` and the DLC tests `tf2_conv.py` /
`smmodelparallel_hvd2_conv.py` (in `aws_scripts/`, with where each came from).

Each launch runs one script through `aws_scripts/aws_smp_runner.py` (synthetic MNIST, SageMaker
environment stubs; see its docstring). The script must finish, and the metrics every rank
prints each epoch (train loss and accuracy, and test loss and accuracy, updated inside
`@smp.step` by the scripts) must equal the runner's plain-Keras replay of the same training for
that rank's replica. Tolerance: losses rtol 1e-3 (float32 sums in another order, through 5-20
Adam steps), accuracies within one sample.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.mpihelp import REPO_ROOT, Result, run_mpi

pytestmark = pytest.mark.mpi
AWS = REPO_ROOT / "tests" / "mpi" / "aws_scripts"
RUNNER = AWS / "aws_smp_runner.py"
OPT_ML = Path("/opt/ml/checkpoints")  # tf2.py's S3 sync checks that it exists
CONV_CKPT = Path("/tmp/tf2_conv_checkpoints")  # hard-coded in tf2_conv.py
RTOL = 1e-3
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf)")
EXAMPLES_LINE = re.compile(
    r"Epoch (\d+), Loss: (.*), Accuracy: (.*), Test loss (.*), test accuracy (.*)$")
HVD2_LINE = re.compile(r"Epoch (\d+), Accuracy: (.*), Loss: (.*)$")


def _value(text: str) -> float:
    """The number in a printed metric: ``tf.Tensor(0.25, shape=(), dtype=float32)`` or ``0.25``."""
    found = _NUMBER.search(text.split("(", 1)[-1])
    assert found, text
    return float(found.group(0))


def _printed(res: Result, rank: int, fields: list[str], pattern: re.Pattern[str]
             ) -> list[dict[str, float]]:
    epochs = []
    for line in res.ranks.get(rank, "").splitlines():
        m = pattern.search(line)
        if m:
            epochs.append({f: _value(v) for f, v in zip(fields, m.groups()[1:])})
    return epochs


def _tagged(res: Result, rank: int, tag: str) -> dict[str, Any]:
    lines = [line for line in res.ranks.get(rank, "").splitlines() if line.startswith(tag + " ")]
    assert lines, f"rank {rank} did not finish the script\n{res.describe()}"
    out: dict[str, Any] = json.loads(lines[-1][len(tag) + 1:])
    return out


def _check_metrics(res: Result, np_: int, fields: list[str], pattern: re.Pattern[str],
                   samples: dict[str, int]) -> None:
    """Every rank's printed metrics equal the replay's (checked first: a script that fails
    after training still reports them), and the script finished."""
    ref = _tagged(res, 0, "AWSREF")["replicas"]
    for rank in range(np_):
        replica = _tagged(res, rank, "AWSRANK")["dp_rank"]
        got = _printed(res, rank, fields, pattern)
        assert len(got) == 5, f"rank {rank}: {got}\n{res.describe()}"
        for epoch, (g, r) in enumerate(zip(got, ref[replica])):
            for f in fields:
                tol = ({"rel": RTOL, "abs": 1e-4} if "loss" in f
                       else {"abs": 1.0 / samples[f.split("_")[0]] + 1e-6})
                assert g[f] == pytest.approx(r[f], **tol), (rank, epoch, f, got, ref[replica])
    assert res.returncode == 0, res.describe()


@contextlib.contextmanager
def _opt_ml() -> Iterator[None]:
    """Makes /opt/ml/checkpoints exist for the run (a SageMaker container has it)."""
    created = [p for p in (OPT_ML.parent, OPT_ML) if not p.exists()]
    OPT_ML.mkdir(parents=True, exist_ok=True)
    try:
        yield
    finally:
        for p in reversed(created):
            shutil.rmtree(p, ignore_errors=True)


def _sagemaker_env(tmp_path: Path) -> dict[str, str]:
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    aws = bin_dir / "aws"
    aws.write_text('#!/bin/sh\necho "$@" >> "$AWS_STUB_LOG"\n')
    aws.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "AWS_STUB_LOG": str(tmp_path / "aws.log"),
            "SM_MODULE_DIR": "s3://tfsmp-test-bucket/job-1/source/sourcedir.tar.gz",
            "SM_CURRENT_HOST": "algo-1", "TFSMP_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
            "HOME": str(tmp_path)}


EXAMPLE_FIELDS = ["train_loss", "train_acc", "test_loss", "test_acc"]


def _run_examples_tf2(tmp_path: Path, np_: int, config: dict[str, Any]) -> None:
    with _opt_ml():
        res = run_mpi(np_, [RUNNER, AWS / "tf2.py", "--train", "256", "--test", "256",
                            "--cwd", str(tmp_path)],
                      config=config, env=_sagemaker_env(tmp_path), timeout=420)
    _check_metrics(res, np_, EXAMPLE_FIELDS, EXAMPLES_LINE, {"train": 256, "test": 256})
    sync = (tmp_path / "aws.log").read_text()
    assert sync.strip() == ("s3 sync --quiet /opt/ml/checkpoints "
                            "s3://tfsmp-test-bucket/job-1/checkpoints/algo-1/"), sync
    assert any((tmp_path / "ckpt").iterdir())  # ckpt_manager.save() wrote there


@pytest.mark.timeout(480)
def test_examples_tf2_on_two_ranks(tmp_path: Path) -> None:
    _run_examples_tf2(tmp_path, 2, {"partitions": 2, "microbatches": 2})


@pytest.mark.horovod
@pytest.mark.full  # 4 ranks, ~50 s: CI runs it (TFSMP_FULL_TESTS=1)
@pytest.mark.timeout(480)
def test_examples_tf2_hvd_on_four_ranks(tmp_path: Path) -> None:
    res = run_mpi(4, [RUNNER, AWS / "tf2_hvd.py", "--train", "256", "--test", "256",
                      "--cwd", str(tmp_path)],
                  config={"partitions": 2, "microbatches": 2, "horovod": True},
                  env={"HOME": str(tmp_path)}, timeout=420)
    _check_metrics(res, 4, EXAMPLE_FIELDS, EXAMPLES_LINE, {"train": 256, "test": 256})


@pytest.mark.timeout(480)
def test_dlc_tf2_conv_on_two_ranks(tmp_path: Path) -> None:
    shutil.rmtree(CONV_CKPT, ignore_errors=True)  # else its restore() would find a checkpoint
    try:
        res = run_mpi(2, [RUNNER, AWS / "tf2_conv.py", "--train", "128", "--test", "64",
                          "--cwd", str(tmp_path)], env={"HOME": str(tmp_path)}, timeout=420)
    finally:
        shutil.rmtree(CONV_CKPT, ignore_errors=True)
    assert "[SMP_METRIC]__tf2_conv__Training loss__" in res.ranks[0]  # its loss assert passed
    _check_metrics(res, 2, EXAMPLE_FIELDS, EXAMPLES_LINE, {"train": 128, "test": 64})


@pytest.mark.horovod
@pytest.mark.full  # 4 ranks, ~50 s: CI runs it (TFSMP_FULL_TESTS=1)
@pytest.mark.timeout(480)
def test_dlc_hvd2_conv_on_four_ranks(tmp_path: Path) -> None:
    res = run_mpi(4, [RUNNER, AWS / "smmodelparallel_hvd2_conv.py", "--train", "96",
                      "--test", "32", "--cwd", str(tmp_path)],
                  env={"HOME": str(tmp_path)}, timeout=420)
    _check_metrics(res, 4, ["train_acc", "train_loss"], HVD2_LINE, {"train": 96})
