"""`TensorFlow` and `Estimator`: the SageMaker SDK's estimators, running the training job on this machine.

Example::

    from tfsmp.estimator import TensorFlow, get_execution_role

    est = TensorFlow(entry_point="train.py", source_dir="src", role=get_execution_role(),
                     instance_count=1, instance_type="local", framework_version="2.21",
                     py_version="py311",
                     distribution={"smdistributed": {"modelparallel": {
                                       "enabled": True, "parameters": {"partitions": 2}}},
                                   "mpi": {"enabled": True, "processes_per_host": 2}})
    est.fit({"training": "data/"})       # or "data/", or "file:///abs/data"
    est.model_data                       # 'file:///tmp/tfsmp-jobs/<job>/model.tar.gz'

The launcher code of the AWS model-parallel page runs with its imports changed to these. A job
directory mirrors a training container's /opt/ml (`input/config/*.json`, `input/data/<channel>`,
`model/`, `output/`, `checkpoints/`, `code/`) and stays for inspection, beside `job.log` (every
rank's output, tagged), `mpi_command.txt`, `hostfile`, `job.json` and, after the job, the
artifacts `model.tar.gz` and `output.tar.gz`. See docs/estimator.md.
"""

from __future__ import annotations

import contextlib
import datetime
import difflib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tfsmp.errors import ConfigError
from tfsmp.launch import sagemaker as sm
from tfsmp.launch.hosts import default_interface, parse_hosts
from tfsmp.launch.mpirun import TAG_OUTPUT_PATTERN, find_mpirun, launcher_never_started

__all__ = ["Estimator", "LocalTrainingJob", "TensorFlow", "UnexpectedStatusException",
           "get_execution_role"]

LOCAL_ROLE = "arn:aws:iam::000000000000:role/tfsmp-local"

# SDK arguments that only shape the cloud job (cost, network, encryption, monitoring, where code is
# uploaded); locally they change nothing about the result, so they are accepted and ignored.
_IGNORED = frozenset({
    "keep_alive_period_in_seconds", "volume_size", "volume_kms_key", "output_kms_key", "tags",
    "subnets", "security_group_ids", "metric_definitions", "encrypt_inter_container_traffic",
    "use_spot_instances", "max_wait", "rules", "debugger_hook_config",
    "tensorboard_output_config", "enable_sagemaker_metrics", "profiler_config",
    "disable_profiler", "max_retry_attempts", "container_log_level", "code_location",
    "enable_network_isolation", "enable_infra_check", "enable_remote_debug",
    "enable_session_tag_chaining", "training_plan", "compiler_config", "script_mode",
    "training_repository_credentials_provider_arn",
})
# SDK arguments whose cloud behaviour would change what runs or what it reads.
_REJECTED = {
    "git_config": "clones the training code from a Git repository; clone it yourself and pass "
                  "source_dir",
    "instance_groups": "describes a heterogeneous cluster; use instance_count and instance_type",
    "container_entry_point": "replaces the image's entry point; put the command in entry_point",
    "container_arguments": "passes arguments to the image's entry point; use hyperparameters",
    "training_repository_access_mode": "pulls the image from a private registry; the job runs "
                                       "in this Python environment",
}
# Names the SDK v1 used, which SDK v2 still maps with a warning.
_RENAMED = {"train_instance_count": "instance_count", "train_instance_type": "instance_type",
            "train_max_run": "max_run", "image_name": "image_uri",
            "distributions": "distribution", "train_volume_size": "volume_size",
            "train_use_spot_instances": "use_spot_instances", "train_max_wait": "max_wait"}
_JOB_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
_CHANNEL = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def get_execution_role(sagemaker_session: Any = None, use_default: bool = False) -> str:
    """A placeholder IAM role ARN: a local job assumes no role. Accepts the SDK's arguments."""
    return LOCAL_ROLE


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


# ---------------------------------------------------------------------------------------------
# Facts about this machine.


def _local_gpus() -> int:
    """GPUs as the training toolkit counts them (`nvidia-smi --list-gpus`)."""
    try:
        out = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _tfsmp_root() -> str:
    return str(Path(__file__).resolve().parents[1])


# ---------------------------------------------------------------------------------------------
# Paths and inputs.


