"""The relaunch loop of `tfsmp run --max-restarts` and the records ranks leave for it (pure).

The loop runs a stand-in for mpirun (a small Python script that writes the records a failing
rank would write and exits with the attempt's code), so every decision — relaunch, wait, give
up, drop a lost host — is checked without TensorFlow or MPI; tests/mpi/test_resume.py runs the
real thing.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tfsmp import relaunch
from tfsmp.errors import ConfigError
from tfsmp.launch.hosts import HostSlots
from tfsmp.launch.restart import (
    Outcome,
    Relauncher,
    backoff,
    describe,
    relaunch_argv,
    repeats,
    shrink,
)

KILLED = relaunch.Failure(1, "algo-2", "killed by signal 9 (SIGKILL)", 10.0)
AT_5 = {"epoch": 0, "step": 5}

# A stand-in for mpirun: `python fake.py NP PLAN REPO [ARGS]` (NP where mpirun's -np count is, so
# that a relaunch rewrites it) writes the records a failing rank would and exits with the code
# PLAN gives the attempt; it prints its NP and ARGS.
FAKE = """
import json, os, sys
plan = json.loads(sys.argv[2])[int(os.environ["TFSMP_RESTART_COUNT"])]
os.environ["OMPI_COMM_WORLD_RANK"] = "1"
sys.path.insert(0, sys.argv[3])
from tfsmp import relaunch
if plan.get("position"):
    relaunch.publish_progress(plan["position"])
if plan.get("cause"):
    relaunch.record_failure("rank 1", plan["cause"], host="algo-2")
for rank in plan.get("started", []):
    relaunch.record_rank_event("start", str(rank))
for rank in plan.get("exited", []):
    relaunch.record_rank_event("exit", str(rank), 0)
