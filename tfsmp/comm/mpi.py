"""The mpi4py backend of the comm seam: buffer `Isend/Irecv` for tensors, pickles for control data."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tfsmp.comm.base import REDUCE_OPS, Comm, Group, check_buffer
from tfsmp.comm.calls import same_call, signature
from tfsmp.comm.watchdog import watched
from tfsmp.errors import CommError

if TYPE_CHECKING:
    from tfsmp.topology import Topology

__all__ = ["SHARED_SPIN", "SPIN", "MpiGroup", "MpiRequest", "create_mpi_comm", "mpi", "spin_seconds", "world_size"]


def mpi() -> Any:
    """Imports and returns `mpi4py.MPI` (initializing MPI on first use)."""
    from mpi4py import MPI

    return MPI


def world_size() -> int:
    """Size of MPI's COMM_WORLD (initializes MPI)."""
    return int(mpi().COMM_WORLD.Get_size())


def _testall() -> Any:
    """`MPI.Request.Testall`, looked up once (a wait calls it in a loop: [Note: polling])."""
    global _TESTALL
    if _TESTALL is None:
        _TESTALL = mpi().Request.Testall
    return _TESTALL


_TESTALL: Any = None


def spin_seconds(environ: Mapping[str, str] | None = None, cpus: int | None = None,
                 affinity: int | None = None) -> float:
    """How long a wait of this process polls without pausing ([Note: polling] in
    tfsmp/runtime/executor.py): `SPIN` when this rank is pinned to cores of its own,
    `SHARED_SPIN` when it is not pinned but this host has a core for each compute thread of
    each of its ranks, else 0.

    Pinned (``mpirun --bind-to core``) means its CPU affinity times this host's ranks fits
    in the host's CPUs, so no other rank of the job shares its cores. Unpinned ranks (tfsmp's
    launcher passes ``--bind-to none``) may share a core with the very peer they wait for
    whenever the host is busy, and a long spin then burns the time the peer needs; a short one
    costs the peer at most `SHARED_SPIN` per wait and catches a message that is already on its
    way. A rank whose TensorFlow may use every core (no ``TF_NUM_INTRAOP_THREADS``, the
    default) would take that time from a computing peer's own threads, so it spins only where
    ranks times their threads fit the host's cores (as the benchmarks' and the tests'
    one-thread ranks do). More ranks than cores (``--oversubscribe``) never spin. (One A/B of a
    test file of 2- and 4-rank jobs on 2 cores, one run each, took 50.1 s with a first version
    that also spun there against 47.4 s without, 2026-12-06: a hint, not a measurement.)
    The ranks per host come from the launcher's environment (Open MPI's
    ``OMPI_COMM_WORLD_LOCAL_SIZE``, MPICH's ``MPI_LOCALNRANKS``); unknown counts as
    oversubscribed, the cautious side."""
    env = os.environ if environ is None else environ
    local = env.get("OMPI_COMM_WORLD_LOCAL_SIZE") or env.get("MPI_LOCALNRANKS")
    cores = (os.cpu_count() or 1) if cpus is None else cpus
    mine = len(os.sched_getaffinity(0)) if affinity is None else affinity
    try:
        ranks = int(local) if local is not None else 0
        threads = int(env.get("TF_NUM_INTRAOP_THREADS") or 0)
    except ValueError:
        return 0.0
    if not 0 < ranks <= cores:
        return 0.0
    if ranks * mine <= cores:
        return SPIN
    return SHARED_SPIN if threads > 0 and ranks * threads <= cores else 0.0


SPIN = 0.01  # covers a 16 MB transfer (~1 ms here) several times over, busy host included
SHARED_SPIN = 1e-4  # a 256 KB round trip (~45 us here) twice over: [Note: polling]


class MpiRequest:
    """Wraps an `MPI.Request` with the seam's `wait()`/`test()`; a synchronous object send
    also carries its group and destination, so its `wait()` is watched."""

    __slots__ = ("dest", "group", "req")

    def __init__(self, req: Any, group: Group | None = None, dest: int = 0) -> None:
        self.req, self.group, self.dest = req, group, dest

    def wait(self) -> None:
        if self.group is None:
            self.req.Wait()
            return
        with watched(self.group, "send_obj (synchronous)", peer=self.dest):
            self.req.Wait()

    def test(self) -> bool:
        return self.req.Test()  # type: ignore[no-any-return]

    @staticmethod
    def waitall(reqs: Sequence[MpiRequest]) -> None:
        """Completes many requests in one MPI call."""
        mpi().Request.Waitall([r.req for r in reqs])

    @staticmethod
    def testall(reqs: Sequence[MpiRequest]) -> bool:
        """Whether all completed, in one MPI call (completed ones become null requests)."""
        return bool(_testall()([r.req for r in reqs]))


