"""Boundary transfers between ranks of one host through shared memory instead of MPI.

Example::

    channels = Channels.create(comm)            # collective over ``comm`` (an mpi4py comm)
    if channels.usable(1):
        outbox = channels.outbox(1)
        outbox.send(view, tag)                  # False: it went by MPI (see below)
    req = channels.inbox(0).receive(tag, shape, dtype, fallback)
    while not req.test(): ...
    req.tensor                                  # a tensor over the sender's memory

[Note: shared-memory transfers] Open MPI moves a large message between two processes of one
host with one copy made by the receiver out of the sender's pages (CMA, a system call that pins
and walks the sender's pages), after a rendezvous of small messages. Measured with raw ping-pongs
on this host (2026-12-06, one thread per rank, 41 rounds), a copy by the sender into memory both
processes map, announced by a word the receiver polls, took 19 us a 256 KB round trip against
37 us for blocking mpi4py ``Send``/``Recv`` of the same tensor, 63 against 97 us at 1 MB, 291
against 593 us at 4 MB and 3.0 against 3.5 ms at 16 MB. The executor's own Python around a
message (a tensor's memory, the handlers, a DLPack tensor for what arrived) costs more than the
difference between MPI's blocking and non-blocking calls, so through MPI a boundary transfer
stayed at 0.5-0.8 of raw mpi4py at 256 KB-1 MB on this host; the copy saved here pays for it.

How it works. Every rank of a group with channels (the pipeline group) has an *outbox*: an
anonymous shared-memory file (``memfd_create``), sparse, with a region of `REGION` bytes per
destination rank. A region holds:

- a message log: ``head`` (messages written, by the sender), ``tail`` (messages read, by the
  receiver), and `LOG_ENTRIES` entries of (tag, offset, bytes) in a ring;
- slots: a 64-byte line whose first word is the slot's state (`FREE` or `FULL`), then the data,
  allocated at the region's end as needed and reused by size.

A send takes a `FREE` slot of the message's size (or a new one), marks it `FULL`, copies the
tensor's bytes in, writes the log entry and then ``head``. The receiver polls ``head``, reads the
new entries into a table by tag, and for its tag makes a tensor over the slot in place (DLPack,
no copy). The slot stays `FULL` while anything references that tensor's memory (`held`, as the
receive pool's rings: [Note: receive buffers] in tfsmp/runtime/buffers.py); the receiver writes
`FREE` once it sees the memory unreferenced, at its next receive from that sender. So a stage that
consumes what it receives before the next message cycles through one slot, and one that keeps its
inputs for the backward holds a slot per microbatch, as it held a receive buffer before.

A send never waits for its receiver: the copy is made when the send is issued, wherever the
receiver is (a rendezvous needs the receiver's receive, which is why the executor posts them
ahead: [Note: pre-posted receives]). So a schedule that is deadlock-free with non-blocking MPI
sends is with these. A region whose slots are used up (`REGION` bytes in flight or held) sends
by MPI instead: the log entry says so (offset -1) and the receiver then posts an MPI receive
for the tag (`ShmReceive`).

Ordering. The sender's stores (data, entry, ``head``) become visible to the other core in program
order on x86-64 (total store order), and the receiver's loads (``head``, then the entry, then the
data) are not reordered either; Python runs each store as its own call. Other architectures
would need fences, so channels are made on x86-64 Linux only; elsewhere every transfer goes by
MPI. ``TFSMP_SHM_TRANSFERS=0`` turns them off (every pair then goes by MPI).

Lifetime. The file has no name: it is freed when the last process that maps it exits, however it
exits, so a killed job leaves nothing in ``/dev/shm``; its pages count against the memory of the
rank that writes them (its memory cgroup, under ``--memory-per-rank``). Setting up is collective
(`Channels.create`): every rank makes its outbox, the ranks exchange (host, pid, descriptor), each
maps the region its same-host peers keep for it through ``/proc/<pid>/fd/<fd>``, and a second
exchange keeps the pairs where both sides could; any other pair (another host, a ``/proc`` that
does not allow it) goes by MPI.
"""

