"""The local backend of the comm seam: every rank is a thread of one process (for fast tests).

It keeps MPI's matching rules: a receive takes the earliest pending message from its source with
its tag (messages between a pair never overtake each other), collectives are matched by call order.
Sends copy the buffer (so they complete at once, like buffered MPI sends) unless `sync=True`.
Every wait has a timeout and wakes on `abort`, so a deadlock in a test fails instead of hanging.

Example::

    comms = create_local_comms(Topology(world_size=4, partitions=2))
    threads = [threading.Thread(target=worker, args=(c,)) for c in comms]
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import reduce
from typing import TYPE_CHECKING, Any

import numpy as np

from tfsmp.comm.base import REDUCE_OPS, Comm, Group, check_buffer
from tfsmp.errors import CommError

if TYPE_CHECKING:
    from tfsmp.topology import Topology

__all__ = ["LocalGroup", "LocalRequest", "create_local_comms", "local_groups"]


class _Fabric:
    """State shared by all threads of one simulated job: one lock, the abort flag, the timeout."""

    def __init__(self, timeout: float) -> None:
        self.cond = threading.Condition()
        self.timeout = timeout
        self.aborted: tuple[int, int] | None = None   # (world rank, code)

    def wait_for(self, predicate: Callable[[], bool], what: str) -> None:
        """Waits (holding `cond`) until `predicate()`; raises on abort or timeout."""
        deadline = time.monotonic() + self.timeout
        while not predicate():
            if self.aborted is not None:
                rank, code = self.aborted
                raise CommError(f"the job was aborted by rank {rank} (code {code}) while "
                                f"waiting for {what}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CommError(f"no match for {what} within {self.timeout:.0f} s. Fix: check "
                                "that every rank posts the matching call (deadlock?).")
            self.cond.wait(remaining)


class LocalRequest:
    """A request completed by another thread."""

    __slots__ = ("_fabric", "_what", "done", "value")

    def __init__(self, fabric: _Fabric, what: str, done: bool = False) -> None:
        self._fabric = fabric
        self._what = what
        self.done = done
        self.value: Any = None

    def wait(self) -> None:
        with self._fabric.cond:
            self._fabric.wait_for(lambda: self.done, self._what)

    def test(self) -> bool:
        return self.done


@dataclass
class _Message:
    source: int
    tag: int
    payload: Any                    # np.ndarray copy, or pickled bytes
    is_obj: bool
    on_match: LocalRequest | None   # a sync send's request


@dataclass
class _Receive:
    source: int
    tag: int
    buf: np.ndarray | None          # None: an object receive
    request: LocalRequest


@dataclass
class _Round:
    slots: list[Any]
    arrived: int = 0
    left: int = 0


@dataclass
class _Channel:
    """One communicator as all its members see it."""

    fabric: _Fabric
    ranks: list[int]
    inbox: list[list[_Message]] = field(default_factory=list)
    posted: list[list[_Receive]] = field(default_factory=list)
    rounds: dict[int, _Round] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.inbox = [[] for _ in self.ranks]
        self.posted = [[] for _ in self.ranks]


def _deliver(msg: _Message, recv: _Receive) -> None:
    """Completes `recv` with `msg` (caller holds the lock)."""
    if msg.is_obj != (recv.buf is None):
        raise CommError("a buffer message must be received into a buffer and a pickled one with "
                        f"recv_obj. Received: tag={msg.tag} from source={msg.source}")
    if recv.buf is None:
        recv.request.value = pickle.loads(msg.payload)
    else:
        data = msg.payload.reshape(-1).view(np.uint8)
        target = recv.buf.reshape(-1).view(np.uint8)
        if data.size > target.size:
            raise CommError(f"a message must fit its receive buffer. Received: {data.size} bytes "
                            f"for a {target.size}-byte buffer (tag={msg.tag}, source={msg.source})")
        target[: data.size] = data
    recv.request.done = True
    if msg.on_match is not None:
        msg.on_match.done = True


class LocalGroup(Group):
    """One member's handle on a `_Channel` (thread-safe; one handle per rank)."""

    def __init__(self, channel: _Channel, rank: int) -> None:
        self._chan = channel
        self._fabric = channel.fabric
        self.rank = rank
        self.size = len(channel.ranks)
        self.ranks = list(channel.ranks)
        self._seq = 0

    # point-to-point ------------------------------------------------------------------------
    def _send(self, payload: Any, dest: int, tag: int, is_obj: bool, sync: bool) -> LocalRequest:
        self.check_peer(dest, "dest")
        req = LocalRequest(self._fabric, f"a receive of tag {tag} by rank {dest}", done=not sync)
        msg = _Message(self.rank, tag, payload, is_obj, req if sync else None)
        with self._fabric.cond:
            posted = self._chan.posted[dest]
            match = next((r for r in posted if r.source == self.rank and r.tag == tag), None)
            if match is None:
                self._chan.inbox[dest].append(msg)
            else:
                posted.remove(match)
                _deliver(msg, match)
            self._fabric.cond.notify_all()
        return req

    def _recv(self, buf: np.ndarray | None, source: int, tag: int) -> LocalRequest:
        self.check_peer(source, "source")
        req = LocalRequest(self._fabric, f"a message with tag {tag} from rank {source}")
        recv = _Receive(source, tag, buf, req)
        with self._fabric.cond:
            inbox = self._chan.inbox[self.rank]
            match = next((m for m in inbox if m.source == source and m.tag == tag), None)
            if match is None:
                self._chan.posted[self.rank].append(recv)
            else:
                inbox.remove(match)
                _deliver(match, recv)
                self._fabric.cond.notify_all()
        return req

    def isend(self, buf: np.ndarray, dest: int, tag: int) -> LocalRequest:
        check_buffer(buf)
        return self._send(buf.copy(), dest, tag, is_obj=False, sync=False)

    def irecv(self, buf: np.ndarray, source: int, tag: int) -> LocalRequest:
        check_buffer(buf, writable=True)
        return self._recv(buf, source, tag)

    def isend_obj(self, obj: Any, dest: int, tag: int = 0, *, sync: bool = False) -> LocalRequest:
        return self._send(pickle.dumps(obj), dest, tag, is_obj=True, sync=sync)

    def recv_obj(self, source: int, tag: int = 0) -> Any:
        req = self._recv(None, source, tag)
        req.wait()
        return req.value

    # collectives ----------------------------------------------------------------------------
    def _exchange(self, contribution: Any) -> list[Any]:
        """Every member deposits one value and gets all of them (matched by call order)."""
        seq, self._seq = self._seq, self._seq + 1
        chan = self._chan
        with self._fabric.cond:
            rnd = chan.rounds.setdefault(seq, _Round([None] * self.size))
            rnd.slots[self.rank] = contribution
            rnd.arrived += 1
            self._fabric.cond.notify_all()
            self._fabric.wait_for(lambda: rnd.arrived == self.size,
                                  f"collective #{seq} on ranks {self.ranks}")
            rnd.left += 1
            if rnd.left == self.size:
                del chan.rounds[seq]
            return list(rnd.slots)

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        self.check_peer(root, "root")
        slots = self._exchange(pickle.dumps(obj) if self.rank == root else None)
        return pickle.loads(slots[root])

    def allgather_obj(self, obj: Any) -> list[Any]:
        return [pickle.loads(b) for b in self._exchange(pickle.dumps(obj))]

    def barrier(self) -> None:
        self._exchange(None)

    def allreduce_(self, buf: np.ndarray) -> None:
        check_buffer(buf, writable=True)
        parts = self._exchange(buf.copy())
        # Summed in member order on every rank, so all ranks get bit-identical results.
        buf[...] = reduce(np.add, parts)

    def allreduce_obj(self, obj: Any, op: str = "sum") -> Any:
        if op not in REDUCE_OPS:
            raise CommError(f"op must be one of {sorted(REDUCE_OPS)}. Received: op={op!r}")
        values = [pickle.loads(b) for b in self._exchange(pickle.dumps(obj))]
        return reduce(REDUCE_OPS[op], values)