def _local_path(uri: Any, what: str) -> Path:
    """A local path or file:// URI as an absolute Path; s3:// and other schemes are errors."""
    if isinstance(uri, os.PathLike):
        uri = os.fspath(uri)
    if not isinstance(uri, str) or not uri:
        raise ConfigError(f"{what} must be a local path or a file:// URI. Received: {what}={uri!r}.")
    if uri.startswith("s3://"):
        raise ConfigError(
            f"{what} cannot be an S3 URI: this job runs on this machine and reads local files "
            f"only. Received: {what}={uri!r}. Copy the data here first (e.g. `aws s3 sync {uri} "
            "./data`) and pass the local path or a file:// URI.")
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    elif "://" in uri:
        raise ConfigError(f"{what} must be a local path or a file:// URI. Received: {what}={uri!r}.")
    return Path(uri).expanduser().resolve()


def _existing(uri: Any, what: str) -> Path:
    path = _local_path(uri, what)
    if not path.exists():
        raise ConfigError(f"{what} must exist. Received: {what}={uri!r} ({path} does not exist).")
    return path


def _input_uri(value: Any) -> Any:
    """The URI of an input: a str/path, or an SDK `TrainingInput` (its S3DataSource URI)."""
    config = getattr(value, "config", None)
    if isinstance(config, Mapping):
        source = config.get("DataSource", {})
        for kind in ("S3DataSource", "FileSystemDataSource"):
            if kind in source:
                return source[kind].get("S3Uri") or source[kind].get("DirectoryPath")
    return value


def resolve_channels(inputs: Any, model_uri: Any = None,
                     model_channel_name: str = "model") -> dict[str, Path]:
    """`fit(inputs)` as channel name -> local path, as the SDK names channels.

    A single input is the channel "training"; a dict names its channels; `model_uri` adds the
    model channel.

    Raises:
        ConfigError: An input is an S3 URI, does not exist, or a channel name is invalid.
    """
    if inputs is None:
        channels: dict[str, Any] = {}
    elif isinstance(inputs, Mapping):
        channels = dict(inputs)
    else:
        channels = {"training": inputs}
    if model_uri is not None:
        channels[model_channel_name] = model_uri
    resolved: dict[str, Path] = {}
    for name, value in channels.items():
        if not isinstance(name, str) or not _CHANNEL.match(name):
            raise ConfigError(f"channel names must match [A-Za-z0-9._-]{{1,64}}. Received: "
                              f"channel {name!r}.")
        resolved[name] = _existing(_input_uri(value), f"inputs[{name!r}]")
    return resolved


def _job_name(base: str, job_name: str | None) -> str:
    if job_name is None:
        now = datetime.datetime.now()
        stamp = now.strftime("%Y-%m-%d-%H-%M-%S-") + f"{now.microsecond // 1000:03d}"
        job_name = f"{base[:63 - len(stamp) - 1]}-{stamp}"
    if not _JOB_NAME.match(job_name):
        raise ConfigError(
            "job_name must be 1-63 letters, digits or hyphens, starting and ending with a letter "
            f"or digit (SageMaker's rule). Received: job_name={job_name!r}.")
    return job_name


# ---------------------------------------------------------------------------------------------
# Failure reports.

_TAGGED = re.compile(TAG_OUTPUT_PATTERN)
_PRTE_PROC = re.compile(r"Process name:\s+\[[^\]]*,(\d+)\]")
_RANK_TAG = re.compile(r"^\[rank \d+[^\]]*\] ?")


@dataclass(frozen=True)
class Failure:
    """What failed: the rank (None when unknown), its error line and traceback."""

    rank: int | None
    error: str
    traceback: str


def find_failure(lines: Iterable[str]) -> Failure:
    """Finds the failing rank and its error in a job log (`--tag-output` lines, or untagged).

    The first rank that printed a traceback wins (it is where the error began: the others were
    aborted); failing that, the rank Open MPI names as the first to exit non-zero.
    """
    stderr: dict[int | None, list[str]] = {}
    first_traceback: list[int | None] = []
    exited: int | None = None
    for line in lines:
        m = _TAGGED.match(line)
        rank: int | None = int(m.group(1)) if m else None
        if m and m.group(2) != "stderr":
            continue
        text = _RANK_TAG.sub("", m.group(3) if m else line.rstrip("\n"))
        stderr.setdefault(rank, []).append(text)
        if text.startswith("Traceback (most recent call last)") and rank not in first_traceback:
            first_traceback.append(rank)
        proc = _PRTE_PROC.search(text) if m is None else None
        if proc and exited is None:
            exited = int(proc.group(1))
    if not first_traceback:
        return Failure(exited, "", "")
    rank = first_traceback[0]
    error, tb = _last_exception(stderr[rank])
    return Failure(rank if rank is not None else exited, error, tb)


