"""What a job launched by tfsmp shows: its output less TensorFlow's start-up lines and launcher noise.

Example::

    keep = OutputFilter()
    for line in mpirun_stderr:
        for out in keep.feed(line):
            sys.stderr.write(out)
    for out in keep.close():
        sys.stderr.write(out)

[Note: quiet start-up] Every TensorFlow process prints 4-12 lines while it loads (absl's
"All log messages before absl::InitializeLog() ..." and oneDNN's notice, twice per process with
TF 2.21, the CPU-feature and CUDA-factory lines on other builds) before it reads
`TF_CPP_MIN_LOG_LEVEL`, so a script cannot silence them. The launcher can: `tfsmp run` and the
estimator pass the ranks' output through `OutputFilter`, which drops exactly those lines (matched
whole, after Open MPI's `[job,rank]<stderr>: ` tag); `tfsmp run --tf-logs` or `TFSMP_TF_LOGS=1`
keeps them. The estimator's job.log keeps everything. The filter also drops blocks that only
repeat what is already said: once a rank printed its tagged report (a setup error, a tfsmp error,
a traceback or a stall: [Note: one message per job] in `tfsmp.failure`), Open MPI's boxes that
say a process exited non-zero, called MPI_ABORT or made prterun exit, and PMIx's
"PMIX_ERR_UNREACH" line of a rank killed while it finalized; and, where asked, the job map that
the SageMaker toolkit's `--display-map` prints.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import IO

__all__ = ["TF_LOGS_ENV", "OutputFilter", "run_filtered", "tf_logs_wanted"]

TF_LOGS_ENV = "TFSMP_TF_LOGS"
_TAG = re.compile(r"^(\[\d+,\d+\]<(?:stdout|stderr)>: ?)")
_LOG_PREFIX = r"[IWE]\d{4} [\d:.]+\s+\d+ "
# TensorFlow's start-up lines, each matched whole (untagged, without the newline).
TF_STARTUP = tuple(re.compile(p) for p in (
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$",
    _LOG_PREFIX + r"port\.cc:\d+\] oneDNN custom operations are on\. .*$",
    _LOG_PREFIX + r"cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized to use .*$",
    r"^To enable the following instructions: .*rebuild TensorFlow with the appropriate compiler "
    r"flags\.$",
    _LOG_PREFIX + r"cuda_(?:dnn|fft|blas)\.cc:\d+\] Unable to register cu\w+ factory: .*$",
    _LOG_PREFIX + r"computation_placer\.cc:\d+\] computation placer already registered\. .*$",
    _LOG_PREFIX + r"cuda_executor\.cc:\d+\] failed call to cuInit: .*$",
    r"^W\d{4} [\d:.]+\s+\d+ \S+\] TF-TRT Warning: Could not find TensorRT$",
))
_RULE = re.compile(r"^-{20,}$")
# The first line of an Open MPI box that repeats a failure a rank already reported.
_NONZERO = re.compile(r"^(?:(?:prterun|mpirun) detected that one or more processes exited with "
                      r"non-zero status|MPI_ABORT was invoked on rank \d+|(?:prterun|mpirun) has "
                      r"exited due to process rank \d+)")
# After a stop signal, each rank that did not keep a backup dies of the relayed SIGUSR1, and
# mpirun says so in a box per job: expected, so dropped ([Note: the launcher owns its job]).
_NOTICED = re.compile(r"^(?:prterun|mpirun) noticed that process rank \d+ with PID \d+ on node "
                      r"\S+ exited on")
# A rank's tagged report: `[rank 1 | init] ConfigError: ...`, `[rank 1 | pp_rank 0] ...`.
_SETUP_ERROR = re.compile(r"^\[rank \d+ \| (?:init|pp_rank \d+)\] \S")
_UNREACH = re.compile(r"^\[[\w.-]+:\d+\] PMIX ERROR: PMIX_ERR_UNREACH in file ")
_MAP_START = re.compile(r"^=+\s+JOB MAP\s+=+$")
_MAP_END = re.compile(r"^=+$")


def tf_logs_wanted(environ: Mapping[str, str] | None = None) -> bool:
    """True when `TFSMP_TF_LOGS` asks to keep TensorFlow's start-up lines."""
    value = (os.environ if environ is None else environ).get(TF_LOGS_ENV, "")
    return value.strip().lower() not in ("", "0", "false", "no", "off")


