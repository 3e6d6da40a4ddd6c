"""The estimator's `max_retry_attempts`: which failed attempts run again, and what the log says.

Example::

    env = attempt_env(job_dir, attempt)          # the attempt's restart records, for the ranks
    decision = decide(returncode, log_text, env, attempt, max_retry_attempts, previous)
    decision.retry, decision.line                # True, "tfsmp: attempt 1 of 2 failed: ..."

[Note: retry strategy] SageMaker's ``max_retry_attempts`` (1-30) runs a training job again
when the *infrastructure* fails: an instance lost or reclaimed, a process killed from outside
— its ``InternalServerError`` — never for an error the training script raised (an
``AlgorithmError``, which would fail again). A local job reads the same line from what an
attempt left: a process that exited on a signal (Open MPI's ``exited on signal``), a host that
went away, or ranks that stopped for a preemption (exit code 75, [Note: preemption] in
tfsmp/runtime/preemption.py) are retried; a Python exception is not. As with `tfsmp run
--max-restarts`, a failure that repeats at the same step with the same cause is not retried
again, and attempts are spaced by a growing wait. Each attempt writes the ranks' records to
``<job>/restarts/attempt-<k>`` ([Note: restart records] in tfsmp/relaunch.py) and gets its number
in ``TFSMP_RESTART_COUNT``; the checkpoint directory (``checkpoint_local_path`` /
``checkpoint_s3_uri``, `environment.checkpoint_dir`) is the same for every attempt, as managed
spot training restores it, so the script resumes from its checkpoint.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from tfsmp import relaunch
from tfsmp.errors import ConfigError
from tfsmp.launch.restart import Outcome, backoff, describe, repeats

__all__ = ["Decision", "attempt_env", "check_retry_attempts", "decide"]

# "prterun noticed that process rank 1 with PID 4242 on node algo-2 exited on signal 9 (Killed)."
_SIGNALLED = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on\s+signal "
                        r"(\d+) \(([^)]*)\)")
FIRST_WAIT = 1.0  # s before the first retry, doubled for each further one


def check_retry_attempts(value: object) -> int:
    """The SDK's ``max_retry_attempts`` (None: no retries) as a count.

    Raises:
        ConfigError: not an integer from 1 to 30 (SageMaker's RetryStrategy bounds).
    """
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 30:
        raise ConfigError(f"max_retry_attempts must be an integer from 1 to 30 (SageMaker's "
                          f"RetryStrategy). Received: max_retry_attempts={value!r}. Pass e.g. "
                          f"max_retry_attempts=1, or None for no retries.")
    return value


def attempt_env(job_dir: str, attempt: int) -> dict[str, str]:
    """The variables of attempt ``attempt`` (0, 1, ...): where its ranks leave their records."""
    directory = os.path.join(job_dir, "restarts", f"attempt-{attempt}")
    os.makedirs(directory, exist_ok=True)
    return {relaunch.RESTART_DIR_ENV: directory, relaunch.ATTEMPT_ENV: str(attempt)}


@dataclass(frozen=True)
class Decision:
    """Whether to run the job again, after how long, and the line the job log gets."""

    retry: bool
    wait: float
    line: str
    outcome: Outcome


def _outcome(returncode: int, output: str, records_dir: str) -> tuple[Outcome, bool]:
    """How the attempt ended, and whether the infrastructure (not the script) ended it."""
    records = relaunch.read_attempt(records_dir)
    failure = records.first_failure()
    signalled = _SIGNALLED.search(" ".join(output.split()))
    if signalled is not None and (failure is None or failure.cause.startswith("killed")):
        rank, host, number, name = signalled.groups()
        failure = relaunch.Failure(int(rank), host, f"killed by signal {number} ({name})")
    infrastructure = (returncode == relaunch.RELAUNCH_EXIT_CODE or signalled is not None
                      or (failure is not None and failure.cause.startswith("killed by signal")))
    return Outcome(returncode, failure, records.position()), infrastructure


def decide(returncode: int, output: str, env: dict[str, str], attempt: int,
           max_retry_attempts: int, previous: Outcome | None) -> Decision:
    """Whether attempt ``attempt`` (0, 1, ...), which ended with ``returncode`` and printed
    ``output``, runs again. See [Note: retry strategy]."""
    outcome, infrastructure = _outcome(returncode, output, env[relaunch.RESTART_DIR_ENV])
    total = 1 + max_retry_attempts
    head = f"tfsmp: attempt {attempt + 1} of {total} failed: {describe(outcome)}"
    if not infrastructure:
        return Decision(False, 0.0, f"{head}; an error of the training script is not retried "
                                    "(SageMaker retries only when the infrastructure fails)",
                        outcome)
    if attempt >= max_retry_attempts:
        return Decision(False, 0.0, f"{head}; no retry attempts left", outcome)
    if repeats(previous, outcome):
        return Decision(False, 0.0, f"{head}; it failed the same way at the same point before, "
                                    "so it is not retried again", outcome)
    wait = backoff(FIRST_WAIT, attempt + 1)
    return Decision(True, wait, f"{head}; retrying in {wait:g} s (max_retry_attempts="
                                f"{max_retry_attempts})", outcome)
