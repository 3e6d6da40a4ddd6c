"""The stall watchdog: what every rank is doing, readable by any rank of the host without MPI.

Example::

    dog = Watchdog(rank=0, size=4, pipeline_rank_of=topology.pipeline_rank_of, limit=600.0)
    dog.step_begin()
    dog.update(action)                 # before each schedule action (about a microsecond)
    dog.waiting("activations of microbatch 3 from stage 0")   # a wait that did not finish at once
    dog.step_end()
    print(dog.report())                # rank | pp_rank | host | pid | step | state | action | for | detail

[Note: status files] Each rank keeps its state in a small memory-mapped file
``<directory>/rank<R>.status``: its pipeline rank, pid, host, step count, state (running an action,
waiting, or outside a step), the action, what it waits for, and since when. Writing is a few
``struct.pack_into`` calls into shared memory, no system call, so the executor can afford one per
action. A stalled rank reads every rank's file to print the table; this needs no cooperation from
the other ranks, which are usually blocked themselves (in a receive, a collective, or a hung
kernel), and it still shows the last state of a rank that was killed. Writers use a sequence
lock (odd while writing) and seal each body with its CRC-32, so a reader never takes a
half-written record: the sequence lock alone is not enough, because plain Python stores carry no
memory barrier and a CPU with a weak memory order (aarch64) may show another core the closing
sequence number before the body; and `struct.pack_into` clears a field before filling it, so a
torn read shows an empty action. A reader retries until the sequence is even and unchanged and
the body matches its CRC.

The directory is shared by the ranks of one job on one host: ``TFSMP_WATCHDOG_DIR`` if set
(a directory every host shares makes the table cover all hosts); else Open MPI's job session
directory (``OMPI_FILE_LOCATION``'s parent, which `mpirun` deletes when the job ends, even after
an abort); else a temporary directory keyed by the launcher's job id. Ranks on other hosts
without a shared directory are listed as "no status".

[Note: why abort, not raise] A stall leaves receives posted and peers blocked; no caller can
recover the step, and a script that catches the error (a test runner, a retry loop) would go on
to mismatch its next collectives and hang for good. `expire` therefore prints the tagged message
and table and aborts the whole job, as `tfsmp.failure` does for an uncaught exception. In a
single process (no MPI world to abort) it raises `StepError` instead.

[Note: blocking calls] The executor polls its receives and notices a stall itself. A blocking
collective (the data-parallel allreduce, a broadcast) cannot poll, so `blocking(what)` marks the
rank as waiting and a monitor thread, started on first use and waking once a second, expires
the watchdog when such a wait exceeds the limit. mpi4py releases the GIL inside MPI calls and
initializes MPI with MPI_THREAD_MULTIPLE, so the thread can print and abort while the main thread
sits in the collective.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import re
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, NoReturn

from tfsmp import failure
from tfsmp.errors import StepError

__all__ = ["Status", "Watchdog", "default_directory", "for_process"]

DIR_ENV = "TFSMP_WATCHDOG_DIR"
# Environment variables that name the running job, launcher by launcher.
_JOB_KEYS = ("PMIX_NAMESPACE", "OMPI_MCA_orte_ess_jobid", "SLURM_JOB_ID", "PBS_JOBID")
_MAGIC = b"TFWD"
# magic, seq, pid, rank, pipeline rank, state, step, since, action, detail, host
_RECORD = struct.Struct("<4sIiiiB3xQd48s160s64s")
_SEQ = struct.Struct("<I")
_SEQ_AT = 4
# state, step, since, action, detail: what a transition rewrites
_BODY = struct.Struct("<B3xQd48s160s")
_BODY_AT = 20
_CRC = struct.Struct("<I")  # CRC-32 of the body, after the record
_CRC_AT = _RECORD.size
_SIZE = 512

NONE, RUNNING, WAITING, IDLE = 0, 1, 2, 3
_STATE_NAMES = {NONE: "started", RUNNING: "running", WAITING: "waiting", IDLE: "idle"}


@dataclass(frozen=True)
class Status:
    """One rank's record as read back from its file."""

    rank: int
    pipeline_rank: int
    pid: int
    host: str
    step: int
    state: str
    action: str
    detail: str
    since: float


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def _encode(text: str, size: int) -> bytes:
    data = text.encode("utf-8", "replace")
    return data if len(data) <= size else data[:size - 3] + b"..."


def _safe_key(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:80]


