"""`tfsmp run --max-restarts N`: after a failure, end the job and relaunch every rank (torchrun's model).

Example::

    tfsmp run -np 4 --max-restarts 3 --config '{"partitions": 2}' train.py
    # tfsmp run: restart 1 of 3 in 1 s: rank 3 on host algo-2 failed after 40 steps of epoch 1:
    #   killed by signal 9 (SIGKILL)

The script resumes from its own checkpoint (Keras's or tfsmp's `BackupAndRestore`, a
`CheckpointManager`), as under torchrun. What the launcher does between attempts:

* *Says why, once.* One line per restart names the failed rank, its host, where training was
  and the cause, from the records the ranks leave ([Note: restart records] in tfsmp/relaunch.py).
* *Waits longer each time.* ``--restart-backoff`` seconds before the first relaunch, doubled
  for each further one, at most `MAX_BACKOFF`.
* *Stops a failure that repeats.* When an attempt fails at the same position with the same
  cause as the one before (a bad sample, a bug, an OOM at one step), relaunching cannot help:
  it is reported and the job ends with its exit code.
* *Relaunches a preemption.* Ranks that stopped for a preemption notice exit with code 75 after
  their checkpoint ([Note: preemption] in tfsmp/runtime/preemption.py); that counts as a restart.
  A SIGTERM (SIGINT, SIGHUP) to the launcher itself is relayed to the ranks as SIGUSR1 (mpirun
  kills a job on SIGTERM but forwards SIGUSR1): they checkpoint and exit 75, and the launcher
  exits 75 without relaunching — it is the one being stopped. A second signal, or the end of
  ``--stop-grace``, stops mpirun at once ([Note: the launcher owns its job] in
  tfsmp/launch/ownjob.py, as for every `tfsmp run`).
* *Goes on without a lost host.* Across hosts, each host is probed (`mpirun --host H -np 1`,
  the job's own transport) after a failure; hosts that do not answer are dropped, and the job is
  relaunched on the rest with the largest multiple of ``partitions`` ranks that fits — whole
  pipeline replicas, fewer of them — from the same checkpoint, which restores under any number
  of replicas (docs/checkpoints.md). ``fit``'s ``batch_size`` is the global batch, split over
  the replicas, so it keeps its meaning (docs/resume.md, "A lost host").

Pure: imports neither TensorFlow nor mpi4py.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tfsmp import relaunch
from tfsmp.errors import ConfigError
from tfsmp.launch.hosts import HostSlots, total_slots
from tfsmp.launch.output import run_filtered

__all__ = ["MAX_BACKOFF", "Outcome", "Relauncher", "add_arguments", "backoff", "describe",
           "prepare_environ", "relaunch_argv", "repeats", "run", "shrink"]

MAX_BACKOFF = 60.0   # s, the longest wait between attempts
PROBE_TIMEOUT = 30.0  # s, a host that does not run `python -c pass` in this time is lost


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The restart options of `tfsmp run`."""
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="relaunch every rank up to N times after a failure or preemption; the "
                        "script resumes from its checkpoint (torchrun's option; default 0)")
    p.add_argument("--restart-backoff", type=float, default=1.0, metavar="SECONDS",
                   help="wait before the first relaunch, doubled for each further one "
                        f"(at most {MAX_BACKOFF:g} s; default 1)")
    p.add_argument("--restart-dir", metavar="DIR",
                   help="where ranks leave their failure records (across hosts: a directory "
                        "every host sees; default: a temporary directory on this host)")


