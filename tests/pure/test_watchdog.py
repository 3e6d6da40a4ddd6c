"""tfsmp.runtime.watchdog: status files, the every-rank table, expiry, the monitor, the cost."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tfsmp.errors import StepError
from tfsmp.runtime import watchdog as wd
from tfsmp.runtime.watchdog import Watchdog, default_directory
from tfsmp.schedule import Action, Op

REPO = Path(__file__).resolve().parents[2]
STAGES = [0, 1, 2]


def _rows(report: str) -> dict[int, list[str]]:
    rows = {}
    for line in report.splitlines()[2:]:
        cells = [c.strip() for c in line.split("|")]
        rows[int(cells[0])] = cells
    return rows


def test_the_table_has_a_row_per_rank_with_its_state(tmp_path: Path) -> None:
    r0, r1 = Watchdog(0, 3, STAGES, str(tmp_path)), Watchdog(1, 3, STAGES, str(tmp_path))
    r0.step_begin()
    r0.update(Action(0, Op.RECV_B, 1, 1))
    r0.waiting("gradients of microbatch 1 from stage 1")
    r1.step_begin()
    r1.update(Action(1, Op.FORWARD, 1))
    report = r0.report()
    assert report.splitlines()[0].split(" | ")[:3] == ["rank", "pp_rank", "host"]
    rows = _rows(report)
    assert rows[0][4:7] == ["1", "waiting", "0RECV_B1<1"]
    assert rows[0][8] == "gradients of microbatch 1 from stage 1"
    assert rows[1][4:7] == ["1", "running", "1F1"]
    assert rows[1][8] == "computing or in the script's own code"
    assert rows[2][5] == "no status" and "TFSMP_WATCHDOG_DIR" in rows[2][8]
    r1.step_end()
    assert _rows(r0.report())[1][5:7] == ["idle", "-"]
    assert _rows(r0.report())[1][8] == "outside a pipeline step (finished step 1)"
    assert re.fullmatch(r"\d+\.\d s", _rows(r0.report())[0][7])
    r0.close()
    r1.close()


def test_a_rank_that_died_is_named_with_its_last_state(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import os
        from tfsmp.runtime.watchdog import Watchdog
        dog = Watchdog(1, 2, [0, 1], {str(tmp_path)!r})
        dog.step_begin()
        dog.update("1F3")
        os._exit(0)   # like SIGKILL: no clean-up, the status file stays
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)
    r0 = Watchdog(0, 2, [0, 1], str(tmp_path))
    row = _rows(r0.report())[1]
    assert row[5:7] == ["running", "1F3"]
    assert re.fullmatch(r"process \d+ is gone \(killed or crashed\); last: computing or in the "
                        r"script's own code", row[8]), row
    r0.close()


def test_expire_prints_the_tagged_table_and_raises_without_an_mpi_job(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    dog = Watchdog(1, 2, [0, 1], str(tmp_path))
    dog.step_begin()
    dog.update("1RECV_F0<0")
    dog.waiting("activations of microbatch 0 from stage 0")
    with pytest.raises(StepError, match=r"^\[rank 1 \| pp_rank 1\] waited too long\nWhat every "
                       r"rank was doing \(tfsmp watchdog; 'for' = time in that state\):\nrank "):
        dog.expire("[rank 1 | pp_rank 1] waited too long")
    err = capsys.readouterr().err.splitlines()
    assert all(line.startswith("[rank 1 | pp_rank 1] ") for line in err)
    assert err[0] == "[rank 1 | pp_rank 1] StepError: waited too long"  # one tag, no traceback
    assert re.fullmatch(r"\[rank 1 \| pp_rank 1\] \(called from \S+test_watchdog\.py:\d+ in "
                        r"test_expire\w+; TFSMP_DEBUG=1 shows the stack\)", err[-1]), err
    assert not any("Traceback" in x for x in err)
    assert any(re.search(r"\] 1 +\| 1 +\| .*\| waiting +\| 1RECV_F0<0 ", x) for x in err)
    monkeypatch.setenv("TFSMP_DEBUG", "1")
    with pytest.raises(StepError):
        dog.expire("[rank 1 | pp_rank 1] waited too long")
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "[rank 1 | pp_rank 1] Traceback (most recent call last):"
    assert any("tfsmp.errors.StepError: waited too long" in x for x in err)
    dog.close()


def test_a_blocking_call_past_the_limit_is_reported_by_the_monitor(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    dog = Watchdog(0, 2, [0, 1], str(tmp_path), limit=0.3)
    dog.step_begin()
    dog.update("0REDUCE")
    with dog.blocking("the allreduce of stage 0's gradients"):
        time.sleep(1.5)  # the monitor wakes every limit/4 s and expires after the limit
    err = capfd.readouterr().err
    assert "[rank 0 | pp_rank 0] StepError: waited more than " \
           "stall_timeout=0.3s for the allreduce of stage 0's gradients." in err
    assert re.search(r"\] 0 +\| 0 +\| .*\| waiting +\| 0REDUCE ", err), err
    assert re.search(r"called from \S+test_watchdog.py:\d+ in test_a_blocking_call_past", err)
    assert _rows(dog.report())[0][5] == "running"  # the wait is over
    dog.close()


def test_a_blocking_call_within_the_limit_is_silent(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    dog = Watchdog(0, 2, [0, 1], str(tmp_path), limit=5.0)
    with dog.blocking("a short allreduce"):
        time.sleep(0.05)
    dog.close()
    assert "StepError" not in capfd.readouterr().err


def test_records_are_never_read_half_written(tmp_path: Path) -> None:
    """A writer process rewrites its record as fast as it can; every read is one whole record."""
    code = textwrap.dedent(f"""
        import time
        from tfsmp.runtime.watchdog import Watchdog
        dog = Watchdog(1, 2, [0, 1], {str(tmp_path)!r})
        texts = [("1F%d" % i, "x" * (i % 150)) for i in range(200)]
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            for action, detail in texts:
                dog.update(action)
                dog.waiting(detail)
    """)
    writer = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    reader = Watchdog(0, 2, [0, 1], str(tmp_path))
    reads = 0
    deadline = time.monotonic() + 20
    while writer.poll() is None and time.monotonic() < deadline:
        st = reader.read(1)
        if st is not None and st.state == "waiting":
            assert st.detail == "x" * (int(st.action[2:]) % 150), st
            reads += 1
    writer.wait(timeout=30)
    reader.close()
    assert reads > 100


def test_a_torn_body_behind_an_even_sequence_is_never_returned(tmp_path: Path) -> None:
    """The CRC seal catches what the sequence lock alone misses on a weakly ordered CPU.

    CI once read state "waiting" with an empty action: the closing sequence number was visible
    before the body. Here the body is torn by hand behind an even, unchanged sequence number.
    """
    from tfsmp.runtime import watchdog as wd
    writer = Watchdog(1, 2, [0, 1], str(tmp_path))
    reader = Watchdog(0, 2, [0, 1], str(tmp_path))
    writer.update("1F7")
    writer.waiting("x" * 7)
    assert reader.read(1) is not None and reader.read(1).action == "1F7"
    at = wd._BODY_AT + struct.calcsize("<B3xQd")  # the action field, as pack_into leaves it mid-write
    writer._map[at:at + 48] = bytes(48)
    assert wd._SEQ.unpack_from(writer._map, wd._SEQ_AT)[0] % 2 == 0
    assert reader.read(1) is None  # after its 0.1 s of retries: no half-written record
    writer.waiting("x" * 7)  # the next whole write is read again
    assert reader.read(1).action == "1F7"
    writer.close()
    reader.close()


def test_an_update_costs_about_a_microsecond(tmp_path: Path) -> None:
    dog = Watchdog(0, 2, [0, 1], str(tmp_path))
    actions = [Action(0, Op.FORWARD, i) for i in range(8)] + [Action(0, Op.SEND_F, 1, 1)]
    dog.step_begin()
    n = 20000
    start = time.perf_counter()
    for i in range(n):
        dog.update(actions[i % len(actions)])
    per_action = (time.perf_counter() - start) / n
    dog.close()
    assert per_action < 20e-6, f"{per_action * 1e6:.1f} µs per action"  # measured ~1 µs


def test_close_removes_the_file_and_at_exit_the_empty_directory(tmp_path: Path) -> None:
    directory = tmp_path / "job"
    dog = Watchdog(0, 2, [0, 1], str(directory))
    other = Watchdog(1, 2, [0, 1], str(directory))
    assert (directory / "rank0.status").is_file()
    dog.close(remove_directory=True)
    assert not (directory / "rank0.status").exists() and directory.is_dir()  # rank 1's is there
    other.close(remove_directory=True)
    assert not directory.exists()


def test_the_directory_follows_the_launcher() -> None:
    ompi = {"OMPI_FILE_LOCATION": "/tmp/ompi.7/1/3", "PMIX_NAMESPACE": "prterun-vm-7@1"}
    assert default_directory({**ompi, wd.DIR_ENV: "/shared/wd"}) == "/shared/wd/job-prterun-vm-7_1"
    assert default_directory({wd.DIR_ENV: "/shared/wd"}) == "/shared/wd"
    assert default_directory(ompi) == "/tmp/ompi.7/1/tfsmp-watchdog"
    assert str(default_directory({"PMIX_NAMESPACE": "prterun-vm-7@1"})).endswith(
        "tfsmp-watchdog-prterun-vm-7_1")
    assert str(default_directory({"SLURM_JOB_ID": "42"})).endswith("tfsmp-watchdog-42")
    assert str(default_directory({"PMI_RANK": "0"})).endswith(f"tfsmp-watchdog-ppid{os.getppid()}")
    assert default_directory({}) is None


def test_a_single_process_has_no_watchdog() -> None:
    assert wd.for_process() is None  # no MPI world here: the executor raises StepError itself