def local_groups(fabric: _Fabric, member_lists: list[list[int]]) -> dict[int, LocalGroup]:
    """One channel per list of world ranks; returns each world rank's handle."""
    handles: dict[int, LocalGroup] = {}
    for ranks in member_lists:
        channel = _Channel(fabric, list(ranks))
        for index, rank in enumerate(ranks):
            handles[rank] = LocalGroup(channel, index)
    return handles


def _unique(groups: list[list[int]]) -> list[list[int]]:
    seen: dict[tuple[int, ...], list[int]] = {}
    for g in groups:
        seen.setdefault(tuple(g), list(g))
    return list(seen.values())


def create_local_comms(topology: Topology, *, timeout: float = 120.0) -> list[Comm]:
    """Builds one `Comm` per rank of `topology`, for threads of this process.

    Args:
        topology: The rank layout.
        timeout: Seconds any wait may block before raising CommError (deadlock guard).

    Returns:
        `comms[r]` is world rank r's Comm; use each from its own thread.
    """
    fabric = _Fabric(timeout)
    n = topology.world_size
    world_ranks = [list(range(n))]
    mp = _unique([topology.mp_group(r) for r in range(n)])
    dp = _unique([topology.dp_group(r) for r in range(n)])
    kinds = [local_groups(fabric, lists) for lists in (world_ranks, mp, dp) * 2]

    def abort(rank: int) -> Callable[[int], None]:
        def _abort(code: int) -> None:
            with fabric.cond:
                if fabric.aborted is None:
                    fabric.aborted = (rank, code)
                fabric.cond.notify_all()
            raise CommError(f"rank {rank} aborted the job (code {code})")
        return _abort

    return [
        Comm(backend="local", world=kinds[0][r], pipeline=kinds[1][r], data=kinds[2][r],
             user_world=kinds[3][r], user_pipeline=kinds[4][r], user_data=kinds[5][r],
             local_rank=r, local_size=n, _abort=abort(r))
        for r in range(n)
    ]
