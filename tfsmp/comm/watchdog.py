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
and table and ends the whole job, as `tfsmp.failure` does for an uncaught exception: once per
job, from the first rank that reports ([Note: one message per job] in tfsmp/failure.py), with
the stack only under ``TFSMP_DEBUG=1``. In a
single process (no MPI world to abort) it raises `StepError` instead.

[Note: watched collectives] Every blocking call of the comm seam (`MpiGroup`'s collectives and
object receives, Horovod's reductions) runs inside `watched(group, op)`: the group's call count
goes up on every rank alike, and while this rank waits its record names the call (group, count,
operation, labels: [Note: collective labels] in tfsmp/comm/calls.py), so a wait outside a step
(fit's per-step agreement, the preemption check, a save's gathers, an epoch-end barrier) is
timed like one inside it. When the monitor expires such a wait, the message says which call,
which ranks arrived and why the others did not ([Note: who arrived]); the table says when a rank's
process is stopped (state ``T`` in ``/proc/<pid>/stat``) rather than computing. A rank whose
script ended keeps its record, marked ``exited``, where Open MPI deletes the directory for us.

[Note: blocking calls] The executor polls its receives and notices a stall itself. A blocking
collective (the data-parallel allreduce, a broadcast) cannot poll, so `blocking(what)` marks the
rank as waiting and a monitor thread, started on first use and waking once a second, expires
the watchdog when such a wait exceeds the limit. mpi4py releases the GIL inside MPI calls and
initializes MPI with MPI_THREAD_MULTIPLE, so the thread can print and abort while the main thread
sits in the collective.

[Note: certain deadlocks] ``stall_timeout`` (600 s by default) must allow for a slow rank, so a
script that makes a collective call on some ranks only (``if rank == 0: model.save(...)``, a
skipped step) would wait that long although the records already show that no rank can ever go
on. After `DEADLOCK_AFTER` seconds in a collective, the monitor thread reads every rank's record
and ends the job at once, with the stall report, when all of these hold: every rank's record is
readable on this host and its process is not stopped (a debugger may resume it); every rank
waits in a collective of a group whose members the topology gives (world, pipeline, data and
their user_ twins, and Horovod's, whose world is the data group), has ended its script, or is
gone; no such call can finish (some member has not arrived in it, [Note: who arrived] in
tfsmp/comm/calls.py); and the records stay the same for `_DEADLOCK_STREAK` more readings, a
second apart. A rank that computes or waits for a pipeline message may still go on: then the
limit applies as before.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import socket
import struct
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, NoReturn

from tfsmp import failure, relaunch
from tfsmp.comm.calls import GROUP_NAMES, Call, arrival, collective_label, describe, explain
from tfsmp.errors import ConfigError, StepError
from tfsmp.failure import DIR_ENV, default_directory
from tfsmp.tempdirs import private_dir

__all__ = ["DIR_ENV", "Status", "Watchdog", "collective_label", "current", "default_directory",
           "for_process", "watched"]

_MAGIC = b"TFWD"
_GROUPS = len(GROUP_NAMES)
# magic, seq, pid, rank, pipeline rank, host; then the body
_HEAD = "<4sIiii64s"
# state, step, since, action, detail; the collective call (group or -1, its count, operation,
# outer and inner label); the call count of every group: what a transition rewrites
_BODY = struct.Struct(f"<B3xQd48s160sb3xI16s64s64s{_GROUPS}I")
_BODY_AT = struct.calcsize(_HEAD)
_RECORD = struct.Struct(_HEAD + _BODY.format[1:])
_SEQ = struct.Struct("<I")
_SEQ_AT = 4
_CRC = struct.Struct("<I")  # CRC-32 of the body, after the record
_CRC_AT = _RECORD.size
_SIZE = 512

_NO_CALL = (-1, 0, b"", b"", b"")  # the call fields of a record outside any call
# [Note: certain deadlocks] the groups whose members a record's rank gives (with the topology)
_SPLIT = ("pipeline", "user_pipeline", "data", "user_data")
DEADLOCK_AFTER = 10.0  # s a rank waits before it looks for a certain deadlock
_DEADLOCK_STREAK = 2  # the same records seen this many more times, a second apart
NONE, RUNNING, WAITING, IDLE, EXITED = 0, 1, 2, 3, 4
_STATE_NAMES = {NONE: "started", RUNNING: "running", WAITING: "waiting", IDLE: "idle",
                EXITED: "exited"}


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
    group: int = -1          # the collective call it is in: group index, or -1
    call_seq: int = 0
    op: str = ""
    api: str = ""
    what: str = ""
    seqs: tuple[int, ...] = (0,) * _GROUPS   # its call count per group
    process: str = ""        # "running", "stopped", "gone"; "" on another host


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def _encode(text: str, size: int) -> bytes:
    data = text.encode("utf-8", "replace")
    return data if len(data) <= size else data[:size - 3] + b"..."


class Watchdog:
    """Per-rank status for stall reports, and the abort when a wait exceeds ``limit``.

    See the module docstring for an example and the notes.

    Args:
        rank: This process's world rank.
        size: World size.
        pipeline_rank_of: World rank -> pipeline rank (``Topology.pipeline_rank_of``), or a
            sequence.
        data_ranks: World rank -> data rank (``Topology.data_rank_of``), which with the
            pipeline ranks gives the members of a rank's pipeline and data groups ([Note:
            certain deadlocks]); None: only the world groups' members are known.
        directory: Where status files go (default: `default_directory`).
        limit: Seconds a blocking wait may last before `blocking` expires (0 disables the
            monitor thread; the executor applies its own ``stall_timeout`` to receives).
    """

    def __init__(self, rank: int, size: int,
                 pipeline_rank_of: Callable[[int], int] | Sequence[int],
                 directory: str | None = None, *, limit: float = 0.0,
                 data_ranks: Sequence[int] | None = None) -> None:
        self.rank, self.size, self.limit = rank, size, float(limit)
        self.pipeline_ranks = pipeline_rank_of
        self.data_ranks = tuple(data_ranks) if data_ranks is not None else None
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
        self._call: Call | None = None
        self._call_fields: tuple[int, int, bytes, bytes, bytes] = _NO_CALL
        self._seqs = [0] * _GROUPS
        self._state, self._detail = NONE, b""
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
            try:  # [Note: private temp folders] in tfsmp/tempdirs.py: 0700, ours, no symlink
                private_dir(self.directory)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                os.ftruncate(fd, _SIZE)
                self._map = mmap.mmap(fd, _SIZE)
                self._file, self.path = fd, path
                return
            except FileNotFoundError:
                continue
            except (OSError, ConfigError):  # the report then covers this rank only; never
                break                           # fail the training

    def _write_header(self) -> None:
        _SEQ.pack_into(self._map, _SEQ_AT, 1)
        struct.pack_into(_HEAD, self._map, 0, _MAGIC, 1, os.getpid(), self.rank,
                         self.pipeline_rank, _encode(self.host, 64))
        self._seq = 0
        self._set(NONE, b"", b"")

    def _set(self, state: int, action: bytes, detail: bytes) -> None:
        # [Note: status files] sequence lock: odd while the body is being rewritten
        self._state, self._detail = state, detail
        seq_lock = self._seq = self._seq + 1
        body = _BODY.pack(state, self._step, time.time(), action, detail, *self._call_fields,
                          *self._seqs)
        _SEQ.pack_into(self._map, _SEQ_AT, 2 * seq_lock - 1)
        self._map[_BODY_AT:_BODY_AT + _BODY.size] = body
        _CRC.pack_into(self._map, _CRC_AT, zlib.crc32(body))
        _SEQ.pack_into(self._map, _SEQ_AT, 2 * seq_lock)

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
        state, detail = self._state, self._detail
        self.waiting(what)
        self._ensure_monitor()
        try:
            yield
        finally:
            self._blocked = None
            self._set(RUNNING if state in (WAITING, NONE) else state, self._action,
                      b"" if state in (WAITING, NONE) else detail)

    @contextlib.contextmanager
    def collective(self, call: Call) -> Iterator[None]:
        """Marks ``call`` (a collective or an object receive) as this rank's wait.

        See [Note: watched collectives]. Inside another watched call (not expected: one thread
        makes one call at a time) only the outer one is recorded.
        """
        if self._call is not None:
            yield
            return
        if call.seq and 0 <= call.group < _GROUPS:
            self._seqs[call.group] = call.seq
        outer = self._blocked
        state, detail = self._state, self._detail
        self._call = call
        self._call_fields = (call.group, call.seq, _encode(call.op, 16), _encode(call.api, 64),
                             _encode(call.what, 64))
        if outer is None:
            self._blocked = describe(call.group, call.op, call.seq, call.api, call.what)
        self._set(WAITING, self._action, _encode(outer or self._blocked or "", 160))
        self._ensure_monitor()
        try:
            yield
        finally:
            self._call, self._call_fields = None, _NO_CALL
            if outer is None:
                self._blocked = None
            self._set(state, self._action, detail)

    def exited(self) -> None:
        """The script ended (at exit, before MPI_Finalize): see [Note: watched collectives].
        The monitor stops: nothing is left to watch."""
        self._closed = True
        self._action = b""
        self._set(EXITED, b"", b"")

    # -- reading -------------------------------------------------------------------------------

    def read(self, rank: int) -> Status | None:
        """Rank ``rank``'s record, or None if it has none (not started, or another host)."""
        if rank == self.rank:
            return _parse(bytes(self._map[:_RECORD.size]), self.host)
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
                    return _parse(raw[:_RECORD.size], self.host)
                time.sleep(0)
        return None  # never a half-written record

    def report(self, now: float | None = None) -> str:
        """A table with one row per rank: what it runs or waits for, and for how long."""
        now = time.time() if now is None else now
        rows = [_row(r, self.pipeline_rank_of(r), self.read(r), now)
                for r in range(self.size)]
        head = ("rank", "pp_rank", "host", "pid", "step", "state", "action", "for", "detail")
        widths = [max(len(head[i]), *(len(row[i]) for row in rows)) for i in range(len(head) - 1)]
        lines = [" | ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + " | " + row[-1]
                 for row in [head, *rows]]
        lines.insert(1, "-+-".join("-" * w for w in widths) + "-+-" + "-" * 6)
        return "\n".join(lines)

    # -- expiry --------------------------------------------------------------------------------

    def expire(self, message: str, frame: FrameType | None = None) -> NoReturn:
        """Prints ``message`` and the table of every rank, then ends the job.

        See [Note: why abort, not raise]. Once per job ([Note: one message per job] in
        tfsmp/failure.py); the stack only with ``TFSMP_DEBUG=1``, else the script's line.

        Args:
            message: What stalled, e.g. the executor's "waited more than stall_timeout=...".
            frame: The stack to show (default: the caller's).

        Raises:
            StepError: when there is no multi-rank MPI job to end.
        """
        text = (f"{message}{self._stopped_or_gone(message)}\nWhat every rank was doing (tfsmp "
                f"watchdog; 'for' = time in that state):\n{self.report()}")
        with self._lock:
            if failure.debugging() or failure.claim_report():
                shown = _strip_tag(text, self.tag)
                stack = traceback.extract_stack(frame or sys._getframe(1))
                if failure.debugging():
                    lines = ["Traceback (most recent call last):",
                             *"".join(traceback.format_list(stack)).splitlines(),
                             f"tfsmp.errors.StepError: {shown}"]
                else:
                    lines = [f"StepError: {shown}", *_script_line(stack)]
                with contextlib.suppress(Exception):
                    sys.stderr.write("".join(f"[{self.tag}] {line}\n"
                                             for chunk in lines for line in chunk.splitlines()))
                    sys.stderr.flush()
            else:  # another rank reports
                time.sleep(failure.REPORT_GRACE)
            relaunch.record_failure(self.tag, "StepError: " + message.splitlines()[0][:300])
            failure.end_job(1)
        raise StepError(text)

    def _stopped_or_gone(self, message: str) -> str:
        """A sentence per rank whose process is stopped or gone, unless ``message`` says so."""
        if "is stopped" in message or "is gone" in message:
            return ""
        said = ""
        for rank in range(self.size):
            st = self.read(rank) if rank != self.rank else None
            if st is not None and st.process in ("stopped", "gone"):
                what = ("stopped (SIGSTOP or a debugger)" if st.process == "stopped" else
                        "gone (killed, crashed or exited)")
                said += f" Rank {rank}'s process {st.pid} is {what}."
        return said

    def _ensure_monitor(self) -> None:
        if self.limit <= 0 or self._monitor is not None:
            return
        main = threading.main_thread().ident
        self._monitor = threading.Thread(target=self._watch, args=(main,), daemon=True,
                                         name="tfsmp-watchdog")
        self._monitor.start()

    def _watch(self, main: int | None) -> None:
        seen: tuple[Any, ...] | None = None
        streak = 0
        while not self._closed:
            time.sleep(min(1.0, self.limit / 4))
            what, call = self._blocked, self._call
            mine = self.read(self.rank)
            if what is None or mine is None or mine.state != "waiting":
                seen, streak = None, 0
                continue
            waited = time.time() - mine.since
            message = None
            if waited > self.limit:
                message = self._stall_message(what, call)
            elif call is not None and call.peer is None and waited >= DEADLOCK_AFTER:
                found = self._deadlock()  # [Note: certain deadlocks]
                streak = streak + 1 if found is not None and found == seen else 0
                seen = found
                if streak >= _DEADLOCK_STREAK:
                    message = self._deadlock_message(what, call, waited)
            if message is not None:
                frame = sys._current_frames().get(main) if main is not None else None
                with contextlib.suppress(StepError):
                    self.expire(message, frame)
                return

    def _deadlock(self) -> tuple[Any, ...] | None:
        """Every rank's record, when together they show a certain deadlock ([Note: certain
        deadlocks]); else None."""
        records: list[Any] = [self.read(r) for r in range(self.size)]
        calls: list[Call] = []
        for st in records:
            if st is None or st.process in ("", "stopped"):  # unknown, or may be resumed
                return None
            if st.state == "exited" or st.process == "gone":
                continue
            members = self._members(st.group, st.rank)
            if st.state != "waiting" or members is None or st.call_seq <= 0:
                return None  # computing, or in a wait that may end
            calls.append(Call(st.group, st.op, st.call_seq, st.api, st.what, members))
        if not calls:
            return None
        for call in calls:
            if all(arrival(call, records[r]) == "arrived" for r in call.ranks):
                return None  # this call can finish, and its ranks go on
        return tuple((st.state, st.group, st.call_seq, st.op, st.api, st.seqs, st.since)
                     for st in records if st is not None)

    def _members(self, group: int, rank: int) -> tuple[int, ...] | None:
        """The world ranks of ``rank``'s group ``group`` (None: not known here)."""
        name = GROUP_NAMES[group] if 0 <= group < len(GROUP_NAMES) else "other"
        if name in ("world", "user_world"):
            return tuple(range(self.size))
        if self.data_ranks is None or name not in (*_SPLIT, "horovod"):
            return None  # other groups' members are not this layer's to know
        # Horovod's world is the data-parallel group (init_horovod checks it), and only
        # tfsmp's reductions through it are counted (HorovodReducer), alike on its members
        ranks = (self.data_ranks if name in ("pipeline", "user_pipeline") else
                 tuple(self.pipeline_rank_of(r) for r in range(self.size)))
        return tuple(r for r in range(self.size) if ranks[r] == ranks[rank])

    def _deadlock_message(self, what: str, call: Call, waited: float) -> str:
        return (f"[{self.tag}] can never finish its wait (found after {waited:.0f}s, without "
                f"waiting for stall_timeout={self.limit}s: every rank of the job waits in a "
                f"collective call that not all ranks made, or has ended its script) "
                + self._explain(what, call))

    def _explain(self, what: str, call: Call) -> str:
        """Who arrived in ``call`` and why the others did not ([Note: who arrived])."""
        members = call.ranks if call.peer is None else (call.peer,)
        statuses: dict[int, Any] = {r: self.read(r) for r in members}
        own = describe(call.group, call.op, call.seq, call.api, call.what)
        return explain(call, self.rank, statuses, "" if what == own else what)

    def _stall_message(self, what: str, call: Call | None) -> str:
        """What the monitor says of a wait past the limit ([Note: who arrived])."""
        head = f"[{self.tag}] waited more than stall_timeout={self.limit}s "
        if call is None:
            return (f"{head}for {what}. A peer rank is stuck or failed; see its row below. "
                    f"Raise stall_timeout in the config if steps are legitimately slow.")
        return head + self._explain(what, call)

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


def _parse(raw: bytes, host: str) -> Status | None:
    try:
        fields = _RECORD.unpack(raw)
    except struct.error:
        return None
    magic, _, pid, rank, pipe, rank_host, state, step, since, action, detail = fields[:11]
    group, call_seq, op, api, what = fields[11:16]
    if magic != _MAGIC:
        return None
    rank_host = _text(rank_host)
    return Status(rank, pipe, pid, rank_host, step, _STATE_NAMES.get(state, "?"),
                  _text(action), _text(detail), since, group, call_seq, _text(op), _text(api),
                  _text(what), tuple(fields[16:]),
                  process_state(pid) if rank_host == host else "")


def process_state(pid: int) -> str:
    """"running" (or sleeping), "stopped" (SIGSTOP, a debugger: state T or t) or "gone"."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except OSError:
        return "running"
    try:  # a zombie is gone too (its parent has not reaped it yet)
        with open(f"/proc/{pid}/stat") as f:
            code = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "running"
    return "gone" if code in ("Z", "X") else "stopped" if code in ("T", "t") else "running"


def _strip_tag(text: str, tag: str) -> str:
    """The message without its own leading ``[tag] `` (each printed line carries the tag)."""
    prefix = f"[{tag}] "
    return text[len(prefix):] if text.startswith(prefix) else text


_LIBRARY_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
                 os.path.dirname(os.__file__) + os.sep)


def _script_line(stack: traceback.StackSummary) -> list[str]:
    """Where the script made the call that waited: its innermost frame outside tfsmp and the
    installed libraries (empty when there is none)."""
    for frame in reversed(stack):
        path = os.path.abspath(frame.filename)
        if (not path.startswith(_LIBRARY_DIRS) and "site-packages" not in path
                and not frame.filename.startswith("<")):
            return [f"(called from {frame.filename}:{frame.lineno} in {frame.name}; "
                    f"TFSMP_DEBUG=1 shows the stack)"]
    return []


def _row(rank: int, pipeline_rank: int, st: Status | None, now: float) -> list[str]:
    if st is None:
        return [str(rank), str(pipeline_rank), "?", "?", "?", "no status", "-", "-",
                f"no status file (not started yet, or on another host: set {DIR_ENV} to a "
                f"directory every host shares)"]
    detail, state = st.detail, st.state
    if state == "running":
        detail = "computing or in the script's own code" if st.action else "starting the step"
    if state == "started":
        detail = "has not run a pipeline step yet"
    if state == "exited":
        detail = "its script ended (waits in MPI_Finalize)"
    if state == "waiting" and st.group >= 0 and not detail:
        detail = describe(st.group, st.op, st.call_seq, st.api, st.what)
    if st.process == "stopped":
        state = "stopped"
        detail = (f"process {st.pid} is stopped (SIGSTOP or a debugger); last: "
                  f"{st.state}{', ' + detail if detail else ''}")
    if st.process == "gone":
        detail = f"process {st.pid} is gone (killed or crashed); last: {detail or st.state}"
    return [str(rank), str(st.pipeline_rank), st.host, str(st.pid), str(st.step), state,
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
    data_ranks = tuple(st.topology.data_rank_of(r) for r in range(size))
    old = _PROCESS[2] if _PROCESS is not None else None
    if old is not None and (old.rank, old.size, old.pipeline_ranks, old.data_ranks) == (
            st.rank, size, pipeline_ranks, data_ranks):
        old.limit = limit  # the same layout: keep the file, steps count on
        _PROCESS = (st, limit, old)
        return old
    if old is not None:  # close first: the new one reuses the file name
        old.close()
    dog = Watchdog(st.rank, size, pipeline_ranks, limit=limit, data_ranks=data_ranks)
    _PROCESS = (st, limit, dog)
    return dog


def current() -> Watchdog | None:
    """The watchdog `for_process` last made, if any (never makes one: for exit hooks)."""
    return _PROCESS[2] if _PROCESS is not None else None


@contextlib.contextmanager
def watched(group: Any, op: str, peer: int | None = None) -> Iterator[None]:
    """Runs a blocking call of ``group`` under this process's watchdog.

    See [Note: watched collectives]. A collective (``peer`` None) counts as the group's next
    call on every rank, watchdog or not, so the counts agree between ranks.

    Args:
        group: A `Group` (its ``index``, ``ranks`` and ``calls`` are read; ``calls`` goes up).
        op: The operation, e.g. "allgather_obj".
        peer: For a receive, the sender's index in ``group``.
    """
    seq = 0
    if peer is None:
        seq = group.calls = getattr(group, "calls", 0) + 1
    dog = for_process()
    if dog is None:
        yield
        return
    ranks = getattr(group, "ranks", ())
    source = ranks[peer] if peer is not None and 0 <= peer < len(ranks) else peer
    with dog.collective(Call.of(group, op, seq, source)):
        yield


def _close_process() -> None:
    """At exit: a record that says the script ended where Open MPI cleans up the directory,
    else no file left behind ([Note: watched collectives])."""
    if _PROCESS is None:
        return
    dog = _PROCESS[2]
    if os.environ.get("OMPI_FILE_LOCATION") and not os.environ.get(DIR_ENV):
        dog.exited()
        return
    dog.close(remove_directory=True)


atexit.register(_close_process)
