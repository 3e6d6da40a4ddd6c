"""One training job on this machine: its processes, log, time limit, relaunch, status and artifacts."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tfsmp.estimator import retry
from tfsmp.estimator.artifacts import (
    Snapshot,
    empty_model_message,
    end_lines,
    model_report,
    snapshot,
)
from tfsmp.estimator.failure_report import Failure, find_failure
from tfsmp.estimator.layout import archive_dir, write_json
from tfsmp.estimator.plan import JobPlan
from tfsmp.launch import ownjob
from tfsmp.launch import sagemaker as sm
from tfsmp.launch.mpirun import fresh_session, job_tmpdir, launcher_never_started
from tfsmp.launch.output import OutputFilter, tf_logs_wanted

__all__ = ["LocalTrainingJob", "UnexpectedStatusException"]


def _caller_stacklevel() -> int:
    """The `stacklevel` of the first frame outside tfsmp: a warning then names the user's line
    (`est.fit()` or `job.wait()`), however deep inside tfsmp it is raised."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level  # level 1: the frame that calls warn() (and this function)


class UnexpectedStatusException(ValueError):
    """A training job ended in a status other than Completed or Stopped (the SDK's exception).

    Besides the SDK's `allowed_statuses` and `actual_status` it carries where to look:
    `failed_rank`, `exit_code`, `job_dir` and `log_path` (the whole, rank-tagged log).
    """

    def __init__(self, message: str, allowed_statuses: Sequence[str], actual_status: str, *,
                 failed_rank: int | None = None, exit_code: int | None = None,
                 job_dir: str | None = None, log_path: str | None = None) -> None:
        super().__init__(message)
        self.allowed_statuses = list(allowed_statuses)
        self.actual_status = actual_status
        self.failed_rank = failed_rank
        self.exit_code = exit_code
        self.job_dir = job_dir
        self.log_path = log_path


class _StopSignal(BaseException):
    """A SIGTERM or SIGHUP to the process that waits for a job (as KeyboardInterrupt for SIGINT)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _stop_signals_raise() -> Iterator[None]:
    """While a job is waited for in the main thread, SIGTERM and SIGHUP stop it, as Ctrl-C does:
    the job runs in sessions of its own, so without this the signal would end this process and
    leave every rank running ([Note: the launcher owns its job] in tfsmp/launch/ownjob.py)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: object) -> None:
        raise _StopSignal(signum)

    previous = {}
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) in (signal.SIG_DFL, None):
            previous[signum] = signal.signal(signum, handle)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


