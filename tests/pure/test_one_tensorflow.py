"""The test environment holds one TensorFlow: keras-hub must not bring the full wheel beside -cpu."""

from __future__ import annotations

import importlib.metadata as md

import pytest


def _installed(name: str) -> bool:
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        return False
    return True


def test_keras_hub_installed_without_a_second_tensorflow() -> None:
    if not _installed("keras-hub"):
        pytest.skip("keras-hub is not installed (scripts/setup.sh installs it)")
    both = [n for n in ("tensorflow", "tensorflow-cpu") if _installed(n)]
    assert len(both) == 1, (
        f"one TensorFlow distribution must own the `tensorflow` package. Received: {both}. "
        f"Install keras-hub with --no-deps as scripts/setup.sh does.")
    assert not _installed("tensorflow-text")
