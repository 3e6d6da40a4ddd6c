"""Fixtures of the tf tier: tfsmp in this process, one rank."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture()
def smp() -> Iterator[Any]:
    """tfsmp initialized at partitions=1, microbatches=2 for one test, then shut down."""
    import tfsmp

    if tfsmp.is_initialized():
        tfsmp.shutdown()
    tfsmp.init({"partitions": 1, "microbatches": 2})
    yield tfsmp
    tfsmp.shutdown()