@dataclass
class LocalTrainingJob:
    """A training job running (or run) on this machine; `estimator.latest_training_job`.

    Example::

        job = est.latest_training_job
        job.wait()                       # after fit(wait=False)
        job.describe()["TrainingJobStatus"]
    """

    plan: JobPlan
    max_run: float
    output_path: str
    compress: bool = True
    status: str = "InProgress"
    secondary_status: str = "Starting"
    failure_reason: str | None = None
    failure: Failure | None = None
    returncode: int | None = None
    start_time: float = field(default_factory=time.time)
    end_time: float | None = None
    _procs: list[subprocess.Popen[str]] = field(default_factory=list, repr=False)
    _threads: list[threading.Thread] = field(default_factory=list, repr=False)
    _log: IO[str] | None = field(default=None, repr=False)
    _timer: threading.Timer | None = field(default=None, repr=False)
    _timed_out: bool = False
    _finished: bool = False
    _relaunches: int = 0
    _echo: bool = False
    _log_start: int = 0
    # fit(logs="All"): the console also shows mpirun's job map and TensorFlow's start-up lines
    # (job.log always has them). [Note: quiet start-up] in tfsmp/launch/output.py
    show_all: bool = False
    _before: Snapshot | None = field(default=None, repr=False)  # the job directory at the start
    max_retry_attempts: int = 0  # [Note: retry strategy] in tfsmp/estimator/retry.py
    attempt: int = 0
    _attempt_env: dict[str, str] = field(default_factory=dict, repr=False)
    _previous: Any = None
    # each launch's temp folder, removed once its processes are gone ([Note: a job's temp
    # folder] in tfsmp/launch/mpirun.py; a SageMaker container's /tmp ends with the container)
    _temps: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False)

    @property
    def job_name(self) -> str:
        return self.plan.name

    @property
    def job_dir(self) -> str:
        return self.plan.paths.base

    @property
    def log_path(self) -> str:
        return os.path.join(self.job_dir, "job.log")

    @property
    def command(self) -> list[str]:
        """The (first) launched command."""
        return self.plan.commands[0]

    @property
    def model_data(self) -> str | None:
        if self.status not in ("Completed", "Stopped"):
            return None
        if not self.compress:
            return f"file://{self.plan.paths.model}/"
        return f"file://{self.job_dir}/model.tar.gz"

    def start(self, logs: bool) -> None:
        """Launches the command(s); output goes to job.log (and to stdout if `logs`)."""
        self._echo = logs
        if self._before is None:
            self._before = snapshot(self.job_dir)
        self._log_start = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        self._procs, self._threads = [], []
        log = self._log = open(self.log_path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - wait() closes it
        lock = threading.Lock()
        self._attempt_env = retry.attempt_env(self.job_dir, self.attempt)
        if self.max_retry_attempts:  # the log shows every attempt
            self._say(f"tfsmp: training job {self.job_name}, attempt {self.attempt + 1} of "
                      f"{1 + self.max_retry_attempts}", log)
        tags = [f"[{host}] " for host in self.plan.hosts] if not self.plan.mpi and \
            len(self.plan.commands) > 1 else [""] * len(self.plan.commands)
        across = bool(self.plan.host_paths)  # other machines' ranks keep their own temp folders
        for argv, extra, tag in zip(self.plan.commands, self.plan.host_env, tags):
            temp = ({} if across or "TMPDIR" in extra
                    else {"TMPDIR": self._temps.enter_context(job_tmpdir())})
            proc = subprocess.Popen(
                fresh_session(argv), cwd=self.plan.paths.code, env={**self.plan.env, **extra,
                                                     **self._attempt_env, **temp}, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                errors="replace")
            self._procs.append(proc)
            keep = OutputFilter(tf_logs=self.show_all or tf_logs_wanted(self.plan.env)
                                or tf_logs_wanted(), job_map=self.show_all)
            thread = threading.Thread(target=self._pump, args=(proc, log, lock, tag, logs, keep),
                                      daemon=True)
            thread.start()
            self._threads.append(thread)
        self.secondary_status = "Training"
        timer = threading.Timer(self.max_run, self._on_timeout)
        timer.daemon = True
        timer.start()
        self._timer = timer

    def _pump(self, proc: subprocess.Popen[str], log: IO[str], lock: threading.Lock, tag: str,
              echo: bool, keep: OutputFilter) -> None:
        if proc.stdout is None:
            return
        for line in proc.stdout:
            with lock:
                log.write(tag + line)
                if echo:
                    sys.stdout.writelines(tag + shown for shown in keep.feed(line))
                    sys.stdout.flush()
        if echo:
            with lock:
                sys.stdout.writelines(tag + shown for shown in keep.close())

    def _on_timeout(self) -> None:
        self._timed_out = True
        self.stop()

    def stop(self) -> None:
        """Kills every process of the job (the SDK's `stop_training_job`): each launched
        command's whole session, since mpirun puts every rank in a process group of its own
        ([Note: the launcher owns its job] in tfsmp/launch/ownjob.py)."""
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            ownjob.kill_session(proc.pid)

    def wait(self, logs: bool = True) -> None:
        """Waits for the job to end, then writes its artifacts.

        Args:
            logs: The SDK's argument; output goes where `fit(logs=...)` sent it.

        Raises:
            UnexpectedStatusException: The job failed; the message names the failing rank and its
                error, as SageMaker's FailureReason does.
        """
        try:
            with _stop_signals_raise():
                for thread in self._threads:
                    while thread.is_alive():
                        thread.join(0.2)
        except (KeyboardInterrupt, _StopSignal) as e:
            self.stop()
            for proc in self._procs:
                ownjob.sweep(proc.pid)
            self._temps.close()
            self._finish("Stopped", "Stopped")
            if isinstance(e, _StopSignal):
                raise SystemExit(128 + e.signum) from None
            raise
        if self._timer is not None:
            self._timer.cancel()
        if self._log is not None:
            self._log.close()
        codes = [p.wait() for p in self._procs]
        for proc in self._procs:  # what a job leaves behind does not outlive it
            ownjob.sweep(proc.pid)
        self._temps.close()
        self.returncode = next((c for c in codes if c != 0), 0)
        if self._relaunch() or self._retry():
            self.wait(logs)
            return
        if self._timed_out:
            self._finish("Stopped", "MaxRuntimeExceeded")
            warnings.warn(f"Training job {self.job_name} exceeded max_run={self.max_run:g} s and "
                          "was stopped; its model directory was archived as SageMaker does.",
                          UserWarning, stacklevel=2)
        elif self.returncode == 0:
            Path(self.plan.paths.output, "success").touch()  # as the toolkit's trainer does
            self._finish("Completed", "Completed")
        else:
            self._fail()
        self._report_end(logs)

    def _report_end(self, echo: bool) -> None:
        """Where the model went: end-of-job lines, and a warning if the model directory is empty
        ([Note: the empty model archive] in tfsmp/estimator/artifacts.py)."""
        report = model_report(self.job_dir, self.plan.paths.model, before=self._before or {})
        if report.empty:
            warnings.warn(empty_model_message(report, self.job_dir, self.plan.paths.model),
                          UserWarning, stacklevel=_caller_stacklevel())
        if echo:
            seconds = (self.end_time or time.time()) - self.start_time
            print("\n".join(end_lines(self.job_name, self.status, seconds, self.model_data,
                                      report, self.log_path)), flush=True)

    def _relaunch(self) -> bool:
        """Launches the job again if its MPI launcher died before any rank ran ([Note: launcher
        start-up failures] in tfsmp/launch/mpirun.py); at most twice."""
        if self._timed_out or self.returncode == 0 or self._relaunches >= 2 or not self.plan.mpi:
            return False
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            f.seek(self._log_start)
            attempt_output = f.read()
        if not launcher_never_started(self.returncode, attempt_output):
            return False
        self._relaunches += 1
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write("tfsmp: the MPI launcher failed before starting any rank (a transient Open "
                    "MPI start-up failure); launching the job again.\n")
        self.start(self._echo)
        return True

    def _say(self, line: str, log: IO[str] | None = None) -> None:
        """A line of the job's own in the job log (and on stdout when logs are echoed)."""
        if log is not None:
            log.write(line + "\n")
        else:
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        if self._echo:
            print(line, flush=True)

    def _retry(self) -> bool:
        """Runs the job again after an infrastructure failure, up to `max_retry_attempts`
        times ([Note: retry strategy] in tfsmp/estimator/retry.py)."""
        if self._timed_out or self.returncode == 0 or not self.max_retry_attempts:
            return False
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            f.seek(self._log_start)
            output = f.read()
        decision = retry.decide(int(self.returncode or 0), output, self._attempt_env,
                                self.attempt, self.max_retry_attempts, self._previous)
        self._say(decision.line)
        if not decision.retry:
            return False
        time.sleep(decision.wait)
        self._previous = decision.outcome
        self.attempt += 1
        self.secondary_status = "Restarting"
        self.start(self._echo)
        return True

    def _finish(self, status: str, secondary: str) -> None:
        if self._finished:
            return
        self._finished = True
        self.status, self.secondary_status, self.end_time = status, secondary, time.time()
        if status in ("Completed", "Stopped") and self.compress:
            archive_dir(self.plan.paths.model, os.path.join(self.job_dir, "model.tar.gz"))
            archive_dir(self.plan.paths.output_data, os.path.join(self.job_dir, "output.tar.gz"))
        write_json(os.path.join(self.job_dir, "job.json"), self.describe())

    def _fail(self) -> None:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            self.failure = find_failure(f)
        where = f"[rank {self.failure.rank}] " if self.failure.rank is not None else ""
        error = self.failure.error or f"exit code {self.returncode}"
        self.failure_reason = (
            f"AlgorithmError: ExecuteUserScriptError:\nExitCode {self.returncode}\n"
            f"ErrorMessage \"{where}{error}\"\nCommand \"{shlex.join(self.command)[:300]}\"")
        Path(self.plan.paths.output, "failure").write_text(self.failure_reason + "\n")
        self._finish("Failed", "Failed")
        tb = f"\n\n{self.failure.traceback}" if self.failure.traceback else ""
        raise UnexpectedStatusException(
            f"Error for Training job {self.job_name}: Failed. Reason: {self.failure_reason}{tb}"
            f"\n\nThe whole log, every line tagged with its rank: {self.log_path}",
            allowed_statuses=["Completed", "Stopped"], actual_status="Failed",
            failed_rank=self.failure.rank, exit_code=self.returncode, job_dir=self.job_dir,
            log_path=self.log_path)

    def describe(self) -> dict[str, Any]:
        """The SDK's `describe_training_job` fields that mean something locally."""
        out: dict[str, Any] = {
            "TrainingJobName": self.job_name,
            "TrainingJobStatus": self.status,
            "SecondaryStatus": self.secondary_status,
            "HyperParameters": sm.encode_hyperparameters(self.plan.hyperparameters),
            "ResourceConfig": {"InstanceType": self.plan.env.get("SM_CURRENT_INSTANCE_TYPE"),
                               "InstanceCount": len(self.plan.hosts)},
            "OutputDataConfig": {"S3OutputPath": self.output_path},
            "TrainingStartTime": self.start_time,
            "LocalJobDirectory": self.job_dir,
        }
        if self.end_time is not None:
            out["TrainingEndTime"] = self.end_time
        if self.model_data:
            out["ModelArtifacts"] = {"S3ModelArtifacts": self.model_data}
        if self.failure_reason:
            out["FailureReason"] = self.failure_reason
        if self.max_retry_attempts:
            out["RetryStrategy"] = {"MaximumRetryAttempts": self.max_retry_attempts}
            out["Attempts"] = self.attempt + 1
        return out
