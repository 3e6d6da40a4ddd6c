"""Pytest plugin for the judge's runs of Keras's shipped tests: one JSON line per test, per rank.

Loaded with ``-p tests.mpi.keras_judge.record`` in both runs (plain Keras in one process, and
wrapped under mpirun). It

- writes ``{"event": "start", "id": ...}`` before a test runs and ``{"event": "end", "id": ...,
  "outcome": "passed" | "failed" | "skipped", "reason": ..., "props": {...}}`` after it, each
  line flushed and fsynced, to ``--judge-out`` (``{rank}`` in the path becomes the MPI rank):
  a rank that aborts mid-test leaves a start without an end, which the runner reads as the
  test that was running (tests/mpi/keras_judge/runner.py);
- deselects the ids listed in ``--judge-skip`` (what earlier launches already ran), so a
  relaunch resumes after the test that killed a rank, with both ranks in the same order;
- provides what Keras's repository-root ``conftest.py`` gives its tests and the wheel does not
  ship: the markers (``requires_trainable_backend``...) and ``conftest.skip_if_backend``; and a
  stand-in ``jax`` module when JAX is absent, so files that import it at the top for their
  JAX-backend branches (``trainer_test.py``) collect under TensorFlow. Touching the stand-in
  raises, so a test that really needs JAX fails with a clear reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

__all__: list[str] = []

KERAS_MARKERS = (
    "requires_trainable_backend: needs a backend that trains (every backend but numpy)",
    "multi_device: needs several devices",
    "extra_large: a large test",
)


class _Absent(types.ModuleType):
    """A stand-in for a package that is not installed: importable, unusable."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise ModuleNotFoundError(
            f"{self.__name__} is not installed (the judge imports a stand-in so that files which "
            f"import it for another backend's branches collect). Received: {self.__name__}.{name}")


def _keras_conftest() -> types.ModuleType:
    """What Keras's own ``conftest.py`` exports to its tests (``from conftest import ...``)."""
    from keras.src import backend

    module = types.ModuleType("conftest")

    def skip_if_backend(given_backend: str, reason: str) -> Any:
        return pytest.mark.skipif(backend.backend() == given_backend, reason=reason)

    module.skip_if_backend = skip_if_backend  # type: ignore[attr-defined]
    return module


def _install_stand_ins() -> None:
    if importlib.util.find_spec("jax") is None:
        for name in ("jax", "jax.numpy", "jax.experimental", "jax.experimental.sparse"):
            sys.modules.setdefault(name, _Absent(name))
    if "conftest" not in sys.modules:
        sys.modules["conftest"] = _keras_conftest()


def rank() -> int:
    """This process's MPI rank from the launcher's environment (0 without one)."""
    for key in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("keras judge")
    group.addoption("--judge-out", default=None,
                    help="JSON-lines file of test starts and outcomes ({rank}: the MPI rank)")
    group.addoption("--judge-skip", default=None,
                    help="file of test ids (one a line) to deselect: what already ran")
    group.addoption("--judge-only", default=None,
                    help="file of test ids (one a line): deselect every other test")
    group.addoption("--judge-reverse", action="store_true",
                    help="run the tests in reverse order (a second run meets the first halfway)")


def pytest_configure(config: pytest.Config) -> None:
    for line in KERAS_MARKERS:
        config.addinivalue_line("markers", line)
    _install_stand_ins()
    out = config.getoption("--judge-out")
    if out:
        path = Path(out.replace("{rank}", str(rank())))
        path.parent.mkdir(parents=True, exist_ok=True)
        _STATE["sink"] = _Sink(path)


def _ids(path: str | None) -> set[str] | None:
    return None if not path else set(Path(path).read_text().split("\n")) - {""}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    done = _ids(config.getoption("--judge-skip")) or set()
    only = _ids(config.getoption("--judge-only"))
    kept = [item for item in items
            if item.nodeid not in done and (only is None or item.nodeid in only)]
    deselected = [item for item in items if item not in kept]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
    if config.getoption("--judge-reverse"):
        items.reverse()


class _Sink:
    """Appends JSON lines and forces each to disk (a rank may be killed right after)."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the session

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record, default=str) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())


# "sink": the _Sink (None: not recording); "tests": test id -> its outcome so far
_STATE: dict[str, Any] = {"sink": None, "tests": {}}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    if _STATE["sink"] is not None:
        _STATE["sink"].write({"event": "start", "id": nodeid})


def _reason(report: pytest.TestReport) -> str:
    """One line that says why: the exception line pytest shows, or the skip reason."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (file, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message).strip()
    return str(longrepr).strip().splitlines()[-1] if longrepr else ""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    sink = _STATE["sink"]
    if sink is None:
        return
    phases = _STATE["tests"].setdefault(
        report.nodeid, {"outcome": "passed", "reason": "", "props": {}, "seconds": 0.0})
    phases["seconds"] += report.duration
    for key, value in report.user_properties:
        phases["props"][key] = value
    if report.failed and phases["outcome"] != "failed":
        phases["outcome"], phases["reason"] = "failed", f"{report.when}: {_reason(report)}"
    elif report.skipped and phases["outcome"] == "passed":
        phases["outcome"], phases["reason"] = "skipped", _reason(report)
    if report.when == "teardown":
        del _STATE["tests"][report.nodeid]
        sink.write({"event": "end", "id": report.nodeid, **phases})


def pytest_collectreport(report: pytest.CollectReport) -> None:
    sink = _STATE["sink"]
    if sink is not None and report.failed:
        sink.write({"event": "collect_error", "id": report.nodeid, "reason": _reason(report)})


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _STATE["sink"] is not None:  # the runner: this rank ran everything it selected
        _STATE["sink"].write({"event": "finish", "exit": int(exitstatus)})
