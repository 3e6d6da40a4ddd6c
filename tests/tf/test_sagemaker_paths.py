"""SMP scripts relying on SageMaker's default /opt/ml paths write into the local job directory."""

from __future__ import annotations

import pytest

from tfsmp.checkpoint.layout import resolve_sagemaker_path


def test_default_paths_outside_a_job_are_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("SAGEMAKER_BASE_DIR", "SM_MODEL_DIR", "TFSMP_CHECKPOINT_DIR"):
        monkeypatch.delenv(key, raising=False)
    assert resolve_sagemaker_path("/opt/ml/checkpoints") == "/opt/ml/checkpoints"
    assert resolve_sagemaker_path("/tmp/x") == "/tmp/x"


def test_default_paths_inside_an_estimator_job_map_to_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAGEMAKER_BASE_DIR", "/jobs/j1")
    monkeypatch.setenv("SM_MODEL_DIR", "/jobs/j1/model")
    monkeypatch.setenv("TFSMP_CHECKPOINT_DIR", "/jobs/j1/ckpt")
    assert resolve_sagemaker_path("/opt/ml/checkpoints/") == "/jobs/j1/ckpt"
    assert resolve_sagemaker_path("/opt/ml/checkpoints/backup") == "/jobs/j1/ckpt/backup"
    assert resolve_sagemaker_path("/opt/ml/model") == "/jobs/j1/model"
    assert resolve_sagemaker_path("/opt/ml/output/data") == "/jobs/j1/output/data"
    assert resolve_sagemaker_path("/elsewhere") == "/elsewhere"
