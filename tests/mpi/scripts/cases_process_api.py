"""Cases for the SMP process API and the Comm seam on 4 ranks (launched by test_process_api.py).

Launched with partitions=2 and placement "spread": mp groups [0, 2], [1, 3]; dp groups [0, 1],
[2, 3]; mp_rank = rank // 2, dp_rank = rank % 2. No TensorFlow is imported.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import tfsmp as smp
from tfsmp.comm import waitall
from tfsmp.errors import CommError, ConfigError

GROUPS = {"WORLD": smp.WORLD, "MP_GROUP": smp.MP_GROUP, "DP_GROUP": smp.DP_GROUP}


def setup(ctx: Any) -> None:
    ctx.store["config"] = smp.init()


def teardown(ctx: Any) -> None:
    smp.shutdown()


def _pair_exchange(value: Any, peer: int, rank_type: smp.RankType, first: bool) -> Any:
    """Synchronous sends deadlock if both sides send first: one side sends, then receives."""
    if first:
        smp.send(value, peer, rank_type)
        return smp.recv_from(peer, rank_type)
    got = smp.recv_from(peer, rank_type)
    smp.send(value, peer, rank_type)
    return got


def case_rank_helpers(ctx: Any) -> dict[str, Any]:
    names = ["rank", "size", "mp_rank", "mp_size", "dp_rank", "dp_size", "pp_rank", "pp_size",
             "tp_rank", "tp_size", "rdp_rank", "rdp_size", "get_mp_group", "get_dp_group",
             "local_size"]
    out = {n: getattr(smp, n)() for n in names}
    out["local_ranks"] = sorted(smp.allgather(smp.local_rank()))
    return out


def case_broadcast_world(ctx: Any) -> Any:
    if smp.rank() == 1:
        smp.broadcast({"from": 1, "payload": [1, 2, 3]}, smp.WORLD)
        return "sent"
    return smp.recv_from(1, smp.RankType.WORLD_RANK)


def case_broadcast_mp(ctx: Any) -> Any:
    if smp.mp_rank() == 1:
        smp.broadcast(("mp", smp.rank()), smp.MP_GROUP)
        return "sent"
    return list(smp.recv_from(1, smp.RankType.MP_RANK))


def case_broadcast_dp(ctx: Any) -> Any:
    if smp.dp_rank() == 1:
        smp.broadcast(("dp", smp.rank()), smp.DP_GROUP)
        return "sent"
    return list(smp.recv_from(1, smp.RankType.DP_RANK))


def case_send_world_ring(ctx: Any) -> Any:
    r, n = smp.rank(), smp.size()
    if r % 2 == 0:
        smp.send(("ring", r), (r + 1) % n, smp.RankType.WORLD_RANK)
        got = smp.recv_from((r - 1) % n, smp.RankType.WORLD_RANK)
    else:
        got = smp.recv_from((r - 1) % n, smp.RankType.WORLD_RANK)
        smp.send(("ring", r), (r + 1) % n, smp.RankType.WORLD_RANK)
    return list(got)


def case_send_mp(ctx: Any) -> Any:
    me = smp.mp_rank()
    return list(_pair_exchange(("mp", smp.rank()), 1 - me, smp.RankType.MP_RANK, me == 0))


def case_send_dp(ctx: Any) -> Any:
    me = smp.dp_rank()
    return list(_pair_exchange(("dp", smp.rank()), 1 - me, smp.RankType.DP_RANK, me == 0))


def case_send_broadcast_fifo(ctx: Any) -> Any:
    """Messages from one sender arrive in order, whether sent by `send` or `broadcast`."""
    r = smp.rank()
    if r == 0:
        smp.send("first", 3)
        smp.broadcast("second")
        smp.send("third", 3)
        return "sent"
    if r == 3:
        return [smp.recv_from(0) for _ in range(3)]
    return [smp.recv_from(0)]


def case_allgather(ctx: Any) -> dict[str, Any]:
    return {name: smp.allgather(("x", smp.rank()), group) for name, group in GROUPS.items()}


def case_barriers(ctx: Any) -> bool:
    for group in GROUPS.values():
        smp.barrier(group)
    smp.barrier()
    smp.dp_barrier()
    smp.mp_barrier()
    smp.core.barrier()
    return True


def case_dp_barrier_scope(ctx: Any) -> float:
    """Rank 3 arrives late: only its dp group ([2, 3]) waits for it in dp_barrier."""
    if smp.rank() == 3:
        time.sleep(2.0)
    start = time.monotonic()
    smp.dp_barrier()
    waited = time.monotonic() - start
    smp.barrier()
    return waited


def case_mp_barrier_scope(ctx: Any) -> float:
    """Rank 3 arrives late: only its mp group ([1, 3]) waits for it in mp_barrier."""
    if smp.rank() == 3:
        time.sleep(2.0)
    start = time.monotonic()
    smp.mp_barrier()
    waited = time.monotonic() - start
    smp.barrier()
    return waited


def case_comm_isend_irecv(ctx: Any) -> dict[str, Any]:
    """Buffers on every runtime group; receives posted in the opposite tag order still match."""
    comm = smp.state().comm
    out = {}
    for name in ("world", "pipeline", "data"):
        group = getattr(comm, name)
        peer = group.size - 1 - group.rank
        if peer == group.rank:
            continue
        a = np.full(5, 10.0 * group.ranks[group.rank] + 1, dtype=np.float32)
        b = np.arange(6, dtype=np.int64).reshape(2, 3) + 100 * group.ranks[group.rank]
        got_a, got_b = np.empty_like(a), np.empty_like(b)
        reqs = [group.irecv(got_b, peer, tag=6), group.irecv(got_a, peer, tag=5)]
        reqs += [group.isend(a, peer, tag=5), group.isend(b, peer, tag=6)]
        waitall(reqs)
        out[name] = {"peer": group.ranks[peer], "a": got_a.tolist(), "b": got_b.tolist()}
    return out


def case_comm_fifo_same_tag(ctx: Any) -> Any:
    """Three buffers with one tag between one pair arrive in send order."""
    pipe = smp.state().comm.pipeline
    if pipe.rank == 0:
        reqs = [pipe.isend(np.array([i], dtype=np.int32), 1, tag=9) for i in range(3)]
        waitall(reqs)
        return "sent"
    bufs = [np.empty(1, dtype=np.int32) for _ in range(3)]
    waitall([pipe.irecv(b, 0, tag=9) for b in bufs])
    return [int(b[0]) for b in bufs]


def case_comm_allreduce(ctx: Any) -> dict[str, Any]:
    comm = smp.state().comm
    out = {}
    for name in ("world", "pipeline", "data"):
        buf = np.full(4, float(smp.rank() + 1))
        getattr(comm, name).allreduce_(buf)
        out[name] = buf.tolist()
    return out


def case_comm_objects(ctx: Any) -> dict[str, Any]:
    comm = smp.state().comm
    out: dict[str, Any] = {}
    for name in ("world", "pipeline", "data"):
        g = getattr(comm, name)
        r = smp.rank()
        out[name] = {
            "ranks": g.ranks, "rank": g.rank, "size": g.size,
            "bcast": g.bcast_obj({"root": r} if g.rank == g.size - 1 else None, root=g.size - 1),
            "allgather": g.allgather_obj(r),
            "sum": g.allreduce_obj(r), "max": g.allreduce_obj(r, "max"),
            "min": g.allreduce_obj(r, "min"), "and": g.allreduce_obj(r != 3, "and"),
            "or": g.allreduce_obj(r == 3, "or"),
        }
        g.barrier()
    return out


def case_comm_send_recv_obj(ctx: Any) -> Any:
    data = smp.state().comm.data
    if data.rank == 0:
        data.send_obj({"x": smp.rank()}, 1, tag=3)
        return data.recv_obj(1, tag=4)
    got = data.recv_obj(0, tag=3)
    data.send_obj({"y": smp.rank()}, 0, tag=4)
    return got


def case_user_and_runtime_isolated(ctx: Any) -> Any:
    """A runtime message with the same peer and tag never satisfies a user-level recv_from."""
    comm = smp.state().comm
    r = smp.rank()
    if r == 0:
        req = comm.world.isend(np.array([7.0]), 1, tag=0)
        smp.send("user message", 1)
        req.wait()
        return "sent"
    if r == 1:
        user = smp.recv_from(0)
        buf = np.empty(1)
        comm.world.irecv(buf, 0, tag=0).wait()
        return [user, float(buf[0])]
    return None


def case_tag_ub(ctx: Any) -> int:
    return smp.state().comm.tag_ub


def case_errors(ctx: Any) -> dict[str, str]:
    out = {}
    for label, call in {
        "send_self": lambda: smp.send(1, smp.rank()),
        "bad_mp_rank": lambda: smp.send(1, 2, smp.RankType.MP_RANK),
        "bad_rank_type": lambda: smp.recv_from(0, "world"),
        "bad_group": lambda: smp.barrier("mp"),
    }.items():
        try:
            call()
            out[label] = "no error"
        except CommError as e:
            out[label] = str(e)
    return out


def case_init_again(ctx: Any) -> dict[str, Any]:
    same = smp.init() is ctx.store["config"]
    try:
        smp.init({"partitions": 2, "microbatches": 4, "placement_strategy": "spread"})
        error = "no error"
    except ConfigError as e:
        error = str(e)
    return {"same": same, "error": error, "initialized": smp.is_initialized()}