def _last_exception(lines: list[str]) -> tuple[str, str]:
    """(the exception line, the traceback text) of the last traceback in `lines`."""
    start = max(i for i, t in enumerate(lines) if t.startswith("Traceback (most recent call last)"))
    for end in range(start + 1, len(lines)):
        if lines[end] and not lines[end][0].isspace():
            return lines[end], "\n".join(lines[start:end + 1])
    return "", "\n".join(lines[start:])


# ---------------------------------------------------------------------------------------------
# One job.


@dataclass
class _Plan:
    """Everything a job needs, decided before anything is written."""

    name: str
    paths: sm.JobPaths
    hosts: list[str]
    channels: dict[str, Path]
    hyperparameters: dict[str, Any]
    env: dict[str, str]
    commands: list[list[str]]        # one mpirun, or one plain command per host
    host_env: list[dict[str, str]]   # per command: what differs (SM_CURRENT_HOST)
    mpi: bool
    # Across machines: every host's /opt/ml (the first is `paths`). [Note: hosts across machines]
    host_paths: list[sm.JobPaths] = field(default_factory=list)
    network_interface: str = "lo"


@dataclass
class LocalTrainingJob:
    """A training job running (or run) on this machine; `estimator.latest_training_job`.

    Example::

        job = est.latest_training_job
        job.wait()                       # after fit(wait=False)
        job.describe()["TrainingJobStatus"]
    """

    plan: _Plan
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
        self._log_start = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        self._procs, self._threads = [], []
        log = self._log = open(self.log_path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - wait() closes it
        lock = threading.Lock()
        tags = [f"[{host}] " for host in self.plan.hosts] if not self.plan.mpi and \
            len(self.plan.commands) > 1 else [""] * len(self.plan.commands)
        for argv, extra, tag in zip(self.plan.commands, self.plan.host_env, tags):
            proc = subprocess.Popen(
                argv, cwd=self.plan.paths.code, env={**self.plan.env, **extra}, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                errors="replace")
            self._procs.append(proc)
            thread = threading.Thread(target=self._pump, args=(proc, log, lock, tag, logs),
                                      daemon=True)
            thread.start()
            self._threads.append(thread)
        self.secondary_status = "Training"
        timer = threading.Timer(self.max_run, self._on_timeout)
        timer.daemon = True
        timer.start()
        self._timer = timer

    def _pump(self, proc: subprocess.Popen[str], log: IO[str], lock: threading.Lock, tag: str,
              echo: bool) -> None:
        if proc.stdout is None:
            return
        for line in proc.stdout:
            with lock:
                log.write(tag + line)
                if echo:
                    sys.stdout.write(tag + line)
                    sys.stdout.flush()

    def _on_timeout(self) -> None:
        self._timed_out = True
        self.stop()

    def stop(self) -> None:
        """Kills every process of the job (the SDK's `stop_training_job`)."""
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    def wait(self, logs: bool = True) -> None:
        """Waits for the job to end, then writes its artifacts.

        Args:
            logs: The SDK's argument; output goes where `fit(logs=...)` sent it.

        Raises:
            UnexpectedStatusException: The job failed; the message names the failing rank and its
                error, as SageMaker's FailureReason does.
        """
        try:
            for thread in self._threads:
                while thread.is_alive():
                    thread.join(0.2)
        except KeyboardInterrupt:
            self.stop()
            self._finish("Stopped", "Stopped")
            raise
        if self._timer is not None:
            self._timer.cancel()
        if self._log is not None:
            self._log.close()
        codes = [p.wait() for p in self._procs]
        self.returncode = next((c for c in codes if c != 0), 0)
        if self._relaunch():
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

    def _finish(self, status: str, secondary: str) -> None:
        if self._finished:
            return
        self._finished = True
        self.status, self.secondary_status, self.end_time = status, secondary, time.time()
        if status in ("Completed", "Stopped") and self.compress:
            _archive(self.plan.paths.model, os.path.join(self.job_dir, "model.tar.gz"))
            _archive(self.plan.paths.output_data, os.path.join(self.job_dir, "output.tar.gz"))
        _write_json(os.path.join(self.job_dir, "job.json"), self.describe())

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
        return out


def _archive(src: str, dest: str) -> None:
    """A .tar.gz of the contents of `src` at the archive root (SageMaker's model.tar.gz layout)."""
    with tarfile.open(dest, "w:gz") as tar:
        for child in sorted(os.listdir(src)):
            tar.add(os.path.join(src, child), arcname=child)


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


# ---------------------------------------------------------------------------------------------
# The estimators.


class Estimator:
    """The SDK's generic `Estimator` (script mode), running the job on this machine.

    Example::

        est = Estimator(entry_point="train.py", role=get_execution_role(),
                        instance_type="ml.p3.16xlarge", instance_count=1,
                        image_uri="123.dkr.ecr.us-west-2.amazonaws.com/tf:latest",
                        distribution={"smdistributed": {"modelparallel": smp_options},
                                      "mpi": mpi_options})
        est.fit("file:///data/train")
    """

    _default_base_name = "training-job"

    def __init__(self, image_uri: str | None = None, role: str | None = None,
                 instance_count: int | None = None, instance_type: str | None = None, *,
                 entry_point: str | os.PathLike[str] | None = None,
                 source_dir: str | os.PathLike[str] | None = None,
                 hyperparameters: Mapping[str, Any] | None = None,
                 distribution: Mapping[str, Any] | None = None,
                 base_job_name: str | None = None, sagemaker_session: Any = None,
                 output_path: str | None = None, checkpoint_local_path: str | None = None,
                 checkpoint_s3_uri: str | None = None,
                 environment: Mapping[str, str] | None = None,
                 dependencies: Sequence[str | os.PathLike[str]] | None = None,
                 max_run: float = 24 * 60 * 60, model_uri: str | None = None,
                 model_channel_name: str = "model", input_mode: str = "File",
                 disable_output_compression: bool = False, **kwargs: Any) -> None:
        kwargs = self._check_kwargs(kwargs)
        instance_count = kwargs.pop("instance_count", instance_count)
        instance_type = kwargs.pop("instance_type", instance_type)
        image_uri = kwargs.pop("image_uri", image_uri)
        distribution = kwargs.pop("distribution", distribution)
        max_run = kwargs.pop("max_run", max_run)
        self.image_uri, self.role, self.sagemaker_session = image_uri, role, sagemaker_session
        self.instance_count = _instance_count(instance_count)
        self.instance_type = instance_type
        self.resources = sm.instance_resources(instance_type, local_gpus=_local_gpus(),
                                               local_cpus=os.cpu_count() or 1)
        self.entry_point, self.source_dir = _entry_point(entry_point, source_dir)
        self.dependencies = [_existing(d, "dependencies") for d in dependencies or ()]
        self._hyperparameters = dict(hyperparameters or {})
        self.distribution = sm.resolve_distribution(distribution, instance_count=self.instance_count,
                                                    resources=self.resources)
        for text in self.distribution.warnings:
            warnings.warn(text, UserWarning, stacklevel=2)
        self.base_job_name = base_job_name
        self.output_path = _output_root(output_path)
        self.checkpoint_local_path = checkpoint_local_path
        if checkpoint_s3_uri is not None:
            _local_path(checkpoint_s3_uri, "checkpoint_s3_uri")  # s3:// is refused
        self.checkpoint_s3_uri = checkpoint_s3_uri
        self.environment = {str(k): str(v) for k, v in (environment or {}).items()}
        self.max_run = float(max_run)
        self.model_uri, self.model_channel_name = model_uri, model_channel_name
        if input_mode == "Pipe":
            raise ConfigError("input_mode='Pipe' streams S3 data through named pipes, which a "
                              "local job cannot emulate. Received: input_mode='Pipe'. Use 'File'.")
        self.disable_output_compression = disable_output_compression
        if image_uri is not None:
            warnings.warn(f"image_uri={image_uri!r} is not pulled: the job runs in this Python "
                          f"environment ({sys.executable}). examples/docker/Dockerfile builds an "
                          "image with tfsmp.", UserWarning, stacklevel=2)
        self.latest_training_job: LocalTrainingJob | None = None
        self._current_job_name: str | None = None

    # -- arguments ----------------------------------------------------------------------------

    @staticmethod
    def _check_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in _RENAMED:
                warnings.warn(f"{key} was renamed {_RENAMED[key]} in SageMaker SDK v2.",
                              DeprecationWarning, stacklevel=3)
                out[_RENAMED[key]] = value
            elif key in _REJECTED:
                raise ConfigError(f"{key} cannot run on this machine: it {_REJECTED[key]}. "
                                  f"Received: {key}={value!r}.")
            elif key not in _IGNORED:
                close = difflib.get_close_matches(key, [*_IGNORED, *_REJECTED, *_RENAMED], n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"Estimator got an unexpected keyword argument {key!r}.{hint}")
        return out

    def hyperparameters(self) -> dict[str, Any]:
        """The hyperparameters the job gets, decoded (the SDK returns them JSON-encoded)."""
        hps = dict(self._hyperparameters)
        hps.update(sm.distribution_hyperparameters(self.distribution, self.instance_type))
        return hps

    # -- planning ----------------------------------------------------------------------------

    def _plan(self, inputs: Any, job_name: str | None) -> _Plan:
        name = _job_name(self.base_job_name or self._default_base_name, job_name)
        paths = sm.JobPaths(os.path.join(self.output_path, name))
        channels = resolve_channels(inputs, self.model_uri, self.model_channel_name)
        entry = self.entry_point if self.source_dir else os.path.basename(self.entry_point)
        submit = f"file://{self.source_dir or os.path.dirname(self.entry_point)}"
        hps = {**self.hyperparameters(), **self._framework_hyperparameters(paths),
               "sagemaker_program": entry, "sagemaker_submit_directory": submit,
               "sagemaker_container_log_level": 20, "sagemaker_job_name": name}
        hosts = sm.host_names(self.instance_count)
        if self._across_hosts(hosts):
            return self._plan_across_hosts(name, paths, hosts, channels, hps, entry, submit)
        env = self._env(paths, hosts, hps, channels, entry, submit, name)
        user, _ = sm.split_hyperparameters(hps)
        entry_argv = [entry, *sm.to_cmd_args(user)]
        python = sys.executable if entry.endswith(".py") else "/bin/sh"
        if self.distribution.mpi_enabled:
            commands = [self._mpirun(paths, hosts, env, entry_argv, python)]
            host_env: list[dict[str, str]] = [{}]
        else:
            prefix = [python] if python == "/bin/sh" else [python, "-u"]
            commands = [[*prefix, *entry_argv] for _ in hosts]
            host_env = [{"SM_CURRENT_HOST": host} for host in hosts]
        return _Plan(name, paths, hosts, channels, hps, env, commands, host_env,
                     self.distribution.mpi_enabled)

    def _across_hosts(self, hosts: list[str]) -> bool:
        across = sm.runs_across_hosts(hosts, setting=os.environ.get(sm.HOSTS_SETTING),
                                      hostname=socket.gethostname(), resolve=_resolve)
        if across and not self.distribution.mpi_enabled:
            raise ConfigError(
                f"a job across hosts runs under mpirun from {hosts[0]}. Received: "
                f"instance_count={len(hosts)} without distribution={{'mpi': {{'enabled': True}}}}."
                f" Fix: enable mpi (or smdistributed modelparallel), or set "
                f"{sm.HOSTS_SETTING}=local to run every host's process on this machine.")
        return across

    def _plan_across_hosts(self, name: str, paths: sm.JobPaths, hosts: list[str],
                           channels: dict[str, Path], hps: dict[str, Any], entry: str,
                           submit: str) -> _Plan:
        """One mpirun from algo-1 over `--host algo-1:N,...`. [Note: hosts across machines]"""
        ppn = self.distribution.processes_per_host
        iface = os.environ.get("SM_NETWORK_INTERFACE_NAME") or default_interface(
            parse_hosts(hosts)) or "eth0"
        host_paths = [paths, *(sm.JobPaths(os.path.join(paths.base, "hosts", h))
                               for h in hosts[1:])]
        envs = [self._env(p, hosts, hps, channels, entry, submit, name, current_host=h,
                          network_interface=iface) for h, p in zip(hosts, host_paths)]
        env = envs[0]
        for e in envs[1:]:  # one checkpoint directory for the job, which every rank writes to
            e["TFSMP_CHECKPOINT_DIR"] = env["TFSMP_CHECKPOINT_DIR"]
        # The names whose values differ between hosts; every host's app context sets all of them.
        names = {"SM_CURRENT_HOST", *(k for e in envs for k, v in e.items() if env.get(k) != v)}
        per_host = [{k: e[k] for k in sorted(names) if k in e} for e in envs]
        exported = sm.exported_names(env, [*sm.JOB_VARIABLES, *sorted(self.environment)],
                                     per_host=names)
        user, _ = sm.split_hyperparameters(hps)
        python = sys.executable if entry.endswith(".py") else "/bin/sh"
        command = sm.toolkit_mpirun_command(
            hosts=hosts, processes_per_host=ppn, entry_argv=[entry, *sm.to_cmd_args(user)],
            exported=exported, custom_mpi_options=self.distribution.custom_mpi_options,
            instance_type=self.resources.instance_type, hostfile=paths.hostfile, python=python,
            mpirun=find_mpirun(), as_root=hasattr(os, "geteuid") and os.geteuid() == 0,
            has_ld_library_path=bool(env.get("LD_LIBRARY_PATH")), network_interface=iface,
            use_mpi4py_module=python != "/bin/sh", host_env=per_host,
            host_list=",".join(f"{h}:{ppn}" for h in hosts), tcp_interface=iface)
        return _Plan(name, paths, hosts, channels, hps, env, [command], [{}], True,
                     host_paths, iface)

    def _framework_hyperparameters(self, paths: sm.JobPaths) -> dict[str, Any]:
        return {}

    def _env(self, paths: sm.JobPaths, hosts: list[str], hps: dict[str, Any],
             channels: Mapping[str, Path], entry: str, submit: str, name: str, *,
             current_host: str | None = None, network_interface: str = "lo") -> dict[str, str]:
        # The job's SageMaker variables and config are its own, never the launcher's.
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("SM_") and k != "TFSMP_CONFIG"}
        env.update(self.environment)
        env.update(sm.job_env(paths=paths, hosts=hosts, current_host=current_host or hosts[0],
                              hyperparameters=hps, channels=list(channels),
                              resources=self.resources, entry_point=entry, module_dir=submit,
                              job_name=name, network_interface=network_interface))
        env.update({
            "SAGEMAKER_BASE_DIR": paths.base,
            "TFSMP_CHECKPOINT_DIR": self._checkpoint_dir(paths),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (paths.code, _tfsmp_root(),
                                                      env.get("PYTHONPATH", "")) if p),
        })
        return env

    def _checkpoint_dir(self, paths: sm.JobPaths) -> str:
        if self.checkpoint_s3_uri is not None:  # a local "S3" location: use it in place
            return str(_local_path(self.checkpoint_s3_uri, "checkpoint_s3_uri"))
        path = self.checkpoint_local_path
        if path is None or path.rstrip("/") == "/opt/ml/checkpoints":
            return paths.checkpoints
        if path.startswith("/opt/ml/"):
            return os.path.join(paths.base, path[len("/opt/ml/"):])
        return str(Path(path).expanduser().resolve())

    def _mpirun(self, paths: sm.JobPaths, hosts: list[str], env: Mapping[str, str],
                entry_argv: list[str], python: str) -> list[str]:
        exported = sm.exported_names(env, [*sm.JOB_VARIABLES, *sorted(self.environment)])
        return sm.toolkit_mpirun_command(
            hosts=hosts, processes_per_host=self.distribution.processes_per_host,
            entry_argv=entry_argv, exported=exported,
            custom_mpi_options=self.distribution.custom_mpi_options,
            instance_type=self.resources.instance_type, hostfile=paths.hostfile, python=python,
            mpirun=find_mpirun(), as_root=hasattr(os, "geteuid") and os.geteuid() == 0,
            has_ld_library_path=bool(env.get("LD_LIBRARY_PATH")),
            use_mpi4py_module=python != "/bin/sh")

    # -- running -----------------------------------------------------------------------------

    def mpi_command(self, inputs: Any = None, job_name: str | None = None) -> list[str]:
        """The mpirun argv of the latest job, or of a job `fit(inputs, job_name=...)` would run.

        Raises:
            ConfigError: MPI is not enabled in `distribution` (the job runs `python script`).
        """
        if not self.distribution.mpi_enabled:
            raise ConfigError("mpi_command() needs distribution={'mpi': {'enabled': True, ...}}. "
                              f"Received: distribution={dict(self.distribution.raw)!r}: the job "
                              "runs the entry point with plain python, once per host.")
        if inputs is None and job_name is None and self.latest_training_job is not None:
            return list(self.latest_training_job.command)
        return self._plan(inputs, job_name).commands[0]

    def fit(self, inputs: Any = None, wait: bool = True, logs: bool | str = True,
            job_name: str | None = None, experiment_config: Any = None) -> None:
        """Runs the training job on this machine (the SDK's `fit`).

        Args:
            inputs: A local path or file:// URI (the channel "training"), a dict of channel name
                to path/URI, or None. S3 URIs are errors.
            wait: Block until the job ends (else see `latest_training_job.wait()`).
            logs: Print the job's output as it runs (True, or the SDK's "All").
            job_name: The job name (default: base_job_name plus a timestamp).
            experiment_config: Accepted and ignored (SageMaker Experiments).

        Raises:
            ConfigError: An input or argument cannot be used on this machine.
            UnexpectedStatusException: The job failed (after `wait`).
        """
        plan = self._plan(inputs, job_name)
        self._materialize(plan)
        echo = logs not in (False, "None") and wait
        job = LocalTrainingJob(plan, self.max_run, self.output_path,
                               compress=not self.disable_output_compression)
        self.latest_training_job, self._current_job_name = job, plan.name
        if echo:
            print(f"tfsmp: training job {plan.name} in {plan.paths.base}", flush=True)
        job.start(echo)
        if wait:
            job.wait()

    def _materialize(self, plan: _Plan) -> None:
        paths = plan.paths
        try:
            os.makedirs(paths.base)
        except FileExistsError:
            raise ConfigError(f"job names must be unique: {paths.base} already exists. Received: "
                              f"job_name={plan.name!r}. Pick another job_name, or remove that "
                              "directory.") from None
        for d in (paths.input_config, paths.input_data, paths.model, paths.output_data,
                  paths.output_intermediate, self._checkpoint_dir(paths)):
            os.makedirs(d, exist_ok=True)
        self._copy_code(paths)
        for host, host_paths in zip(plan.hosts, plan.host_paths or [paths]):
            self._materialize_host(plan, host, host_paths)
        Path(paths.base, "mpi_command.txt").write_text(
            "".join(sm.format_command(c) for c in plan.commands))
        if plan.mpi and not plan.host_paths:
            Path(paths.hostfile).write_text(
                sm.hostfile_text(plan.hosts, self.distribution.processes_per_host))

    def _materialize_host(self, plan: _Plan, host: str, paths: sm.JobPaths) -> None:
        """One host's /opt/ml: config files, channels, model/ and output/ (code is shared)."""
        if paths != plan.paths:
            for d in (paths.input_config, paths.input_data, paths.model, paths.output_data,
                      paths.output_intermediate):
                os.makedirs(d, exist_ok=True)
            os.symlink(plan.paths.code, paths.code)
        for name, src in plan.channels.items():
            _link_channel(src, paths.channel(name))
        _write_json(os.path.join(paths.input_config, "hyperparameters.json"),
                    sm.encode_hyperparameters(plan.hyperparameters))
        _write_json(os.path.join(paths.input_config, "inputdataconfig.json"),
                    sm.input_data_config(list(plan.channels)))
        _write_json(os.path.join(paths.input_config, "resourceconfig.json"),
                    sm.resource_config(plan.hosts, host, self.resources.instance_type,
                                       plan.network_interface))

    def _copy_code(self, paths: sm.JobPaths) -> None:
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".git")
        if self.source_dir:
            shutil.copytree(self.source_dir, paths.code, ignore=ignore)
        else:
            os.makedirs(paths.code)
            shutil.copy2(self.entry_point, paths.code)
        for dep in self.dependencies:
            target = os.path.join(paths.code, dep.name)
            if dep.is_dir():
                shutil.copytree(dep, target, ignore=ignore, dirs_exist_ok=True)
            else:
                shutil.copy2(dep, target)

    # -- results -----------------------------------------------------------------------------

    @property
    def model_data(self) -> str | None:
        """`file://…/model.tar.gz` of the latest job (None before a job has finished)."""
        job = self.latest_training_job
        return job.model_data if job is not None else None

    @property
    def job_dir(self) -> str | None:
        """The latest job's directory (its /opt/ml)."""
        job = self.latest_training_job
        return job.job_dir if job is not None else None

    def logs(self) -> str:
        """The latest job's whole log."""
        if self.latest_training_job is None:
            raise ConfigError("logs() needs a job: call fit() first.")
        return Path(self.latest_training_job.log_path).read_text(encoding="utf-8")


