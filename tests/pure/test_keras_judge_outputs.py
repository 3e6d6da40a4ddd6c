"""The Keras judge's command writes the committed report only for a run of the whole default set:
a narrower run (other files, -k, another partition count, --reverse) must not replace it."""

from __future__ import annotations

import argparse
from pathlib import Path

from tests.mpi.keras_judge import runner
from tests.mpi.keras_judge.__main__ import _outputs, _partial
from tests.mpihelp import REPO_ROOT


def _args(**kw: object) -> argparse.Namespace:
    base = {"files": list(runner.DEFAULT_FILES), "keyword": None, "reverse": False,
            "partitions": runner.CONFIG["partitions"], "json": None, "md": None, "workdir": None}
    return argparse.Namespace(**{**base, **kw})


def test_only_the_whole_default_run_writes_the_committed_report() -> None:
    docs = REPO_ROOT / "docs"
    whole = _args()
    assert not _partial(whole)
    assert _outputs(whole, _partial(whole)) == (str(docs / "keras_tests.json"),
                                                str(docs / "keras_tests.md"))
    for narrower in (_args(files=["trainers/trainer_test.py"]), _args(keyword="early"),
                     _args(partitions=1), _args(reverse=True)):
        assert _partial(narrower)
        assert _outputs(narrower, True) == (None, None)


def test_a_narrower_run_writes_into_its_workdir_or_where_told(tmp_path: Path) -> None:
    run = _args(files=["callbacks/*_test.py"], workdir=str(tmp_path))
    assert _outputs(run, True) == (str(tmp_path / "keras_tests.json"),
                                   str(tmp_path / "keras_tests.md"))
    told = _args(json="/tmp/j.json", md="-")
    assert _outputs(told, False) == ("/tmp/j.json", None)
