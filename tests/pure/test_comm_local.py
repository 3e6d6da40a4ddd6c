"""The local (threads) comm backend keeps MPI's matching rules; the process API on a world of one."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tfsmp
from tfsmp import core, failure
from tfsmp.comm import Comm, create_local_comms, waitall
from tfsmp.errors import CommError, ConfigError
from tfsmp.topology import Topology

TOPO = Topology(world_size=4, partitions=2)   # cluster: mp [0,1],[2,3]; dp [0,2],[1,3]


def run_ranks(fn: Callable[[Comm], Any], comms: list[Comm] | None = None,
              timeout: float = 20.0) -> list[Any]:
    """Runs fn(comm) on one thread per rank; re-raises the first error."""
    comms = comms if comms is not None else create_local_comms(TOPO, timeout=10.0)
    results: list[Any] = [None] * len(comms)
    errors: list[BaseException] = []

    def target(r: int) -> None:
        try:
            results[r] = fn(comms[r])
        except BaseException as e:  # surfaced below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank thread hung"
    if errors:
        raise errors[0]
    return results


def test_groups_follow_the_topology() -> None:
    comms = create_local_comms(TOPO)
    for r, c in enumerate(comms):
        assert c.backend == "local"
        assert c.world.ranks == [0, 1, 2, 3] and c.world.rank == r
        assert c.pipeline.ranks == TOPO.mp_group(r) and c.pipeline.rank == TOPO.pipeline_rank_of(r)
        assert c.data.ranks == TOPO.dp_group(r) and c.data.rank == TOPO.data_rank_of(r)
        assert c.user_pipeline.ranks == c.pipeline.ranks and c.user_data.ranks == c.data.ranks
        assert c.pipeline is not c.user_pipeline


def test_isend_irecv_match_by_tag_not_by_posting_order() -> None:
    def body(c: Comm) -> Any:
        p = c.pipeline
        if p.rank == 0:
            waitall([p.isend(np.array([1.0, 2.0]), 1, tag=5),
                     p.isend(np.arange(4, dtype=np.int32).reshape(2, 2), 1, tag=6)])
            return None
        a, b = np.empty(2), np.empty((2, 2), dtype=np.int32)
        waitall([p.irecv(b, 0, tag=6), p.irecv(a, 0, tag=5)])
        return a.tolist(), b.tolist()

    results = run_ranks(body)
    assert results[1] == results[3] == ([1.0, 2.0], [[0, 1], [2, 3]])


def test_messages_between_a_pair_arrive_in_send_order() -> None:
    def body(c: Comm) -> Any:
        w = c.world
        if w.rank == 0:
            for i in range(5):
                w.isend(np.array([i]), 3, tag=1)   # buffered: the sender may reuse its array
            return None
        if w.rank == 3:
            time.sleep(0.05)  # every message is queued before the first receive
            bufs = [np.empty(1, dtype=np.int64) for _ in range(5)]
            waitall([w.irecv(b, 0, tag=1) for b in bufs])
            return [int(b[0]) for b in bufs]
        return None

    assert run_ranks(body)[3] == [0, 1, 2, 3, 4]


def test_send_buffer_is_copied_at_send_time() -> None:
    def body(c: Comm) -> Any:
        d = c.data
        if d.rank == 0:
            buf = np.ones(3)
            req = d.isend(buf, 1, tag=0)
            buf[:] = -1
            req.wait()
            return None
        out = np.empty(3)
        d.irecv(out, 0, tag=0).wait()
        return out.tolist()

    assert run_ranks(body)[2] == [1.0, 1.0, 1.0]


def test_collectives_in_every_group() -> None:
    def body(c: Comm) -> Any:
        r = c.world.rank
        out = {}
        for name in ("world", "pipeline", "data"):
            g = getattr(c, name)
            buf = np.full(3, float(r + 1))
            g.allreduce_(buf)
            out[name] = {
                "sum": buf.tolist(),
                "bcast": g.bcast_obj({"root": r} if g.rank == g.size - 1 else None, root=g.size - 1),
                "gather": g.allgather_obj(r),
                "ops": [g.allreduce_obj(r, op) for op in ("sum", "max", "min")]
                + [g.allreduce_obj(r != 3, "and"), g.allreduce_obj(r == 3, "or")],
            }
            g.barrier()
        return out

    for r, got in enumerate(run_ranks(body)):
        for name, members in {"world": [0, 1, 2, 3], "pipeline": TOPO.mp_group(r),
                              "data": TOPO.dp_group(r)}.items():
            g = got[name]
            assert g["sum"] == [float(sum(m + 1 for m in members))] * 3
            assert g["bcast"] == {"root": members[-1]}
            assert g["gather"] == members
            assert g["ops"] == [sum(members), max(members), min(members),
                                3 not in members, 3 in members]


def test_sync_object_send_completes_only_when_received() -> None:
    comms = create_local_comms(TOPO, timeout=5.0)
    req = comms[0].user_world.isend_obj({"a": 1}, 1, tag=0, sync=True)
    time.sleep(0.05)
    assert req.test() is False
    assert comms[1].user_world.recv_obj(0, tag=0) == {"a": 1}
    assert req.test() is True
    req.wait()


def test_communicators_never_cross_match() -> None:
    comms = create_local_comms(TOPO, timeout=0.3)
    comms[0].world.send_obj("runtime", 1, tag=0)
    with pytest.raises(CommError, match=r"no match for a message with tag 0 from rank 0"):
        comms[1].user_world.recv_obj(0, tag=0)
    assert comms[1].world.recv_obj(0, tag=0) == "runtime"


def test_misuse_raises_comm_error() -> None:
    c = create_local_comms(TOPO, timeout=0.3)
    with pytest.raises(CommError, match=r"dest must be in \[0, 2\).*Received: dest=2"):
        c[0].pipeline.isend(np.zeros(1), 2, tag=0)
    with pytest.raises(CommError, match=r"C-contiguous numpy arrays"):
        c[0].world.isend(np.zeros((4, 4))[:, 1], 1, tag=0)
    with pytest.raises(CommError, match=r"op must be one of"):
        c[0].world.allreduce_obj(1, op="prod")
    c[0].world.isend(np.zeros(8), 1, tag=3)
    with pytest.raises(CommError, match=r"a message must fit its receive buffer"):
        c[1].world.irecv(np.zeros(2), 0, tag=3)
    with pytest.raises(CommError, match=r"collective #0 on ranks \[0, 1, 2, 3\]"):
        c[0].world.barrier()   # the other ranks never arrive


def test_abort_wakes_every_waiting_rank() -> None:
    comms = create_local_comms(TOPO, timeout=10.0)
    errors: list[str] = []

    def wait_forever(c: Comm) -> None:
        try:
            c.world.barrier()
        except CommError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=wait_forever, args=(c,)) for c in comms[1:]]
    for t in threads:
        t.start()
    time.sleep(0.05)
    with pytest.raises(CommError, match=r"rank 0 aborted the job \(code 3\)"):
        comms[0].abort(3)
    for t in threads:
        t.join(5)
    assert len(errors) == 3 and all("aborted by rank 0 (code 3)" in e for e in errors)


# The process API in a plain `python` process: a world of one on the local backend. ----------
@pytest.fixture
def no_launcher(monkeypatch):
    for key in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "HOROVOD_SIZE", "SM_HP_MP_PARAMETERS",
                "TFSMP_CONFIG"):
        monkeypatch.delenv(key, raising=False)
    core.shutdown()
    yield
    core.shutdown()
    failure.uninstall()


def test_helpers_before_init_say_how_to_fix(no_launcher) -> None:
    with pytest.raises(CommError, match=r"tfsmp.init\(\) must be called before tfsmp.rank\(\)"
                                        r".*Fix: call tfsmp.init\(\) first"):
        tfsmp.rank()
    with pytest.raises(CommError, match=r"before tfsmp.allgather\(\)"):
        tfsmp.allgather(1)


def test_world_of_one_without_mpirun(no_launcher) -> None:
    # other tests in this pytest process may have imported them already: init must not
    had = {m: m in sys.modules for m in ("mpi4py.MPI", "tensorflow")}
    cfg = tfsmp.init({"microbatches": 2})
    assert cfg.microbatches == 2 and tfsmp.is_initialized()
    assert tfsmp.state().comm.backend == "local"
    assert (tfsmp.rank(), tfsmp.size(), tfsmp.mp_rank(), tfsmp.dp_size()) == (0, 1, 0, 1)
    assert tfsmp.get_mp_group() == tfsmp.get_dp_group() == [0]
    assert tfsmp.allgather("x", tfsmp.MP_GROUP) == ["x"]
    tfsmp.barrier()
    tfsmp.broadcast("nobody listens")   # no other member: returns at once
    assert tfsmp.init() is cfg
    assert {m: m in sys.modules for m in had} == had
    assert failure.installed()


def test_init_validates_the_config_with_the_world_size_first(no_launcher) -> None:
    with pytest.raises(ConfigError, match=r"world size must be a multiple of partitions.*"
                                          r"Received: world_size=1, partitions=2"):
        tfsmp.init({"partitions": 2})
    assert not tfsmp.is_initialized()


def test_failure_tag_prefixes_every_traceback_line() -> None:
    try:
        raise ValueError("bad\nsecond line")
    except ValueError as e:
        text = failure.format_tagged(type(e), e, e.__traceback__, "rank 3 | pp_rank 1")
    lines = text.splitlines()
    assert lines[0] == "[rank 3 | pp_rank 1] Traceback (most recent call last):"
    assert all(line.startswith("[rank 3 | pp_rank 1] ") for line in lines)
    assert lines[-2:] == ["[rank 3 | pp_rank 1] ValueError: bad", "[rank 3 | pp_rank 1] second line"]


def test_horovod_true_without_horovod_names_the_install_command(no_launcher, monkeypatch) -> None:
    import tfsmp.comm.horovod as hvd_backend

    monkeypatch.setattr(hvd_backend, "horovod_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"horovod: True needs Horovod.*"
                                          r"Fix: run `tfsmp install-horovod`"):
        tfsmp.init({"horovod": True})
    assert not tfsmp.is_initialized() and "mpi4py.MPI" not in sys.modules
