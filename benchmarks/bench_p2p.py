"""Benchmark 4, point-to-point: tfsmp's boundary transfers vs a raw mpi4py buffer ping-pong.

Two ranks. Arm A is the runtime's own code path: an `Executor` whose schedule holds only
transfers (rank 0 ``SEND_F`` then ``RECV_B``, rank 1 ``RECV_F`` then ``SEND_B``, per
microbatch), so every message goes through what a training step does — receives posted ahead
into the stream's ring of buffers, the tensor's own memory sent with ``Isend``, the receive
completed by the executor's wait and handed on as a tensor aliasing its buffer, which the
next action consumes (here: drops). Arm K is arm A with every received tensor kept to the
step's end (so the step needs a buffer per message, as a stage stashing its inputs does).
Arm B is the floor: blocking ``Send``/``Recv`` of the same messages, the same number of round
trips, out of the same tensor's memory into one preallocated buffer. Arm P is the floor of any
message path written in Python with the runtime's contract ([Note: the Python floor]). Throughput = bytes moved /
time; the figure is the median over rounds of throughput(A) / throughput(B) (and K's beside it).
[Note: the Python floor] Arm P does per message only what any Python path must that posts its
receives ahead and hands each message on as a tensor, in the fewest calls mpi4py allows: the
next receive posted before the wait into a ring of two 64-byte aligned buffers, with the DLPack
tensor that aliases its buffer made as it is posted (as the runtime makes it: [Note: early
tensors] in tfsmp/runtime/executor.py), the send of the tensor itself (``Isend``, its buffer
export: [Note: direct sends] in tfsmp/runtime/buffers.py), a test loop on the receive, the
previous message's tensor dropped before the next wait, and the sends completed at the end; no
executor, no schedule, no watchdog. Its ratio to arm B says how far below raw blocking
MPI a Python message path must stay on this host, whatever its executor; arm A's ratio to it
(``of_floor``) is what the executor costs beyond that.
The job is launched as `tfsmp run` launches, with malloc on transparent huge pages ([Note: huge
pages] in tfsmp/launch/mpirun.py); both arms alike.

[Note: same memory] Every arm sends the memory of one tensor, ``payload`` (as a stage sends what
its layers computed), and receives into 64-byte aligned buffers (`aligned_empty`, as the
runtime's rings are), because on this host where a message's bytes lie changes a transfer more
than anything the runtime does. Open MPI copies a large message once, out of the sender's pages
(CMA); measured with raw blocking ping-pongs of NumPy buffers (2026-12-05): a sender on 2 MB
huge pages was 1.7x (256 KB) to 2.8x (16 MB) faster than one on 4 KB pages, whatever the
receiver's; and at 16 MB a receive buffer on another 64-byte offset than the send buffer cost
1.4-1.5x. Until then arm B sent from and received into NumPy arrays: NumPy asks for huge pages
for arrays of 4 MB and more and aligns to 16 bytes, TensorFlow's allocator does neither, so at
4-16 MB arm B measured huge pages against the runtime's 4 KB ones (0.74-0.76 and 0.45-0.56 of it sending
from a TensorFlow tensor instead, in one job), which no runtime code can change; a raw mpi4py
pipeline sends tensors too. The pages are the launcher's business (the note above), for
runtime and raw code alike.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.common import launch, median, ratio_summary

__all__ = ["run", "summarize", "verdict", "worker"]

NAME = "p2p"
TITLE = "Point-to-point (tfsmp boundary transfer / raw mpi4py ping-pong)"
GOAL = 0.9


def settings(quick: bool) -> dict[str, Any]:
    sizes = [256 * 1024, 1024 * 1024, 4 * 1024 * 1024, 16 * 1024 * 1024]
    return {"sizes": sizes, "round_trips": 16, "rounds": 7 if quick else 21}


def run(quick: bool) -> dict[str, Any]:
    args = settings(quick)
    from tfsmp.launch.mpirun import huge_page_env

    result = launch(2, "bench_p2p", "worker", args, timeout=600, env=huge_page_env({}))
    result["settings"] = args
    return result


def worker(args: dict[str, Any]) -> dict[str, Any]:
    from benchmarks import tfhelp

    tfhelp.setup_threads()
    from mpi4py import MPI

    from tfsmp.comm.mpi import MpiGroup

    comm = MPI.COMM_WORLD.Dup()
    group = MpiGroup(comm)
    rows = []
    for size in args["sizes"]:
        rows.append(_size(comm, group, size, args["round_trips"], args["rounds"]))
    return {"rows": rows}


def _size(comm: Any, group: Any, size: int, k: int, rounds: int) -> dict[str, Any]:
    import tensorflow as tf

    payload = tf.ones((1, size // 4), dtype=tf.float32)  # what every arm sends: [Note: same memory]
    ex = _transfer_executor(group, size // 4, k, payload=payload)
    kept = _transfer_executor(group, size // 4, k, keep=True, payload=payload)
    raw = _RawPingPong(comm, payload)
    floor = _PythonFloor(comm, payload)
    ex.step(), kept.step(), raw.step(k), floor.step(k)  # warm up (buffers, MPI, TF kernels)
    a: list[float] = []
    c: list[float] = []
    b: list[float] = []
    f: list[float] = []
    for _ in range(rounds):
        comm.Barrier()
        a.append(ex.step())
        comm.Barrier()
        b.append(raw.step(k))
        comm.Barrier()
        c.append(kept.step())
        comm.Barrier()
        f.append(floor.step(k))
    moved = 2 * k * size
    return {"bytes": size, "round_trips": k,
            "tfsmp_gbps": moved / median(a) / 1e9, "raw_gbps": moved / median(b) / 1e9,
            "kept_gbps": moved / median(c) / 1e9, "floor_gbps": moved / median(f) / 1e9,
            "ratio": ratio_summary([bi / ai for ai, bi in zip(a, b)]),
            "kept_ratio": ratio_summary([bi / ci for ci, bi in zip(c, b)]),
            "floor_ratio": ratio_summary([bi / fi for fi, bi in zip(f, b)]),
            "of_floor": ratio_summary([fi / ai for ai, fi in zip(a, f)])}


class _RawPingPong:
    """Blocking mpi4py buffer ping-pong between ranks 0 and 1: sends out of ``payload``'s own
    memory into one 64-byte aligned buffer ([Note: same memory])."""

    def __init__(self, comm: Any, payload: Any) -> None:
        import numpy as np

        from tfsmp.runtime.buffers import aligned_empty, host_view

        self.comm = comm
        self.send = host_view(payload, np.dtype(np.float32))
        self.recv = aligned_empty(tuple(payload.shape), np.dtype(np.float32))

    def step(self, k: int) -> float:
        start = time.perf_counter()
        peer = 1 - self.comm.Get_rank()
        for i in range(k):
            if self.comm.Get_rank() == 0:
                self.comm.Send(self.send, dest=peer, tag=i)
                self.comm.Recv(self.recv, source=peer, tag=i)
            else:
                self.comm.Recv(self.recv, source=peer, tag=i)
                self.comm.Send(self.send, dest=peer, tag=i)
        return time.perf_counter() - start


class _PythonFloor:
    """Non-blocking ping-pong between ranks 0 and 1 with the runtime's contract in the fewest
    Python calls ([Note: the Python floor]): receives posted one ahead into a ring of two
    aligned buffers, each with its DLPack tensor made when it is posted, sends of ``payload``
    itself, test loops; a message's tensor is dropped (consumed) before the next wait."""

    def __init__(self, comm: Any, payload: Any) -> None:
        import numpy as np

        from tfsmp.runtime.buffers import aligned_empty, pool_tensor

        self.comm, self.payload, self.tensor = comm, payload, pool_tensor
        self.ring = [aligned_empty(tuple(payload.shape), np.dtype(np.float32)) for _ in range(2)]

    def step(self, k: int) -> float:
        from mpi4py import MPI

        comm, payload, ring, tensor = self.comm, self.payload, self.ring, self.tensor
        first = comm.Get_rank() == 0
        peer = 1 - comm.Get_rank()
        start = time.perf_counter()
        sends = []
        pending, early = comm.Irecv(ring[0], peer, 0), tensor(ring[0], True)
        got = None
        for i in range(k):
            if first:
                sends.append(comm.Isend(payload, peer, i))
            got = None  # the previous message was consumed: its buffer is free again
            nxt, later = ((comm.Irecv(ring[(i + 1) % 2], peer, i + 1), tensor(ring[(i + 1) % 2], True))
                          if i + 1 < k else (None, None))  # posted ahead, its tensor made early
            while not pending.Test():
                pass
            got = early  # handed on
            if not first:
                sends.append(comm.Isend(payload, peer, i))
            pending, early = nxt, later
        MPI.Request.Waitall(sends)
        del got
        return time.perf_counter() - start


