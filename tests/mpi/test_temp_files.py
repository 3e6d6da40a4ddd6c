"""A job's temp files go with it: what a failed job's ranks wrote to their temp folder is removed.

TensorFlow's autograph writes the source of every function it converts to a temp file and deletes
it at exit, which a rank that ends the job, or is killed by its launcher, never reaches. The
failing rank removes its own before it exits ([Note: generated sources] in tfsmp/failure.py), and
`tfsmp run` gives the ranks a temp folder of their own that it removes when the job is over
([Note: a job's temp folder] in tfsmp/launch/mpirun.py).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from tests.mpihelp import SCRIPTS, Result, run_mpi

pytestmark = pytest.mark.mpi

SCRIPT = SCRIPTS / "temp_files.py"


def _temps(res: Result) -> dict[int, dict[str, Any]]:
    """Each rank's ``TEMP`` line: its temp folder and the sources autograph wrote."""
    found = {}
    for text in re.findall(r"TEMP (\{.*\})$", res.stdout, re.M):  # lines may carry mpirun's tag
        info = json.loads(text)
        found[info["rank"]] = info
    assert sorted(found) == [0, 1], res.describe()
    return found


def test_the_failing_rank_removes_the_sources_autograph_wrote_under_plain_mpirun(
        tmp_path: Path) -> None:
    res = run_mpi(2, [SCRIPT, "fail"], launcher="mpirun", mpi4py_module=False, timeout=120,
                  env={"TMPDIR": str(tmp_path)})
    assert res.returncode != 0 and "injected failure" in res.stderr, res.describe()
    temps = _temps(res)
    assert temps[1]["dir"] == str(tmp_path) and temps[1]["files"], res.describe()
    assert all(Path(f).parent == tmp_path for f in temps[1]["files"])
    left = [f for f in temps[1]["files"] if os.path.exists(f)]
    assert not left, f"the failing rank left {left}"


def test_tfsmp_run_gives_a_job_its_own_temp_folder_and_removes_it_after_a_failure(
        tmp_path: Path) -> None:
    res = run_mpi(2, [SCRIPT, "fail"], launcher="tfsmp", timeout=120,
                  env={"TMPDIR": str(tmp_path)})
    assert res.returncode != 0 and "injected failure" in res.stderr, res.describe()
    temps = _temps(res)
    job = Path(temps[0]["dir"])
    assert temps[1]["dir"] == str(job) and job.parent == tmp_path, res.describe()
    assert job.name.startswith("tfsmp-tmp."), job
    assert temps[0]["files"] and temps[1]["files"]
    # rank 0 was killed while it waited: its sources went with the folder
    assert not job.exists() and not any(os.path.exists(f) for t in temps.values()
                                        for f in t["files"])
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("tfsmp-tmp.")]