def default_directory(environ: Mapping[str, str] | None = None) -> str | None:
    """Where the ranks of this job keep their status files; see [Note: status files].

    Returns:
        A directory path, or None when no job id can be found (then only this rank is shown).
    """
    env = os.environ if environ is None else environ
    job = next((_safe_key(env[k]) for k in _JOB_KEYS if env.get(k)), None)
    if env.get(DIR_ENV):  # shared by jobs, perhaps: one subdirectory per job
        return os.path.join(env[DIR_ENV], f"job-{job}") if job else env[DIR_ENV]
    location = env.get("OMPI_FILE_LOCATION")
    if location:  # Open MPI: <session>/<job>/<rank>; mpirun removes <session> at job end
        return os.path.join(os.path.dirname(location.rstrip(os.sep)), "tfsmp-watchdog")
    if job:
        return os.path.join(tempfile.gettempdir(), f"tfsmp-watchdog-{job}")
    if env.get("PMI_RANK") is not None:  # MPICH's hydra: the ranks of a host share a proxy
        return os.path.join(tempfile.gettempdir(), f"tfsmp-watchdog-ppid{os.getppid()}")
    return None


class Watchdog:
    """Per-rank status for stall reports, and the abort when a wait exceeds ``limit``.

    See the module docstring for an example and the notes.

    Args:
        rank: This process's world rank.
        size: World size.
        pipeline_rank_of: World rank -> pipeline rank (``Topology.pipeline_rank_of``), or a
            sequence.
        directory: Where status files go (default: `default_directory`).
        limit: Seconds a blocking wait may last before `blocking` expires (0 disables the
            monitor thread; the executor applies its own ``stall_timeout`` to receives).
    """

    def __init__(self, rank: int, size: int,
                 pipeline_rank_of: Callable[[int], int] | Sequence[int],
                 directory: str | None = None, *, limit: float = 0.0) -> None:
        self.rank, self.size, self.limit = rank, size, float(limit)
        self.pipeline_ranks = pipeline_rank_of
        self.pipeline_rank = self.pipeline_rank_of(rank)
        self.host = socket.gethostname()
        self.tag = f"rank {rank} | pp_rank {self.pipeline_rank}"
        self.directory = directory if directory is not None else default_directory()
        self.path: str | None = None
        self._step = 0
        self._seq = 0
        self._action = b""
        self._texts: dict[int, tuple[object, bytes]] = {}
        self._file: Any = None
        self._map: mmap.mmap | bytearray = bytearray(_SIZE)
        self._monitor: threading.Thread | None = None
        self._blocked: str | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._open()
        self._write_header()

    # -- the record ----------------------------------------------------------------------------

    def pipeline_rank_of(self, rank: int) -> int:
        fn = self.pipeline_ranks
        return int(fn(rank) if callable(fn) else fn[rank])

    def _open(self) -> None:
        if self.directory is None or self.size <= 1:
            return
        path = os.path.join(self.directory, f"rank{self.rank}.status")
        for _ in range(3):  # a peer exiting may remove the directory between the two calls
            try:
                os.makedirs(self.directory, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                os.ftruncate(fd, _SIZE)
                self._map = mmap.mmap(fd, _SIZE)
                self._file, self.path = fd, path
                return
            except FileNotFoundError:
                continue
            except OSError:  # the report then covers this rank only; never fail the training
                break

    def _write_header(self) -> None:
        _RECORD.pack_into(self._map, 0, _MAGIC, 0, os.getpid(), self.rank, self.pipeline_rank, NONE, 0,
                          time.time(), b"", b"", _encode(self.host, 64))
        _CRC.pack_into(self._map, _CRC_AT, _body_crc(bytes(self._map[:_CRC_AT + _CRC.size])))

    def _set(self, state: int, action: bytes, detail: bytes) -> None:
        # [Note: status files] sequence lock: odd while the body is being rewritten
        seq = self._seq = self._seq + 1
        body = _BODY.pack(state, self._step, time.time(), action, detail)
        _SEQ.pack_into(self._map, _SEQ_AT, 2 * seq - 1)
        self._map[_BODY_AT:_BODY_AT + _BODY.size] = body
        _CRC.pack_into(self._map, _CRC_AT, zlib.crc32(body))
        _SEQ.pack_into(self._map, _SEQ_AT, 2 * seq)

    # -- what the executor calls ---------------------------------------------------------------

    def step_begin(self) -> None:
        """A pipeline step starts (once per `Executor.run`)."""
        self._step += 1
        self._action = b""
        self._set(RUNNING, b"", b"")

    def update(self, action: object) -> None:
        """The rank starts ``action`` (a schedule `Action` or its text)."""
        # Schedules are lists kept across steps, so the text of each action object is cached;
        # the entry holds the object, so its id cannot be reused while cached.
        hit = self._texts.get(id(action))
        if hit is None or hit[0] is not action:
            if len(self._texts) > 65536:
                self._texts.clear()
            hit = self._texts[id(action)] = (action, _encode(str(action), 48))
        self._action = hit[1]
        self._set(RUNNING, self._action, b"")

    def waiting(self, what: str) -> None:
        """The current action waits for ``what`` (a receive or send that did not finish at once)."""
        self._set(WAITING, self._action, _encode(what, 160))

    def step_end(self) -> None:
        """The step finished; the rank runs the script's own code until the next one."""
        self._action = b""
        self._set(IDLE, b"", _encode(f"outside a pipeline step (finished step {self._step})", 160))

    @contextlib.contextmanager
    def blocking(self, what: str) -> Iterator[None]:
        """Marks a blocking call (e.g. an allreduce) as a wait the monitor thread watches.

        See [Note: blocking calls]. Nested use keeps the outer description.
        """
        if self._blocked is not None:
            yield
            return
        self._blocked = what
        self.waiting(what)
        self._ensure_monitor()
        try:
            yield
        finally:
            self._blocked = None
            self._set(RUNNING, self._action, b"")

    # -- reading -------------------------------------------------------------------------------

    def read(self, rank: int) -> Status | None:
        """Rank ``rank``'s record, or None if it has none (not started, or another host)."""
        if rank == self.rank:
            return _parse(bytes(self._map[:_RECORD.size]))
        if self.directory is None:
            return None
        try:
            with open(os.path.join(self.directory, f"rank{rank}.status"), "rb") as f:
                mapped = mmap.mmap(f.fileno(), _SIZE, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return None
        deadline = time.monotonic() + 0.1
        with mapped:
            while time.monotonic() < deadline:  # a stalled writer is consistent at once
                seq = _SEQ.unpack_from(mapped, _SEQ_AT)[0]
                raw = bytes(mapped[:_CRC_AT + _CRC.size])
                if (seq % 2 == 0 and _SEQ.unpack_from(mapped, _SEQ_AT)[0] == seq
                        and _body_crc(raw) == _CRC.unpack_from(raw, _CRC_AT)[0]):
                    return _parse(raw[:_RECORD.size])
                time.sleep(0)
        return None  # never a half-written record

    def report(self, now: float | None = None) -> str:
        """A table with one row per rank: what it runs or waits for, and for how long."""
        now = time.time() if now is None else now
        rows = [_row(r, self.pipeline_rank_of(r), self.read(r), now, self.host)
                for r in range(self.size)]
        head = ("rank", "pp_rank", "host", "pid", "step", "state", "action", "for", "detail")
        widths = [max(len(head[i]), *(len(row[i]) for row in rows)) for i in range(len(head) - 1)]
        lines = [" | ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + " | " + row[-1]
                 for row in [head, *rows]]
        lines.insert(1, "-+-".join("-" * w for w in widths) + "-+-" + "-" * 6)
        return "\n".join(lines)

    # -- expiry --------------------------------------------------------------------------------

    def expire(self, message: str, frame: FrameType | None = None) -> NoReturn:
        """Prints ``message``, the stack and the table of every rank, then aborts the job.

        See [Note: why abort, not raise].

        Args:
            message: What stalled, e.g. the executor's "waited more than stall_timeout=...".
            frame: The stack to show (default: the caller's).

        Raises:
            StepError: when there is no multi-rank MPI job to abort.
        """
        text = (f"{message}\nWhat every rank was doing (tfsmp watchdog; 'for' = time in that "
                f"state):\n{self.report()}")
        with self._lock:
            stack = traceback.format_list(traceback.extract_stack(frame or sys._getframe(1)))
            lines = ["Traceback (most recent call last):", *"".join(stack).splitlines(),
                     f"tfsmp.errors.StepError: {text}"]
            with contextlib.suppress(Exception):
                sys.stderr.write("".join(f"[{self.tag}] {line}\n"
                                         for chunk in lines for line in chunk.splitlines()))
                sys.stderr.flush()
            sys.stdout.flush()
            failure.abort_job(1)
        raise StepError(text)

    def _ensure_monitor(self) -> None:
        if self.limit <= 0 or self._monitor is not None:
            return
        main = threading.main_thread().ident
        self._monitor = threading.Thread(target=self._watch, args=(main,), daemon=True,
                                         name="tfsmp-watchdog")
        self._monitor.start()

    def _watch(self, main: int | None) -> None:
        while not self._closed:
            time.sleep(min(1.0, self.limit / 4))
            what = self._blocked
            mine = self.read(self.rank)
            if what is None or mine is None or mine.state != "waiting":
                continue
            if time.time() - mine.since > self.limit:
                frame = sys._current_frames().get(main) if main is not None else None
                with contextlib.suppress(StepError):
                    self.expire(f"[{self.tag}] waited more than stall_timeout={self.limit}s "
                                f"for {what}. A peer rank is stuck or failed; see its row below. "
                                f"Raise stall_timeout in the config if steps are legitimately "
                                f"slow.", frame)
                return

    def close(self, remove_directory: bool = False) -> None:
        """Stops the monitor and removes this rank's file (and, if asked, the directory once
        empty: only at exit, since a peer may be creating its file in it)."""
        self._closed = True
        if self._file is None:
            return
        path, self.path = self.path, None
        mapped, self._map = self._map, bytearray(_SIZE)
        with contextlib.suppress(Exception):
            mapped.close()  # type: ignore[union-attr]
            os.close(self._file)
        self._file = None
        with contextlib.suppress(OSError):
            os.remove(path or "")
        if remove_directory:
            with contextlib.suppress(OSError):
                os.rmdir(self.directory or "")


def _body_crc(raw: bytes) -> int:
    """CRC-32 of the body within a record ``raw``; see [Note: status files]."""
    return zlib.crc32(raw[_BODY_AT:_BODY_AT + _BODY.size])


def _parse(raw: bytes) -> Status | None:
    try:
        magic, _, pid, rank, pipe, state, step, since, action, detail, host = _RECORD.unpack(raw)
    except struct.error:
        return None
    if magic != _MAGIC:
        return None
    return Status(rank, pipe, pid, _text(host), step, _STATE_NAMES.get(state, "?"),
                  _text(action), _text(detail), since)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    try:  # a zombie is gone too (its parent has not reaped it yet)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _row(rank: int, pipeline_rank: int, st: Status | None, now: float, host: str) -> list[str]:
    if st is None:
        return [str(rank), str(pipeline_rank), "?", "?", "?", "no status", "-", "-",
                f"no status file (not started yet, or on another host: set {DIR_ENV} to a "
                f"directory every host shares)"]
    detail = st.detail
    if st.state == "running":
        detail = "computing or in the script's own code" if st.action else "starting the step"
    if st.state == "started":
        detail = "has not run a pipeline step yet"
    if st.host == host and not _alive(st.pid):
        detail = f"process {st.pid} is gone (killed or crashed); last: {detail or st.state}"
    return [str(rank), str(st.pipeline_rank), st.host, str(st.pid), str(st.step), st.state,
            st.action or "-", f"{max(0.0, now - st.since):.1f} s", detail]


_PROCESS: tuple[Any, float, Watchdog] | None = None  # (core state, limit, watchdog)


def for_process() -> Watchdog | None:
    """This process's watchdog when it is one rank of a multi-rank MPI job, else None.

    Built from `tfsmp.core.state()` on first use and rebuilt when `tfsmp.init` starts a new
    state or ``stall_timeout`` changes; the executor calls this once per step (a few attribute
    reads when nothing changed) instead of being handed one.
    """
    global _PROCESS
    core = sys.modules.get("tfsmp.core")
    if core is None or not core.is_initialized():
        return None
    st = core.state()
    limit = float(st.config.stall_timeout)
    if _PROCESS is not None and _PROCESS[0] is st and _PROCESS[1] == limit:
        return _PROCESS[2]
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        if (mpi is None or not mpi.Is_initialized() or mpi.Is_finalized()
                or mpi.COMM_WORLD.Get_size() < 2):
            return None
    except Exception:
        return None
    size = st.topology.world_size
    pipeline_ranks = [st.topology.pipeline_rank_of(r) for r in range(size)]
    old = _PROCESS[2] if _PROCESS is not None else None
    if old is not None and (old.rank, old.size, old.pipeline_ranks) == (st.rank, size,
                                                                            pipeline_ranks):
        old.limit = limit  # the same layout: keep the file, steps count on
        _PROCESS = (st, limit, old)
        return old
    if old is not None:  # close first: the new one reuses the file name
        old.close()
    dog = Watchdog(st.rank, size, pipeline_ranks, limit=limit)
    _PROCESS = (st, limit, dog)
    return dog


def _close_process() -> None:
    if _PROCESS is not None:
        _PROCESS[2].close(remove_directory=True)


atexit.register(_close_process)