from __future__ import annotations

import mmap
import os
import platform
import socket
import sys
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from tfsmp.errors import StepError

__all__ = ["FREE", "FULL", "LOG_ENTRIES", "MIN_BYTES", "REGION", "Channels", "Inbox", "Outbox",
           "ShmReceive", "supported"]

REGION = 1 << 32  # bytes of one sender's region per destination: virtual, sparse
LOG_ENTRIES = 1 << 16  # log ring entries per region (a step's messages to one peer: at most half)
FREE, FULL = 0, 1
_HEAD, _TAIL, _LOG = 0, 8, 16  # int64 word indices: head, tail (own cache lines), entries
_ENTRY = 4  # words per entry: tag, offset, bytes, unused
_SLOTS = 4 << 20  # first slot's byte offset (the log above takes 2 MiB + 128 bytes)
_LINE = 64  # a slot's state line; its data follows, 64-byte aligned as DLPack wants
_PAGE = 4096
ENV = "TFSMP_SHM_TRANSFERS"
MIN_BYTES_ENV = "TFSMP_SHM_MIN_BYTES"
MIN_BYTES = 2 << 20  # smaller messages go by MPI: [Note: shared-memory transfers]


def supported() -> bool:
    """Whether this process may make channels: x86-64 Linux with ``memfd_create``, and not
    turned off by ``TFSMP_SHM_TRANSFERS=0`` ([Note: shared-memory transfers])."""
    return (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")
            and hasattr(os, "memfd_create") and os.environ.get(ENV, "1") != "0")