def _transfer_executor(group: Any, floats: int, k: int, executor_module: Any = None,
                       keep: bool = False, payload: Any = None) -> Any:
    """An executor whose schedule is only the transfers of ``k`` microbatches over one
    boundary of ``floats`` float32 values per microbatch (one row of that width), each
    message ``payload`` (a tensor of that shape; default ones).
    ``executor_module`` replaces `tfsmp.runtime.executor` (to measure a prototype).

    Each received tensor is dropped after its receive, as the stage's FORWARD or BACKWARD that
    follows it in a training step would (the last stage's fused forward-backward, and every
    backward, are done with their inputs before the next microbatch arrives); with ``keep``
    the step holds all ``k`` to its end instead (``k`` buffers of the message's size)."""
    import tensorflow as tf

    from tfsmp.partitioning.plan import Boundary, StagePlan
    from tfsmp.runtime import executor as runtime_executor
    from tfsmp.runtime.hooks import StepMode
    from tfsmp.schedule.actions import Action, Op
    from tfsmp.schedule.placement import Placement

    Executor = (executor_module or runtime_executor).Executor
    MicroBatch = (executor_module or runtime_executor).MicroBatch

    boundary = Boundary(0, "a:0:0", 0, (1,), (floats,), "float32", 4 * floats)
    plan = StagePlan(2, {"a": 0, "b": 1}, (boundary,), (), "bench")
    rank = group.rank
    if rank == 0:
        actions = [a for i in range(k) for a in (Action(0, Op.SEND_F, i, 1), Action(0, Op.RECV_B, i, 1))]
    else:
        actions = [a for i in range(k) for a in (Action(1, Op.RECV_F, i, 0), Action(1, Op.SEND_B, i, 0))]
    if payload is None:
        payload = tf.ones((1, floats), dtype=tf.float32)

    # what the stages' compute would have made, and the step's microbatches: made once, outside
    # the timed step (the transfers only read them)
    produced = {(0, i): {0: payload} for i in range(k)}
    grad_out = {(1, i): {0: payload} for i in range(k)}
    microbatches = [MicroBatch({}, size=1) for _ in range(k)]
    mode = StepMode(train=True)

    class TransferOnly(Executor):  # type: ignore[misc,valid-type]
        """The runtime executor with every compute result replaced by ``payload``."""

        def _post_receives(self) -> None:
            super()._post_receives()
            self.step_state.produced = produced
            self.step_state.grad_out = grad_out

        def _handler(self, a: Action) -> Any:
            """The runtime's own handler (for one boundary, its message handler: [Note:
            message handlers] in executor.py); unless ``keep``, a receive first drops what the
            stream's previous receive took, as the FORWARD or BACKWARD between them would
            have consumed it (before the wait, so off the transfer's critical path)."""
            handler = super()._handler(a)
            if keep or a.op not in (Op.RECV_F, Op.RECV_B):
                return handler
            backward = a.op is Op.RECV_B

            def consumed_then(a: Action) -> None:
                (self._now.grad_in if backward else self._now.received).clear()
                handler(a)

            return consumed_then

        def step(self) -> float:
            start = time.perf_counter()
            self.run(microbatches, mode=mode)
            return time.perf_counter() - start

    return TransferOnly(actions, {}, plan, group, 2, k, placement=Placement(2, 2))