class TensorFlow(Estimator):
    """The SDK's `sagemaker.tensorflow.TensorFlow` estimator, running the job on this machine.

    Example::

        est = TensorFlow(entry_point="train.py", source_dir="src", role=get_execution_role(),
                         instance_count=1, instance_type="ml.p3.16xlarge",
                         framework_version="2.6.3", py_version="py38",
                         distribution={"smdistributed": {"modelparallel": smp_options},
                                       "mpi": mpi_options},
                         base_job_name="SMD-MP-demo")
        est.fit({"training": "data/"})
    """

    _default_base_name = "tensorflow-training"

    def __init__(self, py_version: str | None = None, framework_version: str | None = None,
                 model_dir: str | bool | None = None, image_uri: str | None = None,
                 distribution: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        if "entry_point" not in kwargs:
            raise TypeError("TensorFlow() needs entry_point: the training script.")
        if (framework_version is None or py_version is None) and image_uri is None:
            raise ConfigError(
                "framework_version or py_version was None, yet image_uri was also None. Either "
                "specify both framework_version and py_version, or specify image_uri.")
        super().__init__(image_uri=image_uri, distribution=distribution, **kwargs)
        self.framework_version, self.py_version = framework_version, py_version
        if model_dir is not None and model_dir is not False:
            _local_path(model_dir, "model_dir")  # s3:// is refused
        self.model_dir = model_dir
        _warn_versions(framework_version, py_version)

    def _framework_hyperparameters(self, paths: sm.JobPaths) -> dict[str, Any]:
        # The SDK passes model_dir=/opt/ml/model for MPI jobs; here /opt/ml is the job directory.
        if self.model_dir is False:
            return {}
        return {"model_dir": str(self.model_dir) if self.model_dir else paths.model}


def _warn_versions(framework_version: str | None, py_version: str | None) -> None:
    from importlib import metadata

    have_tf = next((metadata.version(d) for d in ("tensorflow", "tensorflow-cpu")
                    if _installed(d)), None)
    have_py = f"py{sys.version_info.major}{sys.version_info.minor}"
    if framework_version and have_tf and not have_tf.startswith(framework_version):
        warnings.warn(f"framework_version={framework_version!r}: the job runs with this machine's "
                      f"TensorFlow {have_tf}.", UserWarning, stacklevel=3)
    if py_version and py_version not in (have_py, "py3"):
        warnings.warn(f"py_version={py_version!r}: the job runs with this machine's Python "
                      f"({have_py}).", UserWarning, stacklevel=3)


def _installed(dist: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


def _resolve(name: str) -> str | None:
    try:
        return socket.gethostbyname(name)
    except OSError:
        return None


def _instance_count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"instance_count must be a positive integer. Received: "
                          f"instance_count={value!r}. Pass e.g. instance_count=1.")
    return value


def _entry_point(entry_point: Any, source_dir: Any) -> tuple[str, str | None]:
    """(entry point, source dir): relative to the source dir if given, else an absolute path."""
    if entry_point is None:
        raise ConfigError("entry_point must name the training script: a local job cannot run an "
                          "image's own entry point. Received: entry_point=None.")
    entry = os.fspath(entry_point)
    if source_dir is None:
        return str(_existing(entry, "entry_point")), None
    src = _existing(source_dir, "source_dir")
    if not src.is_dir():
        raise ConfigError(f"source_dir must be a local directory. Received: source_dir={source_dir!r}.")
    if not (src / entry).is_file():
        raise ConfigError(f'No file named "{entry}" was found in directory "{source_dir}".')
    return entry, str(src)


def _output_root(output_path: str | None) -> str:
    if output_path is None:
        return os.path.join(tempfile.gettempdir(), "tfsmp-jobs")
    return str(_local_path(output_path, "output_path"))


def _link_channel(src: Path, dest: str) -> None:
    """Mounts a channel as SageMaker local mode does: the directory itself, or a file inside one."""
    if src.is_dir():
        os.symlink(src, dest, target_is_directory=True)
    else:
        os.makedirs(dest)
        os.symlink(src, os.path.join(dest, src.name))