def backoff(first: float, restart: int) -> float:
    """Seconds to wait before relaunch number ``restart`` (1, 2, ...)."""
    return min(first * 2 ** max(restart - 1, 0), MAX_BACKOFF) if first > 0 else 0.0


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended."""

    code: int
    failure: relaunch.Failure | None = None
    position: dict[str, Any] | None = None
    lost_hosts: tuple[str, ...] = ()

    @property
    def preempted(self) -> bool:
        return self.code == relaunch.RELAUNCH_EXIT_CODE

    @property
    def cause(self) -> str:
        if self.failure is not None:
            return self.failure.cause
        return "preempted" if self.preempted else f"mpirun exited with code {self.code}"


def describe(outcome: Outcome) -> str:
    """One line: who failed, where, how far training got, and why."""
    where = relaunch.format_position(outcome.position)
    lost = (f"; host{'s' if len(outcome.lost_hosts) > 1 else ''} "
            f"{', '.join(outcome.lost_hosts)} lost (not reachable)" if outcome.lost_hosts else "")
    failure = outcome.failure
    if failure is not None:
        who = f"rank {failure.rank}" if failure.rank is not None else "a rank"
        who += f" on host {failure.host}" if failure.host not in ("", "?") else ""
        verb = "stopped" if outcome.preempted else "failed"
        return f"{who} {verb} {where}: {failure.cause}{lost}"
    if outcome.preempted:
        return f"the ranks stopped for a preemption {where} (exit code {outcome.code}){lost}"
    if outcome.lost_hosts:
        return f"the job failed {where} (mpirun exit code {outcome.code}){lost}"
    return (f"a rank failed {where} (mpirun exit code {outcome.code}; no rank left a "
            f"record)")


def repeats(previous: Outcome | None, now: Outcome) -> bool:
    """Whether ``now`` is ``previous`` again: same position, same cause (a preemption never)."""
    if previous is None or now.preempted or previous.preempted:
        return False
    return previous.position == now.position and previous.cause == now.cause


def shrink(hosts: Sequence[HostSlots], np: int, partitions: int) -> int:
    """The ranks to relaunch on ``hosts``: at most ``np`` and their slots, whole replicas.

    Raises:
        ConfigError: the hosts cannot hold one pipeline replica.
    """
    slots = total_slots(hosts)
    fit = np if slots is None else min(np, slots)
    fit -= fit % partitions
    if fit < partitions:
        raise ConfigError(
            f"a relaunch needs at least one pipeline replica (partitions ranks). Received: "
            f"partitions={partitions}, the hosts left ({','.join(map(str, hosts)) or 'none'}) "
            f"hold {slots} slots. Fix: bring hosts back, or relaunch with fewer partitions.")
    return fit


def relaunch_argv(argv: Sequence[str], hosts: Sequence[HostSlots], np: int) -> list[str]:
    """``argv`` (an mpirun command of `build_mpirun_command`) on ``hosts`` with ``np`` ranks.

    The builder's layout is ``mpirun -np N ... [--host H | --hostfile F] ...``: the count is the
    third word, and the first host option (before any of the user's flags) is replaced.
    """
    out = list(argv)
    out[2] = str(np)
    text = ",".join(map(str, hosts))
    for i, word in enumerate(out):
        if word in ("--host", "--hostfile"):
            out[i:i + 2] = ["--host", text]
            break
    return out


def prepare_environ(args: argparse.Namespace, environ: dict[str, str] | None = None) -> None:
    """Puts the restart variables into the launcher's environment before the mpirun command is
    built, so that a multi-host launch exports them (`-x NAME`) and each attempt's values reach
    every rank through mpirun's environment."""
    if not getattr(args, "max_restarts", 0):
        return
    env = os.environ if environ is None else environ
    env.setdefault(relaunch.RESTART_DIR_ENV, "")
    env.setdefault(relaunch.ATTEMPT_ENV, "0")


@dataclass
class Relauncher:
    """Runs mpirun until it succeeds, the restarts are used up, or a failure repeats."""

    argv: list[str]
    hosts: list[HostSlots]
    np: int
    partitions: int
    max_restarts: int
    first_backoff: float = 1.0
    base_dir: str | None = None
    probe: Callable[[HostSlots], bool] | None = None
    tf_logs: bool = False
    grace: float | None = None  # s for a backup after a stop signal (ownjob.grace_seconds)
    sleep: Callable[[float], None] = time.sleep
    say: Callable[[str], None] = field(default=lambda text: print(text, file=sys.stderr,
                                                                 flush=True))
    stopping: bool = False

    def run(self) -> int:
        """Returns the exit code of the last attempt."""
        base, owned = self._base_dir()
        try:
            return self._loop(base)
        finally:
            if owned:
                shutil.rmtree(base, ignore_errors=True)

    def _base_dir(self) -> tuple[str, bool]:
        if self.base_dir:
            os.makedirs(self.base_dir, exist_ok=True)
            return self.base_dir, False
        return tempfile.mkdtemp(prefix="tfsmp-restarts-"), True

    def _loop(self, base: str) -> int:
        argv, restarts, previous = list(self.argv), 0, None
        while True:
            attempt = os.path.join(base, f"attempt-{restarts}")
            os.makedirs(attempt, exist_ok=True)
            code = self._mpirun(argv, {relaunch.RESTART_DIR_ENV: attempt,
                                       relaunch.ATTEMPT_ENV: str(restarts)})
            if self.stopping:
                return code
            records = relaunch.read_attempt(attempt)
            unfinished = records.unfinished(self.np) if code == 0 else None
            lost = self._lost(code, unfinished)
            if code == 0 and not unfinished and not lost:
                return code
            outcome = self._outcome(code, records, unfinished, lost)
            code = code or 1  # [Note: lost daemons] in tfsmp/relaunch.py: not a success
            if restarts >= self.max_restarts:
                self.say(f"tfsmp run: not restarting ({restarts} of {self.max_restarts} restarts "
                         f"used): {describe(outcome)}")
                return code
            if repeats(previous, outcome):
                self.say(f"tfsmp run: not restarting: the job failed again at the same point "
                         f"with the same cause, so it is not transient: {describe(outcome)}")
                return code
            if outcome.lost_hosts:
                left = [h for h in self.hosts if h.name not in outcome.lost_hosts]
                try:
                    self.np = shrink(left, self.np, self.partitions)
                except ConfigError as e:
                    self.say(f"tfsmp run: not restarting: {describe(outcome)}: {e}")
                    return code
                self.hosts, argv = left, relaunch_argv(argv, left, self.np)
            restarts += 1
            wait = backoff(self.first_backoff, restarts)
            fewer = (f"; relaunching on {','.join(map(str, self.hosts))} with {self.np} ranks"
                     if outcome.lost_hosts else "")
            self.say(f"tfsmp run: restart {restarts} of {self.max_restarts} in {wait:g} s: "
                     f"{describe(outcome)}{fewer}")
            self.sleep(wait)
            previous = outcome

    def _lost(self, code: int, unfinished: list[int] | None) -> tuple[str, ...]:
        """The hosts that no longer answer, probed after a failure across hosts — and after
        mpirun's 0 when the records cannot tell whether every rank finished (not shared by
        every host): mpirun says 0 when a whole host dies ([Note: lost daemons])."""
        if len(self.hosts) < 2 or (code == 0 and unfinished == []):  # every rank finished
            return ()
        return tuple(self._lost_hosts())

    def _outcome(self, code: int, records: relaunch.Attempt, unfinished: list[int] | None,
                 lost: tuple[str, ...]) -> Outcome:
        failure = records.first_failure()
        if failure is None and code == 0:
            failure = relaunch.Failure(
                None, "", f"mpirun exited with status 0 but rank(s) {unfinished} never finished"
                if unfinished else "mpirun exited with status 0 after losing a host")
        return Outcome(code, failure, records.position(), lost)

    def _lost_hosts(self) -> list[str]:
        probe = self.probe
        if probe is None:
            return []
        answers: dict[str, bool] = {}

        def check(host: HostSlots) -> None:
            answers[host.name] = probe(host)

        threads = [threading.Thread(target=check, args=(h,), daemon=True) for h in self.hosts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(PROBE_TIMEOUT + 5)
        return [h.name for h in self.hosts if not answers.get(h.name, False)]

    def _mpirun(self, argv: list[str], extra: Mapping[str, str]) -> int:
        """Runs one attempt; a SIGTERM, SIGINT or SIGHUP to the launcher stops it gracefully
        ([Note: the launcher owns its job] in tfsmp/launch/ownjob.py) and ends the loop."""

        def stop() -> None:
            self.stopping = True

        return run_filtered(argv, tf_logs=self.tf_logs, env={**os.environ, **extra},
                            grace=self.grace, on_stop=stop)


def _partitions(config_json: str | None, np: int) -> int:
    """The job's partitions, read as its ranks will read them (`resolve_launch_options`)."""
    from tfsmp.config import load_config
    from tfsmp.launch.mpirun import CONFIG_ENV

    params = json.loads(config_json) if config_json else None
    environ = {k: v for k, v in os.environ.items() if not (params and k == CONFIG_ENV)}
    return int(load_config(params, environ=environ, world_size=np).partitions)


def _probe(args: argparse.Namespace, argv: Sequence[str]) -> Callable[[HostSlots], bool]:
    """Whether mpirun can start a process on a host, through the job's own launch options."""
    from tfsmp.launch.mpirun import build_mpirun_command

    interface = None
    if "--mca" in argv:
        words = list(argv)
        for i in range(len(words) - 2):
            if words[i] == "--mca" and words[i + 1] == "btl_tcp_if_include":
                interface = words[i + 2]
    extra = shlex.split(getattr(args, "mpi_args", None) or "")

    def probe(host: HostSlots) -> bool:
        cmd = build_mpirun_command(1, ["-c", "pass"], hosts=[f"{host.name}:1"],
                                   use_mpi4py_module=False, tag_output=False, mpirun=argv[0],
                                   network_interface=interface, extra_mpi_args=extra)
        try:
            done = subprocess.run(cmd, capture_output=True, timeout=PROBE_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0

    return probe


def run(args: argparse.Namespace, argv: list[str], hosts: list[HostSlots], np: int,
        config_json: str | None, tf_logs: bool = False) -> int:
    """`tfsmp run` with ``--max-restarts``: ``argv`` is the first attempt's mpirun command."""
    if args.max_restarts < 0 or args.restart_backoff < 0:
        print(f"tfsmp run: error: --max-restarts and --restart-backoff must be >= 0. Received: "
              f"max_restarts={args.max_restarts}, restart_backoff={args.restart_backoff}.",
              file=sys.stderr)
        return 2
    relauncher = Relauncher(
        argv, list(hosts), np, _partitions(config_json, np), args.max_restarts,
        first_backoff=args.restart_backoff, base_dir=getattr(args, "restart_dir", None),
        probe=_probe(args, argv) if len(hosts) > 1 else None, tf_logs=tf_logs,
        grace=getattr(args, "stop_grace", None))
    return relauncher.run()
