"""Watched collectives: call counts, labels, who arrived, a stopped rank; one report per job."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tfsmp import failure
from tfsmp.comm import collective_label
from tfsmp.comm.calls import Call, explain
from tfsmp.comm.watchdog import Watchdog, watched
from tfsmp.errors import ConfigError, StepError

REPO = Path(__file__).resolve().parents[2]
WORLD = 0


def _get_weights(seq: int) -> Call:
    return Call(WORLD, "allgather_obj", seq, "DistributedModel.get_weights", "", (0, 1))


def _rank1(tmp_path: Path) -> Watchdog:
    return Watchdog(1, 2, [0, 1], str(tmp_path))


def _why(dog: Watchdog, call: Call) -> str:
    return explain(call, dog.rank, {r: dog.read(r) for r in call.ranks})


def test_a_call_only_rank_0_makes_names_the_api_and_says_call_it_everywhere(
        tmp_path: Path) -> None:
    r0, r1 = Watchdog(0, 2, [0, 1], str(tmp_path)), _rank1(tmp_path)
    with r1.collective(Call(WORLD, "allgather_obj", 2, ranks=(0, 1))):
        pass  # both made call #2; rank 1 then ends its script
    r1.exited()
    with r0.collective(_get_weights(3)):
        text = _why(r0, _get_weights(3))
        table = r0.report()
    assert text == (
        "in allgather_obj #3 on the world group in DistributedModel.get_weights, a collective "
        "call every rank of the group (ranks 0, 1) must make. Arrived: rank 0. Not arrived: "
        "rank 1 (its script ended (it waits in MPI_Finalize)). `DistributedModel.get_weights()` "
        "gathers from every rank: call it on every rank, not only where rank == 0, and in the "
        "same order everywhere.")
    assert re.search(r"^0 +\| 0 .*\| waiting +\| - +\| [\d.]+ s \| allgather_obj #3 on the world "
                     r"group in DistributedModel.get_weights$", table, re.M), table
    assert re.search(r"^1 +\| 1 .*\| exited +\| - +\| [\d.]+ s \| its script ended", table, re.M)
    r0.close()
    r1.close()


def test_peers_inside_the_call_or_past_it_have_arrived(tmp_path: Path) -> None:
    r0, r1 = Watchdog(0, 2, [0, 1], str(tmp_path)), _rank1(tmp_path)
    with r1.collective(_get_weights(3)):
        assert "Arrived: ranks 0, 1." in _why(r0, _get_weights(3))
    assert "Not arrived" not in _why(r0, _get_weights(3))  # rank 1 left call #3: it was there
    assert "Not arrived: rank 1 (it runs its own code" in _why(r0, _get_weights(4))
    assert "If a rank is only slow, raise stall_timeout" in _why(r0, _get_weights(4))
    r0.close()
    r1.close()


def test_another_collective_at_the_same_count_is_named(tmp_path: Path) -> None:
    r0, r1 = Watchdog(0, 2, [0, 1], str(tmp_path)), _rank1(tmp_path)
    with r1.collective(Call(WORLD, "barrier", 3, "smp.barrier", "", (0, 1))):
        text = _why(r0, _get_weights(3))
    assert ("Rank 1 called another collective there: barrier #3 on the world group in "
            "smp.barrier.") in text, text
    r0.close()
    r1.close()


def test_a_stopped_rank_is_shown_stopped_not_computing(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import os, signal
        from tfsmp.comm.watchdog import Watchdog
        dog = Watchdog(1, 2, [0, 1], {str(tmp_path)!r})
        dog.step_end()
        os.kill(os.getpid(), signal.SIGSTOP)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    try:
        r0 = Watchdog(0, 2, [0, 1], str(tmp_path))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            st = r0.read(1)
            if st is not None and st.process == "stopped":
                break
            time.sleep(0.05)
        row = [c.strip() for c in r0.report().splitlines()[3].split("|")]
        assert row[5] == "stopped", row
        assert re.fullmatch(r"process \d+ is stopped \(SIGSTOP or a debugger\); last: idle, "
                            r"outside a pipeline step \(finished step 0\)", row[8]), row
        text = _why(r0, _get_weights(1))
        assert re.search(r"Not arrived: rank 1 \(its process \d+ is stopped \(SIGSTOP or a "
                         r"debugger\)\)\. A rank that stops or dies makes its peers wait", text)
        with pytest.raises(StepError, match=r"^\[rank 0 \| pp_rank 0\] waited for gradients\. "
                           r"Rank 1's process \d+ is stopped \(SIGSTOP or a debugger\)\.\n"):
            r0.expire("[rank 0 | pp_rank 0] waited for gradients.")  # the executor's stall
        r0.close()
    finally:
        child.kill()
        child.wait(timeout=30)


def test_labels_nest_outermost_is_the_api() -> None:
    group = SimpleNamespace(index=WORLD, ranks=[0, 1])
    inner = collective_label("the preemption check", api=False)
    with collective_label("DistributedModel.fit"), inner:
        call = Call.of(group, "allreduce_", 7)
    assert (call.api, call.what, call.ranks) == ("DistributedModel.fit", "the preemption check",
                                                 (0, 1))
    with collective_label("the preemption check", api=False):  # no API around it
        call = Call.of(group, "allreduce_", 8)
    assert (call.api, call.what) == ("", "the preemption check")
    assert "in allreduce_" in explain(call, 0, {1: None}) and "()`" not in explain(call, 0, {})
    with collective_label("smp.barrier"):
        assert Call.of(group, "barrier", 1).what == ""


def test_every_collective_counts_on_every_rank_even_without_a_watchdog() -> None:
    group = SimpleNamespace(index=WORLD, ranks=[0, 1], calls=0)
    for _ in range(3):
        with watched(group, "barrier"):
            pass
    with watched(group, "recv_obj", peer=1):  # a receive is not a collective: not counted
        pass
    assert group.calls == 3


def test_a_collective_past_the_limit_is_reported_with_its_arrivals(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    dog = Watchdog(0, 2, [0, 1], str(tmp_path), limit=0.3)
    with pytest.raises(StepError), dog.collective(_get_weights(1)):
        time.sleep(1.5)  # the monitor expires, prints, and (no MPI job) the wait ends here
        raise StepError("the monitor did not raise in this thread; the message is on stderr")
    err = capfd.readouterr().err
    assert ("[rank 0 | pp_rank 0] StepError: waited more than stall_timeout=0.3s in "
            "allgather_obj #1 on the world group in DistributedModel.get_weights, a collective "
            "call every rank of the group (ranks 0, 1) must make. Arrived: rank 0. Not "
            "arrived: rank 1 (no status).") in err, err
    dog.close()


def test_a_tfsmp_error_prints_as_one_tagged_message() -> None:
    exc = ConfigError("partitions must divide the world size.\nReceived: partitions=3")
    assert failure.format_short(exc, "rank 1 | pp_rank 0") == (
        "[rank 1 | pp_rank 0] ConfigError: partitions must divide the world size.\n"
        "[rank 1 | pp_rank 0] Received: partitions=3\n")


def test_only_the_first_rank_of_a_job_claims_the_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"PMIX_NAMESPACE": "prterun-vm-1@1", failure.DIR_ENV: str(tmp_path)}
    monkeypatch.setattr(failure, "_claimed", [])
    assert failure.claim_report(env)
    assert failure.claim_report(env)  # kept for the life of the process
    monkeypatch.setattr(failure, "_claimed", [])  # as another rank of the job
    assert not failure.claim_report(env)
    assert (tmp_path / "job-prterun-vm-1_1" / "reported").is_file()
    monkeypatch.setattr(failure, "_claimed", [])  # no job named: every rank reports
    assert failure.claim_report({failure.DIR_ENV: str(tmp_path)})
    assert oct(os.stat(tmp_path / "job-prterun-vm-1_1").st_mode & 0o777) == "0o700"


_FAILING_RANK = textwrap.dedent("""
    import sys, time
    from tfsmp import failure
    from tfsmp.errors import StepError
    rank, delay, echoes = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "echo"
    failure.install(lambda: f"rank {rank} | pp_rank 0")
    time.sleep(delay)
    if echoes:
        raise failure.echo(StepError("Received: rank 1 failed reading its batch"), origin=1)
    raise RuntimeError("injected fault on rank 1")