print("ARGV", json.dumps([sys.argv[1], *sys.argv[4:]]))
sys.exit(plan["code"])
"""


def _fake_argv(tmp_path: Path, plan: list[dict[str, object]], *rest: str) -> list[str]:
    script = tmp_path / "fake_mpirun.py"
    script.write_text(FAKE)
    return [sys.executable, str(script), "4", json.dumps(plan),
            str(Path(__file__).resolve().parents[2]), *rest]


def _relauncher(argv: list[str], said: list[str], waits: list[float], **kw: object) -> Relauncher:
    defaults: dict[str, object] = dict(hosts=[], np=2, partitions=2, max_restarts=3,
                                       first_backoff=0.5, sleep=waits.append, say=said.append)
    defaults.update(kw)
    return Relauncher(argv, **defaults)  # type: ignore[arg-type]


def test_backoff_doubles_up_to_its_cap() -> None:
    assert [backoff(1.0, r) for r in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert backoff(1.0, 20) == 60.0 and backoff(0.0, 3) == 0.0


def test_each_restart_line_names_the_rank_its_host_where_and_why() -> None:
    assert describe(Outcome(137, KILLED, AT_5)) == (
        "rank 1 on host algo-2 failed after 5 steps of epoch 0: killed by signal 9 (SIGKILL)")
    assert describe(Outcome(137, None, None)) == (
        "a rank failed before its first step (mpirun exit code 137; no rank left a record)")
    preempted = relaunch.Failure(0, "vm", "preempted (SIGTERM); backup written")
    assert describe(Outcome(75, preempted, {"epoch": 1, "step": 1})) == (
        "rank 0 on host vm stopped after 1 step of epoch 1: preempted (SIGTERM); backup written")
    assert describe(Outcome(1, None, AT_5, ("algo-2",))) == (
        "the job failed after 5 steps of epoch 0 (mpirun exit code 1); host algo-2 lost (not "
        "reachable)")


def test_a_failure_repeats_only_at_the_same_point_with_the_same_cause() -> None:
    first = Outcome(137, KILLED, AT_5)
    assert repeats(first, Outcome(137, KILLED, dict(AT_5)))
    assert not repeats(None, first)
    assert not repeats(first, Outcome(137, KILLED, {"epoch": 0, "step": 6}))
    other = relaunch.Failure(1, "algo-2", "RuntimeError: boom", 11.0)
    assert not repeats(first, Outcome(1, other, AT_5))
    assert not repeats(Outcome(75, None, AT_5), Outcome(75, None, AT_5))  # preemptions


def test_fewer_hosts_keep_whole_pipeline_replicas() -> None:
    hosts = [HostSlots("algo-1", 2), HostSlots("algo-2", 2)]
    assert shrink(hosts[:1], 4, 2) == 2
    assert shrink([HostSlots("algo-1", 3)], 4, 2) == 2      # not 3: half a replica
    assert shrink([HostSlots("algo-1", None)], 4, 2) == 4   # slots unknown: Open MPI decides
    with pytest.raises(ConfigError, match=r"at least one pipeline replica.*partitions=4.*2 slots"):
        shrink(hosts[:1], 8, 4)


def test_a_relaunch_command_names_the_hosts_left_and_the_new_count() -> None:
    argv = ["mpirun", "-np", "4", "--tag-output", "--hostfile", "h.txt", "-x", "A", "python",
            "t.py", "--host", "keep"]
    assert relaunch_argv(argv, [HostSlots("algo-1", 2)], 2) == [
        "mpirun", "-np", "2", "--tag-output", "--host", "algo-1:2", "-x", "A", "python", "t.py",
        "--host", "keep"]


def test_records_name_the_earliest_failure_and_the_furthest_position(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(relaunch.RESTART_DIR_ENV, str(tmp_path))
    for rank, step in ((0, 4), (1, 7)):
        monkeypatch.setenv("OMPI_COMM_WORLD_RANK", str(rank))
        relaunch.publish_progress({"epoch": 1, "step": step - 2})
        relaunch.publish_progress({"epoch": 1, "step": step})  # rewritten in place
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    relaunch.record_failure("rank 1", "killed by signal 9 (SIGKILL)\nmore", host="b", pid=7)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    relaunch.record_failure("rank 0", "RuntimeError: a consequence", host="a", pid=8)
    (tmp_path / "failure-9-9.json").write_text("{not json")  # a record cut short is skipped
    attempt = relaunch.read_attempt(str(tmp_path))
    assert attempt.position() == {"epoch": 1, "step": 7}
    first = attempt.first_failure()
    assert first is not None and (first.rank, first.host, first.cause) == (
        1, "b", "killed by signal 9 (SIGKILL)")


def test_nothing_is_written_without_a_launcher(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(relaunch.RESTART_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    relaunch.record_failure("rank 0", "boom")
    relaunch.publish_progress({"epoch": 0, "step": 1})
    assert os.listdir(tmp_path) == []


def test_the_loop_relaunches_a_failure_then_succeeds(tmp_path: Path) -> None:
    said: list[str] = []
    waits: list[float] = []
    plan = [{"code": 137, "cause": "killed by signal 9 (SIGKILL)", "position": AT_5},
            {"code": 75, "cause": "preempted (SIGTERM); backup written",
             "position": {"epoch": 1, "step": 2}},
            {"code": 0}]
    code = _relauncher(_fake_argv(tmp_path, plan), said, waits).run()
    assert code == 0 and waits == [0.5, 1.0]
    assert said == [
        "tfsmp run: restart 1 of 3 in 0.5 s: rank 1 on host algo-2 failed after 5 steps of "
        "epoch 0: killed by signal 9 (SIGKILL)",
        "tfsmp run: restart 2 of 3 in 1 s: rank 1 on host algo-2 stopped after 2 steps of "
        "epoch 1: preempted (SIGTERM); backup written"]


def test_the_loop_stops_when_restarts_are_used_up_or_a_failure_repeats(tmp_path: Path) -> None:
    said: list[str] = []
    boom = {"code": 1, "cause": "RuntimeError: bad sample", "position": AT_5}
    code = _relauncher(_fake_argv(tmp_path, [boom, boom, boom]), said, []).run()
    assert code == 1 and len(said) == 2
    assert said[1].startswith("tfsmp run: not restarting: the job failed again at the same "
                              "point with the same cause, so it is not transient: rank 1")
    said.clear()
    killed = {"code": 137, "cause": "killed by signal 9 (SIGKILL)"}
    code = _relauncher(_fake_argv(tmp_path, [killed, {**killed, "position": AT_5}]), said, [],
                       max_restarts=1).run()
    assert code == 137
    assert said[-1] == ("tfsmp run: not restarting (1 of 1 restarts used): rank 1 on host "
                        "algo-2 failed after 5 steps of epoch 0: killed by signal 9 (SIGKILL)")


def test_a_lost_host_is_dropped_and_the_job_relaunched_on_the_rest(tmp_path: Path,
                                                                    capfd: pytest.CaptureFixture[str]
                                                                    ) -> None:
    said: list[str] = []
    plan = [{"code": 1, "position": AT_5}, {"code": 0}]
    argv = _fake_argv(tmp_path, plan, "--host", "algo-1:2,algo-2:2")
    hosts = [HostSlots("algo-1", 2), HostSlots("algo-2", 2)]
    relauncher = _relauncher(argv, said, [], hosts=hosts, np=4,
                             probe=lambda h: h.name == "algo-1")
    capfd.readouterr()
    assert relauncher.run() == 0
    assert said == ["tfsmp run: restart 1 of 3 in 0.5 s: the job failed after 5 steps of epoch 0 "
                    "(mpirun exit code 1); host algo-2 lost (not reachable); relaunching on "
                    "algo-1:2 with 2 ranks"]
    runs = [json.loads(line[5:]) for line in capfd.readouterr().out.splitlines()
            if line.startswith("ARGV ")]
    assert runs == [["4", "--host", "algo-1:2,algo-2:2"], ["2", "--host", "algo-1:2"]]


def test_mpirun_exiting_0_after_losing_a_host_is_not_taken_for_success(tmp_path: Path) -> None:
    # [Note: lost daemons] in tfsmp/relaunch.py: Open MPI 5 exits 0 when a whole host dies.
    said: list[str] = []
    lost = {"code": 0, "started": [0, 1, 2, 3], "exited": [], "position": AT_5}
    plan = [lost, {"code": 0, "started": [0, 1], "exited": [0, 1]}]
    argv = _fake_argv(tmp_path, plan, "--host", "algo-1:2,algo-2:2")
    hosts = [HostSlots("algo-1", 2), HostSlots("algo-2", 2)]
    code = _relauncher(argv, said, [], hosts=hosts, np=4, probe=lambda h: h.name == "algo-1").run()
    assert code == 0
    assert said == ["tfsmp run: restart 1 of 3 in 0.5 s: a rank failed after 5 steps of epoch 0: "
                    "mpirun exited with status 0 but rank(s) [0, 1, 2, 3] never finished; host "
                    "algo-2 lost (not reachable); relaunching on algo-1:2 with 2 ranks"]
    said.clear()  # records that not every host shares (no start from some rank): the hosts
    plan = [{"code": 0, "started": [0]}, {"code": 0, "started": [0]}]  # are probed, as mpirun's 0
    probes: list[str] = []                                              # may hide a lost one

    def probe(host: HostSlots) -> bool:
        probes.append(host.name)
        return len(probes) > 2 or host.name == "algo-1"

    assert _relauncher(_fake_argv(tmp_path, plan, "--host", "algo-1:2,algo-2:2"), said, [],
                       hosts=hosts, np=4, probe=probe).run() == 0
    assert said == ["tfsmp run: restart 1 of 3 in 0.5 s: a rank failed before its first step: "
                    "mpirun exited with status 0 after losing a host; host algo-2 lost (not "
                    "reachable); relaunching on algo-1:2 with 2 ranks"]
    said.clear()  # on one host, mpirun's 0 is trusted when the records cannot tell
    assert _relauncher(_fake_argv(tmp_path, [{"code": 0, "started": [0]}]), said, []).run() == 0
    assert said == []


# -- the estimator's max_retry_attempts ([Note: retry strategy] in tfsmp/estimator/retry.py) -----

KILLED_LOG = ("[1,0]<stdout>: step\nprterun noticed that process rank 1 with PID 4242 on node "
              "algo-1 exited on\nsignal 9 (Killed).\n")


def _records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cause: str | None = None
             ) -> dict[str, str]:
    from tfsmp.estimator.retry import attempt_env

    env = attempt_env(str(tmp_path), 0)
    monkeypatch.setenv(relaunch.RESTART_DIR_ENV, env[relaunch.RESTART_DIR_ENV])
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    relaunch.publish_progress(AT_5)
    if cause:
        relaunch.record_failure("rank 0", cause, host="algo-1")
    return env


def test_the_estimator_retries_a_killed_rank_and_a_preemption(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tfsmp.estimator.retry import decide

    env = _records(tmp_path, monkeypatch)
    d = decide(137, KILLED_LOG, env, 0, 2, None)
    assert d.retry and d.wait == 1.0
    assert d.line == ("tfsmp: attempt 1 of 3 failed: rank 1 on host algo-1 failed after 5 steps "
                      "of epoch 0: killed by signal 9 (Killed); retrying in 1 s "
                      "(max_retry_attempts=2)")
    assert decide(75, "", env, 1, 2, None).retry  # ranks stopped for a preemption
    assert not decide(137, KILLED_LOG, env, 2, 2, None).retry  # none left
    again = decide(137, KILLED_LOG, env, 1, 2, d.outcome)
    assert not again.retry and again.line.endswith("it failed the same way at the same point "
                                                   "before, so it is not retried again")


def test_the_estimator_does_not_retry_an_error_of_the_script(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tfsmp.estimator.retry import decide

    env = _records(tmp_path, monkeypatch, cause="ValueError: boom on rank 0")
    d = decide(1, "[1,0]<stderr>: Traceback ...\n", env, 0, 2, None)
    assert not d.retry
    assert d.line == ("tfsmp: attempt 1 of 3 failed: rank 0 on host algo-1 failed after 5 steps "
                      "of epoch 0: ValueError: boom on rank 0; an error of the training script is "
                      "not retried (SageMaker retries only when the infrastructure fails)")


@pytest.mark.parametrize("value", [0, 31, True, "1", 1.0])
def test_max_retry_attempts_is_an_integer_from_1_to_30(value: object) -> None:
    from tfsmp.estimator.retry import check_retry_attempts

    with pytest.raises(ConfigError, match=r"max_retry_attempts must be an integer from 1 to 30 "
                                          r"\(SageMaker's RetryStrategy\)\. Received: "):
        check_retry_attempts(value)
    assert check_retry_attempts(None) == 0 and check_retry_attempts(30) == 30


def test_tfsmp_run_with_restarts_guards_every_rank(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from tfsmp.launch import cli

    for name in (relaunch.RESTART_DIR_ENV, relaunch.ATTEMPT_ENV):
        monkeypatch.delenv(name, raising=False)  # prepare_environ sets them for the ranks
    assert cli.main(["run", "-np", "2", "--max-restarts", "1", "--dry-run", "t.py"]) == 0
    assert "-m tfsmp.launch.rankguard" in capsys.readouterr().out  # deaths by signal recorded
    assert cli.main(["run", "-np", "2", "--dry-run", "t.py"]) == 0
    assert "rankguard" not in capsys.readouterr().out  # without restarts: as before
