"""The pure tier's promise: no test here loads TensorFlow, Keras or mpi4py into the test process
(subprocesses may), so the tier runs in about a minute and says so when a change breaks that."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

HEAVY = ("tensorflow", "keras", "mpi4py", "horovod")


def _loaded() -> set[str]:
    return {name for name in HEAVY if name in sys.modules}


@pytest.fixture(autouse=True)
def _stays_light() -> Iterator[None]:
    before = _loaded()
    yield
    new = sorted(_loaded() - before)
    assert not new, (
        f"A pure test must not import {', '.join(new)} in the test process. Received: it did. "
        f"Fix: run that code in a subprocess, or move the test to tests/tf (in-process "
        f"TensorFlow) or tests/mpi.")