def summarize(result: dict[str, Any]) -> list[str]:
    """Markdown table of the result."""
    s = result["settings"]
    lines = [f"2 ranks, {s['round_trips']} round trips per arm, {s['rounds']} rounds; 'all "
             "kept': every received tensor held to the step's end.", "",
             "| message | tfsmp GB/s | raw mpi4py GB/s | tfsmp / raw [q1, q3] | all kept / raw "
             "| Python floor / raw | tfsmp / Python floor |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        q, kept = r["ratio"], r.get("kept_ratio")
        lines.append(f"| {_size_text(r['bytes'])} | {r['tfsmp_gbps']:.2f} | {r['raw_gbps']:.2f} | "
                     f"{q['median']:.3f} [{q['q1']:.3f}, {q['q3']:.3f}] | "
                     + (f"{kept['median']:.3f} [{kept['q1']:.3f}, {kept['q3']:.3f}] |"
                        if kept else "- |")
                     + "".join(f" {r[k]['median']:.3f} [{r[k]['q1']:.3f}, {r[k]['q3']:.3f}] |"
                               if k in r else " - |" for k in ("floor_ratio", "of_floor")))
    return lines


def _size_text(n: int) -> str:
    return f"{n // (1024 * 1024)} MB" if n >= 1024 * 1024 else f"{n // 1024} KB"


def verdict(result: dict[str, Any]) -> str:
    worst = min(r["ratio"]["median"] for r in result["rows"])
    if worst >= GOAL:
        return f"met: worst ratio {worst:.3f} ≥ {GOAL}"
    return f"missed by {GOAL - worst:.3f} (worst ratio {worst:.3f} < {GOAL})"
