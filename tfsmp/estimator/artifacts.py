"""What a finished job leaves: where its model archive is, and where a script's files went instead.

Example::

    report = model_report(job_dir, model_dir, before=snapshot(job_dir))  # (taken at the start)
    if report.empty:
        warnings.warn(empty_model_message(report, job_dir, model_dir))

[Note: the empty model archive] SageMaker archives `SM_MODEL_DIR` (`/opt/ml/model`) and nothing
else. A script that saves `model.keras` in its working directory, or under a path of its own,
gets a `model.tar.gz` of a few dozen bytes, and learns it only when a deployment finds nothing.
So a job whose model directory is empty ends with a warning that names the files the script did
write under the job directory (its working directory `code/` included) since the job started
(new or changed files, against a snapshot of the directory taken at the start).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

__all__ = ["ModelReport", "empty_model_message", "end_lines", "model_report", "size_text",
           "snapshot"]

# Files tfsmp itself writes in a job directory, and directories that are not the script's output.
_OURS = frozenset({"job.log", "job.json", "mpi_command.txt", "hostfile", "model.tar.gz",
                   "output.tar.gz"})
_SKIP_DIRS = frozenset({"input", "__pycache__", ".ipynb_checkpoints"})
_SHOWN = 5


@dataclass(frozen=True)
class ModelReport:
    """The model directory's files and bytes, and files the script wrote elsewhere in the job."""

    files: int
    bytes: int
    names: list[str] = field(default_factory=list)   # up to a few, relative to the model dir
    elsewhere: list[str] = field(default_factory=list)   # relative to the job directory

    @property
    def empty(self) -> bool:
        return self.files == 0


def size_text(n: int) -> str:
    """`n` bytes as `812 B`, `4.2 KB`, `1.3 MB`, `2.0 GB`."""
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _files(root: str) -> list[str]:
    out: list[str] = []
    for here, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        out += [os.path.join(here, n) for n in sorted(names)]
    return out


Snapshot = dict[str, tuple[int, int]]


def snapshot(job_dir: str) -> Snapshot:
    """(mtime ns, size) of every file under `job_dir`, by relative path: what the job started with."""
    out: Snapshot = {}
    for path in _files(job_dir):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        out[os.path.relpath(path, job_dir)] = (st.st_mtime_ns, st.st_size)
    return out


def _written_elsewhere(job_dir: str, model_dir: str, before: Snapshot) -> list[str]:
    """Files under `job_dir` outside `model_dir` and tfsmp's own, new or changed since `before`."""
    model = os.path.abspath(model_dir) + os.sep
    found: list[str] = []
    for rel, stat in snapshot(job_dir).items():
        if os.path.abspath(os.path.join(job_dir, rel)).startswith(model) or rel in _OURS:
            continue
        if rel.endswith(".pyc") or rel in ("output/success", "output/failure"):
            continue
        if before.get(rel) != stat:
            found.append(rel)
    return found


def model_report(job_dir: str, model_dir: str, before: Snapshot) -> ModelReport:
    """What `model_dir` holds, and (when it is empty) what the script wrote elsewhere.

    Args:
        job_dir: The job directory (its /opt/ml).
        model_dir: The directory SageMaker archives (SM_MODEL_DIR).
        before: `snapshot(job_dir)` taken when the job started (its inputs and code).
    """
    paths = _files(model_dir) if os.path.isdir(model_dir) else []
    size = sum(os.path.getsize(p) for p in paths if os.path.isfile(p))
    names = [os.path.relpath(p, model_dir) for p in paths[:_SHOWN]]
    elsewhere = _written_elsewhere(job_dir, model_dir, before) if not paths else []
    return ModelReport(len(paths), size, names, elsewhere)


def empty_model_message(report: ModelReport, job_dir: str, model_dir: str) -> str:
    """The warning for a job whose model directory is empty. [Note: the empty model archive]"""
    text = (f"The model directory must hold the model: SageMaker archives only SM_MODEL_DIR. "
            f"Received: {model_dir} is empty, so model.tar.gz holds nothing.")
    if report.elsewhere:
        shown = ", ".join(report.elsewhere[:_SHOWN])
        more = f" and {len(report.elsewhere) - _SHOWN} more" if len(report.elsewhere) > _SHOWN else ""
        text += f" The script wrote, under {job_dir}: {shown}{more}."
    else:
        text += (f" The script wrote no file under {job_dir} (a path outside it is not "
                 "searched).")
    return text + (" Fix: save the model under os.environ['SM_MODEL_DIR'] (the script also gets "
                   "it as --model_dir), e.g. model.save(os.path.join(os.environ['SM_MODEL_DIR'], "
                   "'model.keras')).")


def end_lines(name: str, status: str, seconds: float, model_data: str | None,
              report: ModelReport, log_path: str) -> list[str]:
    """The lines a job prints when it ends: its status, where the model archive is, the log."""
    lines = [f"tfsmp: training job {name} {status} in {seconds:.1f} s"]
    if model_data is not None:
        held = "empty" if report.empty else (
            f"{report.files} file{'s' if report.files != 1 else ''}: "
            f"{', '.join(report.names)}{', …' if report.files > len(report.names) else ''}; "
            f"{size_text(report.bytes)}")
        lines.append(f"tfsmp: model archive (estimator.model_data): {model_data} ({held})")
    lines.append(f"tfsmp: every rank's output: {log_path}")
    return lines