def _host_key() -> str:
    """This host, as two processes that can share memory agree on it (name and boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _words(mm: mmap.mmap, offset: int) -> np.ndarray:
    """The int64 words of the region at ``offset`` of ``mm``."""
    return np.frombuffer(mm, dtype=np.int64, count=REGION // 8, offset=offset)


class Outbox:
    """What this rank sends to one destination: its region of this rank's outbox."""

    def __init__(self, mm: mmap.mmap, offset: int) -> None:
        self.mm, self.offset = mm, offset
        self.words = _words(mm, offset)
        self.head = 0
        self.top = _SLOTS  # next free byte of the region for a new slot
        self.slots: dict[int, list[tuple[int, dict[Any, np.ndarray]]]] = {}  # bytes -> slots
        self.exhausted = False

    def send(self, view: np.ndarray, tag: int) -> bool:
        """Copies ``view`` (C-contiguous) into a slot and logs it under ``tag``; False when no
        slot is left, having logged that ``tag`` goes by MPI (the caller then sends it)."""
        words, n = self.words, view.nbytes
        slot = None
        for s in self.slots.get(n, ()):
            if words[s[0]] == FREE:
                slot = s
                break
        if slot is None:
            slot = self._new_slot(n)
            if slot is None:
                self._log(tag, -1, n)
                return False
        state, views = slot
        words[state] = FULL
        key = (view.dtype, view.shape)
        dst = views.get(key)
        if dst is None:
            dst = views[key] = np.frombuffer(
                self.mm, dtype=view.dtype, count=view.size,
                offset=self.offset + state * 8 + _LINE).reshape(view.shape)
        np.copyto(dst, view, casting="no")
        self._log(tag, state * 8 + _LINE, n)
        return True

    def _new_slot(self, n: int) -> tuple[int, dict[Any, np.ndarray]] | None:
        start = self.top
        end = start + _LINE + -(-n // _PAGE) * _PAGE
        if end > REGION:
            return None
        self.top = end
        slot: tuple[int, dict[Any, np.ndarray]] = (start // 8, {})
        self.words[slot[0]] = FREE
        self.slots.setdefault(n, []).append(slot)
        return slot

    def _log(self, tag: int, offset: int, n: int) -> None:
        words, head = self.words, self.head
        if head - int(words[_TAIL]) >= LOG_ENTRIES:  # the executor sends fewer per step
            raise StepError(
                f"more than {LOG_ENTRIES} messages to one rank are not yet read by it. Received: "
                f"a step sending more than {LOG_ENTRIES // 2} messages over one stage pair. Fix: "
                f"set {ENV}=0 to send them by MPI.")
        j = _LOG + (head % LOG_ENTRIES) * _ENTRY
        words[j] = tag
        words[j + 1] = offset
        words[j + 2] = n
        self.head = head = head + 1
        words[_HEAD] = head  # last: the entry and the data are visible before it


class Inbox:
    """What this rank receives from one sender: the region the sender keeps for it, mapped."""

    def __init__(self, mm: mmap.mmap, src: int) -> None:
        self.mm, self.src = mm, src
        self.words = _words(mm, 0)
        self.cursor = 0  # log entries read
        self.arrived: dict[int, deque[tuple[int, int]]] = {}  # tag -> (offset, bytes), in order
        self.views: dict[tuple[int, Any, tuple[int, ...]], np.ndarray] = {}
        self.handed: dict[tuple[int, Any, tuple[int, ...]], int] = {}  # view key -> state word

    def poll(self) -> None:
        """Reads the log entries written since the last poll."""
        words = self.words
        head = int(words[_HEAD])
        cursor = self.cursor
        if head == cursor:
            return
        arrived = self.arrived
        while cursor < head:
            j = _LOG + (cursor % LOG_ENTRIES) * _ENTRY
            tag, offset, n = int(words[j]), int(words[j + 1]), int(words[j + 2])
            q = arrived.get(tag)
            if q is None:
                arrived[tag] = deque([(offset, n)])
            else:
                q.append((offset, n))
            cursor += 1
        self.cursor = cursor
        words[_TAIL] = cursor

    def take(self, tag: int) -> tuple[int, int] | None:
        """The (offset, bytes) of the next message logged under ``tag``, if it is in."""
        q = self.arrived.get(tag)
        if q is None:
            self.poll()
            q = self.arrived.get(tag)
            if q is None:
                return None
        got = q.popleft()
        if not q:
            del self.arrived[tag]
        return got

    def tensor(self, offset: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any:
        """A tensor over the slot at ``offset`` (its state is `FULL` until `reclaim` frees it)."""
        import tensorflow as tf

        key = (offset, dtype, shape)
        view = self.views.get(key)
        if view is None:
            count = int(np.prod(shape, dtype=np.int64))
            view = self.views[key] = np.frombuffer(
                self.mm, dtype=dtype, count=count, offset=offset).reshape(shape)
        self.handed[key] = (offset - _LINE) // 8
        return tf.experimental.dlpack.from_dlpack(view.__dlpack__())

    def reclaim(self) -> None:
        """Frees the slots whose tensors nothing references any more ([Note: shared-memory
        transfers]: ``held``, as the receive pool's rings)."""
        from tfsmp.runtime.buffers import held

        handed = self.handed
        if not handed:
            return
        views, words = self.views, self.words
        for key in list(handed):
            view = views[key]  # a name: `held` counts the caller's reference to it
            if not held(view):
                words[handed.pop(key)] = FREE


class ShmReceive:
    """A receive from an `Inbox`: a `Request` whose ``tensor`` is what arrived."""

    __slots__ = ("dtype", "fallback", "inbox", "mpi", "shape", "tag", "tensor")

    def __init__(self, inbox: Inbox, tag: int, shape: tuple[int, ...], dtype: np.dtype[Any],
                 fallback: Callable[[], tuple[Any, Any]]) -> None:
        self.inbox, self.tag, self.shape, self.dtype = inbox, tag, shape, dtype
        self.fallback = fallback  # () -> (MPI request, tensor): when the sender went by MPI
        self.mpi: Any = None
        self.tensor: Any = None

    def test(self) -> bool:
        if self.mpi is not None:  # it went by MPI
            return bool(self.mpi.test())
        if self.tensor is not None:
            return True
        got = self.inbox.take(self.tag)
        if got is None:
            return False
        offset, n = got
        if offset < 0:  # the sender's region was full: it sent by MPI
            self.mpi, self.tensor = self.fallback()
            return bool(self.mpi.test())
        want = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        if n != want:
            raise StepError(
                f"a message from rank {self.inbox.src} has {n} bytes, its plan {want} (tag "
                f"{self.tag}, shape {self.shape}). Received: mismatched stage plans. Fix: run "
                f"every rank with the same model, config and batch shapes.")
        self.tensor = self.inbox.tensor(offset, self.shape, self.dtype)
        return True

    def wait(self) -> None:
        while not self.test():
            os.sched_yield()


class Channels:
    """This rank's outbox and its inboxes, per peer of one group where both sides map them."""

    def __init__(self, rank: int, outboxes: dict[int, Outbox], inboxes: dict[int, Inbox],
                 fd: int | None, min_bytes: int = MIN_BYTES) -> None:
        self.rank = rank
        self._out, self._in, self.fd = outboxes, inboxes, fd
        self.min_bytes = min_bytes  # messages of fewer bytes go by MPI

    def usable(self, peer: int) -> bool:
        """Whether messages to and from group rank ``peer`` go through shared memory."""
        return peer in self._out

    def outbox(self, peer: int) -> Outbox:
        return self._out[peer]

    def inbox(self, peer: int) -> Inbox:
        return self._in[peer]

    @classmethod
    def create(cls, comm: Any) -> Channels:
        """Sets up the channels of the mpi4py communicator ``comm``: collective over it
        ([Note: shared-memory transfers])."""
        rank, size = comm.Get_rank(), comm.Get_size()
        fd, mm = None, None
        if size > 1 and supported():
            try:
                fd = os.memfd_create("tfsmp-p2p", os.MFD_CLOEXEC)
                os.ftruncate(fd, REGION * size)
                mm = mmap.mmap(fd, REGION * size)
            except (OSError, ValueError, OverflowError):
                if fd is not None:
                    os.close(fd)
                fd, mm = None, None
        host = _host_key()
        infos = comm.allgather((host, os.getpid(), -1 if fd is None else fd, _min_bytes()))
        min_bytes = infos[0][3]  # rank 0's: every rank decides alike
        maps: dict[int, mmap.mmap] = {}
        if fd is not None:
            for peer, (peer_host, pid, peer_fd, _) in enumerate(infos):
                if peer == rank or peer_host != host or peer_fd < 0:
                    continue
                try:
                    other = os.open(f"/proc/{pid}/fd/{peer_fd}", os.O_RDWR)
                except OSError:
                    continue
                try:
                    maps[peer] = mmap.mmap(other, REGION, offset=REGION * rank)
                except (OSError, ValueError):
                    pass
                finally:
                    os.close(other)
        mapped = comm.allgather(sorted(maps))
        both = [p for p in maps if rank in mapped[p]]
        outboxes = {p: Outbox(mm, REGION * p) for p in both} if mm is not None else {}
        inboxes = {p: Inbox(maps[p], p) for p in both}
        return cls(rank, outboxes, inboxes, fd, min_bytes)


def _min_bytes() -> int:
    """`MIN_BYTES`, or ``TFSMP_SHM_MIN_BYTES`` where set (the tests send small messages)."""
    text = os.environ.get(MIN_BYTES_ENV, "")
    try:
        return max(0, int(text)) if text else MIN_BYTES
    except ValueError as e:
        raise ValueError(f"{MIN_BYTES_ENV} must be a whole number of bytes. Received: "
                         f"{MIN_BYTES_ENV}={text!r}. Fix: unset it or give bytes, "
                         f"e.g. {MIN_BYTES}.") from e