class MpiGroup(Group):
    """A `Group` over an mpi4py intracommunicator.

    Example::

        group = MpiGroup(MPI.COMM_WORLD.Dup())
        group.allreduce_(np.ones(4))
    """

    def __init__(self, comm: Any) -> None:
        self.mpi_comm = comm
        self.rank = int(comm.Get_rank())
        self.size = int(comm.Get_size())
        world = mpi().COMM_WORLD
        self.ranks = [int(r) for r in comm.allgather(world.Get_rank())]
        self.spin = spin_seconds()

    def isend(self, buf: np.ndarray, dest: int, tag: int) -> MpiRequest:
        check_buffer(buf)
        self.check_peer(dest, "dest")
        return MpiRequest(self.mpi_comm.Isend(buf, dest, tag))

    def irecv(self, buf: np.ndarray, source: int, tag: int) -> MpiRequest:
        check_buffer(buf, writable=True)
        self.check_peer(source, "source")
        return MpiRequest(self.mpi_comm.Irecv(buf, source, tag))

    def p2p(self) -> tuple[Callable[[Any, int, int], MpiRequest],
                           Callable[[np.ndarray, int, int], MpiRequest]]:
        """`Group.p2p`: mpi4py's ``Isend``/``Irecv`` without `check_buffer` and `check_peer`
        (a few tenths of a microsecond a message, on a transfer's critical path)."""
        isend, irecv = self.mpi_comm.Isend, self.mpi_comm.Irecv
        return ((lambda buf, dest, tag: MpiRequest(isend(buf, dest, tag))),
                (lambda buf, source, tag: MpiRequest(irecv(buf, source, tag))))

    def isend_obj(self, obj: Any, dest: int, tag: int = 0, *, sync: bool = False) -> MpiRequest:
        self.check_peer(dest, "dest")
        if sync:
            return MpiRequest(self.mpi_comm.issend(obj, dest=dest, tag=tag), self, dest)
        return MpiRequest(self.mpi_comm.isend(obj, dest=dest, tag=tag))

    def send_obj(self, obj: Any, dest: int, tag: int = 0) -> None:
        self.check_peer(dest, "dest")
        with watched(self, "send_obj", peer=dest):  # a large message waits for its receiver
            self.mpi_comm.send(obj, dest=dest, tag=tag)

    # Every blocking call below runs under the watchdog: [Note: watched collectives].

    def recv_obj(self, source: int, tag: int = 0) -> Any:
        self.check_peer(source, "source")
        with watched(self, "recv_obj", peer=source):
            return self.mpi_comm.recv(source=source, tag=tag)

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        self.check_peer(root, "root")
        sig = signature("bcast_obj")  # [Note: the same call] in tfsmp/comm/calls.py
        with watched(self, "bcast_obj"):
            theirs, obj = self.mpi_comm.bcast((sig, obj), root=root)
        same_call(self, sig, {root: theirs})
        return obj

    def allgather_obj(self, obj: Any) -> list[Any]:
        sig = signature("allgather_obj")  # [Note: the same call] in tfsmp/comm/calls.py
        with watched(self, "allgather_obj"):
            got = self.mpi_comm.allgather((sig, obj))
        same_call(self, sig, {r: s for r, (s, _) in enumerate(got)})
        return [o for _, o in got]

    def barrier(self) -> None:
        with watched(self, "barrier"):
            self.mpi_comm.Barrier()

    def allreduce_(self, buf: np.ndarray) -> None:
        check_buffer(buf, writable=True)
        MPI = mpi()
        with watched(self, "allreduce_"):
            self.mpi_comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def allreduce_obj(self, obj: Any, op: str = "sum") -> Any:
        MPI = mpi()
        ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "and": MPI.LAND, "or": MPI.LOR}
        if op not in REDUCE_OPS:
            raise CommError(f"op must be one of {sorted(REDUCE_OPS)}. Received: op={op!r}")
        with watched(self, "allreduce_obj"):
            return self.mpi_comm.allreduce(obj, op=ops[op])

    def free(self) -> None:
        MPI = mpi()
        if self.mpi_comm not in (MPI.COMM_WORLD, MPI.COMM_SELF) and not MPI.Is_finalized():
            self.mpi_comm.Free()


def create_mpi_comm(topology: Topology) -> Comm:
    """Builds the six groups of [Note: separate communicators] from COMM_WORLD.

    Args:
        topology: The rank layout; its `world_size` must equal COMM_WORLD's size.

    Returns:
        This rank's `Comm`; `pipeline.rank` is the stage, `data.rank` the data rank.

    Raises:
        CommError: COMM_WORLD's size differs from the topology's.
    """
    MPI = mpi()
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    if world.Get_size() != topology.world_size:
        raise CommError(
            f"the MPI world size must equal the topology's world size. Received: "
            f"mpi_size={world.Get_size()}, world_size={topology.world_size}. Fix: launch with "
            f"`tfsmp run -np {topology.world_size}` or pass the config the launch was made for.")
    stage, data_rank = topology.pipeline_rank_of(rank), topology.data_rank_of(rank)
    from tfsmp.comm import remote_reads

    remote_reads.for_world()  # once per process: [Note: remote reads]
    runtime_world = world.Dup()
    pipeline = runtime_world.Split(color=data_rank, key=stage)
    data = runtime_world.Split(color=stage, key=data_rank)
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    tag_ub = world.Get_attr(MPI.TAG_UB)
    return Comm(
        backend="mpi",
        world=MpiGroup(runtime_world), pipeline=MpiGroup(pipeline), data=MpiGroup(data),
        user_world=MpiGroup(world.Dup()), user_pipeline=MpiGroup(pipeline.Dup()),
        user_data=MpiGroup(data.Dup()),
        local_rank=local_rank, local_size=local_size,
        tag_ub=int(tag_ub) if tag_ub else 32767,
        _abort=lambda code: world.Abort(code),
    )