class OutputFilter:
    """Drops TensorFlow's start-up lines and redundant launcher blocks from a job's output.

    Args:
        tf_logs: Keep TensorFlow's start-up lines.
        job_map: Keep the job map of mpirun's `--display-map`.
    """

    def __init__(self, tf_logs: bool = False, job_map: bool = True) -> None:
        self.tf_logs, self.job_map = tf_logs, job_map
        self.setup_error_seen = False
        self.stopping = False  # set by the launcher once it relays a stop signal
        self.dropped = 0
        self._held: str | None = None   # a rule line that may open a box to drop
        self._skipping: re.Pattern[str] | None = None  # the line that ends the block dropped

    def feed(self, line: str) -> list[str]:
        """The lines to show for one input line (with its newline): none, it, or a held one too."""
        m = _TAG.match(line)
        text = line[m.end():] if m else line
        text = text.rstrip("\r\n")
        if self._skipping is not None:
            self.dropped += 1
            if self._skipping.match(text):
                self._skipping = None
            return []
        out: list[str] = []
        if self._held is not None:
            held, self._held = self._held, None
            if (self.setup_error_seen and _NONZERO.match(text)) or (
                    self.stopping and _NOTICED.match(text)):
                self.dropped += 2
                self._skipping = _RULE
                return []
            out.append(held)
        if _SETUP_ERROR.match(text):
            self.setup_error_seen = True
        if self.setup_error_seen and _UNREACH.match(text):
            self.dropped += 1
            return out
        if not self.tf_logs and any(p.match(text) for p in TF_STARTUP):
            self.dropped += 1
            return out
        if not self.job_map and _MAP_START.match(text):
            self.dropped += 1
            self._skipping = _MAP_END
            return out
        if m is None and _RULE.match(text):
            self._held = line
            return out
        return [*out, line]

    def close(self) -> list[str]:
        """What is still held at the end of the output."""
        held, self._held = self._held, None
        return [held] if held is not None else []


def _pump(source: IO[bytes], sink: IO[str], keep: OutputFilter) -> None:
    last = "\n"
    for raw in iter(source.readline, b""):
        for line in keep.feed(raw.decode("utf-8", "replace")):
            sink.write(line)
            last = line[-1:] or last
        sink.flush()
    for line in keep.close():
        sink.write(line)
        last = line[-1:] or last
    if last != "\n":  # a rank's unfinished last line: what the launcher says goes on a new one
        sink.write("\n")
    sink.flush()


def run_filtered(argv: Sequence[str], *, tf_logs: bool = False,
                 env: Mapping[str, str] | None = None,
                 started: Callable[[subprocess.Popen[bytes]], object] | None = None,
                 grace: float | None = None, on_stop: Callable[[], None] | None = None) -> int:
    """Runs `argv` (an mpirun line) with its stderr passed through `OutputFilter`, owning the job.

    Stdout is untouched (Keras progress bars redraw with carriage returns). Returns the exit code.
    ``env``: the process's environment (default: this one's); ``started(proc)`` is called once
    it runs. A SIGTERM, SIGINT or SIGHUP meanwhile stops the job, with ``grace`` seconds for a
    backup (None: `ownjob.grace_seconds()`), and ``on_stop()`` is called; whatever the job leaves
    behind is killed before this returns ([Note: the launcher owns its job] in
    tfsmp/launch/ownjob.py).
    """
    from tfsmp.launch import ownjob

    keep = OutputFilter(tf_logs=tf_logs)

    def stopping() -> None:
        keep.stopping = True
        if on_stop is not None:
            on_stop()

    stopper = ownjob.Stopper(ownjob.grace_seconds(grace), say=_say, on_stop=stopping)
    with stopper, subprocess.Popen(ownjob.guarded(list(argv)), stderr=subprocess.PIPE,
                                   env=None if env is None else dict(env),
                                   **ownjob.popen_kwargs()) as proc:
        stopper.attach(proc)
        if started is not None:
            started(proc)
        pump = None
        if proc.stderr is not None:
            pump = threading.Thread(target=_pump, args=(proc.stderr, sys.stderr, keep),
                                    daemon=True)
            pump.start()
        code = proc.wait()
        left = ownjob.sweep(proc.pid)
        # A process the job left behind may have held the pipe open: it is gone now.
        if pump is not None:
            pump.join(timeout=5.0)
    stopper.report(left)
    return code


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