""")


def _fail_together(tmp_path: Path, *ranks: tuple[int, float, str]) -> dict[int, str]:
    """Runs one failing process per (rank, delay, kind) as ranks of one job; their stderr."""
    env = {**os.environ, "PMIX_NAMESPACE": "prterun-echo@1", failure.DIR_ENV: str(tmp_path),
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = {r: subprocess.Popen([sys.executable, "-c", _FAILING_RANK, str(r), str(d), k],
                                 env={**env, "OMPI_COMM_WORLD_RANK": str(r)},
                                 stderr=subprocess.PIPE, text=True) for r, d, k in ranks}
    return {r: p.communicate(timeout=60)[1] for r, p in procs.items()}


def test_a_copy_of_another_ranks_failure_lets_that_rank_report(tmp_path: Path) -> None:
    # [Note: echoes defer]: rank 0's copy is raised first, yet rank 1 prints its traceback
    err = _fail_together(tmp_path, (0, 0.0, "echo"), (1, 0.3, "own"))
    assert "Traceback (most recent call last):" in err[1], err
    assert "[rank 1 | pp_rank 0] RuntimeError: injected fault on rank 1" in err[1], err
    assert "StepError" not in err[0], err


def test_a_copy_prints_when_the_rank_it_echoes_never_reports(tmp_path: Path) -> None:
    start = time.monotonic()
    err = _fail_together(tmp_path, (0, 0.0, "echo"))
    assert err[0] == "[rank 0 | pp_rank 0] StepError: Received: rank 1 failed reading its batch\n"
    assert time.monotonic() - start >= failure.ECHO_GRACE


def test_end_job_outside_an_mpi_job_returns() -> None:
    failure.end_job(1)  # nothing to end: the caller goes on (the excepthook then exits 1)


def test_a_watched_call_costs_tens_of_microseconds(tmp_path: Path) -> None:
    dog = Watchdog(0, 2, [0, 1], str(tmp_path))
    group = SimpleNamespace(index=WORLD, ranks=[0, 1], calls=0)
    n = 5000
    start = time.perf_counter()
    for i in range(1, n + 1):
        with dog.collective(Call.of(group, "allgather_obj", i)):
            pass
    per_call = (time.perf_counter() - start) / n
    dog.close()
    assert per_call < 200e-6, f"{per_call * 1e6:.1f} µs per call"  # measured ~20 µs


# [Note: certain deadlocks]: every rank waits in a world collective none of which can finish


def test_ranks_waiting_in_different_world_collectives_are_a_certain_deadlock(
        tmp_path: Path) -> None:
    r0, r1 = Watchdog(0, 2, [0, 1], str(tmp_path)), _rank1(tmp_path)
    user_world = 3
    with (r1.collective(Call(user_world, "barrier", 1, "smp.barrier", "", (0, 1))),
          r0.collective(_get_weights(3))):
        assert r0._deadlock() is not None and r1._deadlock() is not None
        assert r0._deadlock() == r0._deadlock()  # the same records: the streak counts up
        text = r0._deadlock_message("", _get_weights(3), 12.4)
    assert text == (
        "[rank 0 | pp_rank 0] can never finish its wait (found after 12s, without waiting for "
        "stall_timeout=0.0s: every rank of the job waits in a collective call that not all "
        "ranks made, or has ended its script) in allgather_obj #3 on the world group in "
        "DistributedModel.get_weights, a collective call every rank of the group (ranks 0, 1) "
        "must make. Arrived: rank 0. Not arrived: rank 1 (it waits in barrier #1 on the "
        "user_world group in smp.barrier). `DistributedModel.get_weights()` gathers from every "
        "rank: call it on every rank, not only where rank == 0, and in the same order "
        "everywhere.")
    r0.close()
    r1.close()


def test_a_rank_whose_script_ended_is_a_certain_deadlock_for_one_in_a_collective(
        tmp_path: Path) -> None:
    r0, r1 = Watchdog(0, 2, [0, 1], str(tmp_path)), _rank1(tmp_path)
    r1.exited()
    with r0.collective(_get_weights(3)):
        assert r0._deadlock() is not None
    r0.close()
    r1.close()


def test_waits_that_may_still_end_are_no_deadlock(tmp_path: Path) -> None:
    r0, r1 = Watchdog(0, 2, [0, 1], str(tmp_path)), _rank1(tmp_path)
    with r0.collective(_get_weights(3)):
        assert r0._deadlock() is None          # rank 1 computes: it may come
        with r1.collective(_get_weights(3)):
            assert r0._deadlock() is None      # both in the same call: it finishes
        r1.waiting("activations of microbatch 0 from stage 0")
        assert r0._deadlock() is None          # a pipeline receive, not a collective
        with r1.collective(Call(2, "allreduce_", 1, "", "", (1,))):
            assert r0._deadlock() is None      # a data-group collective: its members unknown
    r0.close()
    r1.close()


def test_a_data_group_collective_is_judged_by_the_topology_s_members(tmp_path: Path) -> None:
    """p=2, d=2, placement "cluster": stage = rank % 2, replica = rank // 2; the data groups
    are {0, 2} and {1, 3}, the pipeline groups {0, 1} and {2, 3}."""
    dogs = [Watchdog(r, 4, [0, 1, 0, 1], str(tmp_path), data_ranks=[0, 0, 1, 1])
            for r in range(4)]
    data, user_world = 2, 3
    assert dogs[0]._members(data, 2) == (0, 2) and dogs[0]._members(1, 3) == (2, 3)
    assert dogs[0]._members(6, 0) == (0, 2)  # Horovod's: its world is the data group
    assert dogs[0]._members(7, 0) is None    # another group's members are not known
    barrier = Call(user_world, "barrier", 1, "smp.barrier", "", (0, 1, 2, 3))
    with (dogs[0].collective(Call(data, "allreduce_", 4, "", "gradients", (0, 2))),
          dogs[1].collective(barrier), dogs[3].collective(barrier)):
        assert dogs[1]._deadlock() is None  # rank 2 computes: it may still come
        with dogs[2].collective(barrier):
            # rank 0 waits for rank 2 in their data group; 1, 2, 3 wait for 0 in the barrier
            assert dogs[1]._deadlock() is not None
    with (dogs[0].collective(Call(data, "allreduce_", 4, "", "", (0, 2))),
          dogs[2].collective(Call(data, "allreduce_", 4, "", "", (0, 2))),
          dogs[1].collective(barrier), dogs[3].collective(barrier)):
        assert dogs[1]._deadlock() is None  # 0 and 2 can finish their allreduce
    horovod = Call(6, "grouped_allreduce", 3, "", "gradients", (0, 2))
    with (dogs[0].collective(horovod), dogs[1].collective(barrier), dogs[2].collective(barrier),
          dogs[3].collective(barrier)):
        # rank 0 waits for rank 2 in a Horovod reduction, 2 never comes: certain
        assert dogs[1]._deadlock() is not None
    for dog in dogs:
        dog.close()


def test_the_deadlock_search_waits_ten_seconds_then_two_more_readings() -> None:
    from tfsmp.comm import watchdog

    # tests/mpi/test_faults.py bounds the deadlock fault with these
    assert watchdog.DEADLOCK_AFTER == 10.0
    assert watchdog._DEADLOCK_STREAK == 2


def test_a_call_whose_peers_sent_another_signature_names_both_calls() -> None:
    # [Note: the same call]: the signature carries the labels, and a difference names both
    from tfsmp.comm.calls import same_call, signature
    from tfsmp.errors import CommError

    group = SimpleNamespace(index=0, ranks=[0, 1], rank=0, calls=7)
    with collective_label("DistributedModel.fit"), \
            collective_label("the per-step batch agreement", api=False):
        mine = signature("allgather_obj")
    with collective_label("DistributedModel.save"):
        theirs = signature("allgather_obj")
    assert mine == ("allgather_obj", "DistributedModel.fit", "the per-step batch agreement")
    same_call(group, mine, {0: mine, 1: mine})  # the same call: nothing raised
    with pytest.raises(CommError, match=re.escape(
            "call #7 of the world group differs between ranks. Received: this rank (world rank "
            "0) is in allgather_obj #7 on the world group in DistributedModel.fit (the per-step "
            "batch agreement); world rank 1 is in allgather_obj #7 on the world group in "
            "DistributedModel.save. Fix: call tfsmp's collective APIs")):
        same_call(group, mine, {0: mine, 1: theirs})


def test_a_step_that_fails_partway_ends_the_job_unless_raised_alike(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: a step that fails partway]: outside a multi-rank job, or for an error every rank
    raises alike (`alike`, `echo`), `end_partway` returns and the caller raises; otherwise it
    reports the exception with the note and the script's own frames, then ends the job."""
    ended: list[tuple[type, str, list[str]]] = []

    def report(kind, exc, tb):  # type: ignore[no-untyped-def]
        import traceback
        ended.append((kind, "".join(exc.__notes__), [f.name for f in traceback.extract_tb(tb)]))

    monkeypatch.setattr(failure, "_report", report)

    def deep() -> None:
        raise RuntimeError("a layer's assertion")

    def step() -> None:
        try:
            deep()
        except Exception as e:
            failure.end_partway(e, "training step")
            raise

    monkeypatch.setattr(failure, "_mpi_world_size", lambda: 1)
    with pytest.raises(RuntimeError):
        step()
    assert ended == []
    monkeypatch.setattr(failure, "_mpi_world_size", lambda: 2)
    for shared in (failure.alike(StepError("non-finite, on every rank")),
                   failure.echo(StepError("rank 1 failed"), origin=1)):
        assert failure.raised_alike(shared)
        failure.end_partway(shared)
    assert ended == []
    failure.end_partway(KeyboardInterrupt())  # not an Exception: raised as before
    assert ended == []
    with pytest.raises(RuntimeError):
        step()  # `_report` (patched) would have ended the job
    (kind, note, frames), = ended
    assert kind is RuntimeError
    assert note == failure.PARTWAY.format(what="training step")
    assert "left a training step partway" in note
    # the whole stack: this test's own frame, then step, then deep
    assert frames[-2:] == ["step", "deep"]
    assert "test_a_step_that_fails_partway_ends_the_job_unless_raised_alike" in frames
    short = failure.format_short(failure.alike(StepError("bad")), "rank 0 | pp_rank 0")
    assert short == "[rank 0 | pp_rank 0] StepError: bad\n"
    noted = StepError("bad")
    noted.add_note("why")
    assert failure.format_short(noted, "t") == "[t] StepError: bad\n[t] why\n"
