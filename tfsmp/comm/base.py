"""The communication seam: `Group` (one communicator), `Comm` (all of a rank's groups), `Request`.

Every backend (`mpi`, `local`) implements `Group`; the runtime and the process API use only this
interface. Semantics follow MPI: point-to-point messages match on (source, tag) within one group
and never overtake each other between the same pair of ranks; collectives must be called by every
member of the group in the same order.

[Note: separate communicators] A `Comm` holds six groups. `world`, `pipeline` and `data` carry the
runtime's traffic (activations, gradients, fused allreduce); `user_world`, `user_pipeline` and
`user_data` carry the SMP-level `smp.send/recv_from/broadcast/allgather/barrier` calls. Each is its
own communicator (MPI `Dup`/`Split`), so a user's `smp.send` can never be matched by a pipeline
receive, and a collective issued by the runtime never pairs with one issued by the script.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from tfsmp.errors import CommError

__all__ = ["REDUCE_OPS", "Comm", "Group", "Request", "check_buffer", "testall", "waitall"]

# Op names accepted by `Group.allreduce_obj`, with the Python reduction the local backend uses.
REDUCE_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "sum": lambda a, b: a + b,
    "max": max,
    "min": min,
    "and": lambda a, b: bool(a and b),
    "or": lambda a, b: bool(a or b),
}


class Request(Protocol):
    """A non-blocking operation in flight."""

    def wait(self) -> None:
        """Blocks until the operation completed."""

    def test(self) -> bool:
        """Returns True when the operation completed (never blocks)."""


class Group(abc.ABC):
    """A communicator over some ranks; every rank argument is an index into this group.

    Example::

        req = comm.pipeline.irecv(buf, source=stage - 1, tag=7)
        comm.pipeline.isend(out, dest=stage + 1, tag=7).wait()
        req.wait()
        comm.data.allreduce_(flat_grads)          # in-place sum over the stage's replicas
    """

    rank: int          # my index in the group
    size: int
    ranks: list[int]   # global (world) ranks, in group order
    index: int = 7     # which of a Comm's groups (tfsmp.comm.calls.GROUP_NAMES); set by Comm
    calls: int = 0     # collective calls so far ([Note: who arrived] in tfsmp/comm/calls.py)
    spin: float = 0.0  # seconds a wait polls its requests without pausing ([Note: polling])

    @abc.abstractmethod
    def isend(self, buf: np.ndarray, dest: int, tag: int) -> Request:
        """Starts sending a contiguous numpy buffer; do not modify it before `wait()`."""

    @abc.abstractmethod
    def irecv(self, buf: np.ndarray, source: int, tag: int) -> Request:
        """Starts receiving into a preallocated contiguous buffer of the sent shape and dtype."""

    @abc.abstractmethod
    def isend_obj(self, obj: Any, dest: int, tag: int = 0, *, sync: bool = False) -> Request:
        """Starts sending a pickled object; with `sync`, `wait()` returns once it was received."""

    @abc.abstractmethod
    def recv_obj(self, source: int, tag: int = 0) -> Any:
        """Receives a pickled object sent by `send_obj`/`isend_obj`."""

    @abc.abstractmethod
    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        """Returns `root`'s object on every member."""

    @abc.abstractmethod
    def allgather_obj(self, obj: Any) -> list[Any]:
        """Returns every member's object, element i from member i."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Returns once every member entered the barrier."""

    @abc.abstractmethod
    def allreduce_(self, buf: np.ndarray) -> None:
        """Sums `buf` element-wise over the members, in place."""

    @abc.abstractmethod
    def allreduce_obj(self, obj: Any, op: str = "sum") -> Any:
        """Reduces picklable values with `op` in REDUCE_OPS ("sum", "max", "min", "and", "or")."""

    def p2p(self) -> tuple[Callable[[Any, int, int], Request], Callable[[np.ndarray, int, int], Request]]:
        """``(isend, irecv)`` for messages whose buffers and peers the caller guarantees (the
        executor's come from its message plan: [Note: message plan] in
        tfsmp/runtime/executor.py). ``isend`` takes any object exporting a C-contiguous
        buffer: an array, or a CPU EagerTensor itself ([Note: direct sends] in
        tfsmp/runtime/buffers.py). A group may drop the per-call checks there; by default these are `isend`
        and `irecv`."""
        return (lambda buf, dest, tag: self.isend(np.asarray(buf), dest, tag)), self.irecv

    def send_obj(self, obj: Any, dest: int, tag: int = 0) -> None:
        """Sends a pickled object (small control data)."""
        self.isend_obj(obj, dest, tag).wait()

    def free(self) -> None:  # noqa: B027 - optional hook, nothing to free by default
        """Releases the communicator; the group is unusable afterwards."""

    def check_peer(self, peer: int, what: str = "rank") -> None:
        """Raises CommError unless `peer` is an index in this group."""
        if not 0 <= peer < self.size:
            raise CommError(f"{what} must be in [0, {self.size}) for this group of ranks "
                            f"{self.ranks}. Received: {what}={peer}")


@dataclass
class Comm:
    """All communicators of one rank (see [Note: separate communicators]).

    Example::

        comm = create_mpi_comm(topology)
        comm.pipeline.rank == topology.pipeline_rank_of(comm.world.rank)
        comm.data.rank == topology.data_rank_of(comm.world.rank)
    """

    backend: str
    world: Group
    pipeline: Group       # ranks of my replica, index == stage (SMP's mp group)
    data: Group           # ranks holding my stage, index == data rank (SMP's dp group)
    user_world: Group
    user_pipeline: Group
    user_data: Group
    local_rank: int = 0
    local_size: int = 1
    tag_ub: int = 2**31 - 1
    _abort: Callable[[int], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for index, group in enumerate(self.groups()):
            group.index = index

    def abort(self, code: int = 1) -> None:
        """Ends every rank of the job (MPI_Abort); in the local backend wakes every waiter."""
        if self._abort is not None:
            self._abort(code)

    def groups(self) -> list[Group]:
        """The six groups, runtime ones first."""
        return [self.world, self.pipeline, self.data,
                self.user_world, self.user_pipeline, self.user_data]

    def free(self) -> None:
        """Releases every communicator."""
        for group in self.groups():
            group.free()


def check_buffer(buf: np.ndarray, *, writable: bool = False) -> None:
    """Raises CommError unless `buf` is a C-contiguous numpy array (and writable if asked)."""
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
        raise CommError("point-to-point buffers must be C-contiguous numpy arrays. Received: "
                        f"type={type(buf).__name__}. Fix: pass np.ascontiguousarray(x).")
    if writable and not buf.flags.writeable:
        raise CommError("a receive buffer must be writable. Received: a read-only array. "
                        "Fix: preallocate it with np.empty(shape, dtype).")


def waitall(reqs: Sequence[Request]) -> None:
    """Waits for every request (MPI requests together, in one `Waitall`)."""
    if not reqs:
        return
    batch = getattr(type(reqs[0]), "waitall", None)
    if batch is not None and all(type(r) is type(reqs[0]) for r in reqs):
        batch(reqs)
        return
    for req in reqs:
        req.wait()


def testall(reqs: Sequence[Request]) -> bool:
    """Whether every request completed, never blocking (MPI requests in one `Testall`)."""
    if len(reqs) == 1:  # the executor's common case: one boundary tensor per message
        return reqs[0].test()
    if not reqs:
        return True
    kind = type(reqs[0])
    batch = getattr(kind, "testall", None)
    if batch is not None and all(type(r) is kind for r in reqs):
        return bool(batch(reqs))
    return all([req.test() for req in reqs])  # a list: every request gets its test (progress)
