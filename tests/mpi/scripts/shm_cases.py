"""Same-host shared-memory transfers (tests/mpi/test_shm_transfers.py): every case in one job of
2 ranks (the cases named in argv, in order, each over channels of its own); rank 0 sends, rank 1
receives; each case prints ``CASE {json}`` on rank 1.

[Note: shared-memory transfers] in tfsmp/comm/shm.py is what these check: a received tensor
aliases the sender's slot and is never overwritten while held, a slot is reused once its
tensor is dropped, a full region sends by MPI, and turned-off channels map nothing.
"""

import gc
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from mpi4py import MPI

from tfsmp.comm import shm
from tfsmp.comm.mpi import MpiGroup

F32 = np.dtype(np.float32)


def report(case: str, ok: bool, **info: object) -> None:
    print("CASE " + json.dumps({"case": case, "ok": bool(ok), **info}), flush=True)


def receive(inbox: shm.Inbox, group: MpiGroup, tag: int, shape: tuple[int, ...],
            dtype: np.dtype = F32) -> tf.Tensor:
    """Waits for ``tag`` as the executor does, falling back to MPI as it does."""
    irecv = group.p2p()[1]

    def by_mpi():
        buf = np.empty(shape, dtype=dtype)
        return irecv(buf, 0, tag), tf.convert_to_tensor(buf)

    req = shm.ShmReceive(inbox, tag, shape, dtype, by_mpi)
    req.wait()
    assert req.mpi is None, "these cases' messages all fit the region"
    return req.tensor


def run(which: str) -> None:
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    if which == "off":  # channels turned off on every rank: nothing is mapped
        os.environ[shm.ENV] = "0"
        group = MpiGroup(comm, channels=True)
        del os.environ[shm.ENV]
        if rank == 1:
            report("off", not group.channels.usable(0), fd=group.channels.fd)
        return
    if which == "small_region":
        shm.REGION = 17 << 20  # a 13 MiB slot area: three 4 MiB messages, then MPI
    group = MpiGroup(comm, channels=True)
    ch = group.channels
    peer = 1 - rank
    assert ch.usable(peer), "2 ranks of one host must have a channel"
    isend = group.p2p()[0]
    if which == "basic":
        shapes = [(3,), (1, 65536), (2, 1024, 1024), (5, 7)]
        for i, shape in enumerate(shapes):
            for dtype in (np.float32, np.float64, np.int32):
                tag = 100 * i + np.dtype(dtype).itemsize
                x = (np.arange(int(np.prod(shape))) % 251).reshape(shape).astype(dtype) + i
                if rank == 0:
                    assert ch.outbox(1).send(tf.constant(x)._numpy(), tag)
                else:
                    t = receive(ch.inbox(0), group, tag, shape, np.dtype(dtype))
                    report(f"basic:{shape}:{np.dtype(dtype).name}",
                           t.dtype == tf.as_dtype(dtype) and np.array_equal(t.numpy(), x))
        return
    if which == "held":
        shape = (256, 1024)
        a, b = np.full(shape, 1.5, np.float32), np.full(shape, -2.0, np.float32)
        if rank == 0:  # each message sent before rank 1 waits for it: the sender's own slots
            out = ch.outbox(1)
            out.send(tf.constant(a)._numpy(), 1)
            comm.barrier()  # sent
            comm.barrier()  # rank 1 holds message 1
            out.send(tf.constant(b)._numpy(), 2)
            comm.barrier()  # sent
            comm.barrier()  # rank 1 dropped both and reclaimed them
            for k in range(3, 9):
                out.send(tf.constant(a + k)._numpy(), k)
                comm.send(None, dest=1, tag=k)  # sent
                comm.recv(source=1, tag=k)  # rank 1 took it and dropped it
            comm.send(len(out.slots[a.nbytes]), dest=1)
        else:
            inbox = ch.inbox(0)
            comm.barrier()
            t1 = receive(inbox, group, 1, shape)
            inbox.reclaim()  # t1 is held: its slot must stay full
            comm.barrier()
            comm.barrier()
            t2 = receive(inbox, group, 2, shape)
            kept = np.array_equal(t1.numpy(), a) and np.array_equal(t2.numpy(), b)
            report("held: a second message leaves a held tensor alone", kept)
            del t1, t2
            gc.collect()
            inbox.reclaim()
            comm.barrier()
            later = []
            for k in range(3, 9):
                inbox.reclaim()
                comm.recv(source=0, tag=k)
                t = receive(inbox, group, k, shape)
                later.append(bool(np.array_equal(t.numpy(), a + k)))
                del t
                comm.send(None, dest=0, tag=k)
            slots = comm.recv(source=0)
            report("held: dropped tensors free their slots", all(later) and slots == 2,
                   slots=slots, later=later)
        return
    if which == "small_region":
        shape = (1024, 1024)  # 4 MiB
        xs = [np.full(shape, float(k), np.float32) for k in range(5)]
        if rank == 0:
            went, reqs, keep = [], [], []
            for k, x in enumerate(xs):
                view = tf.constant(x)._numpy()
                ok = ch.outbox(1).send(view, k)
                went.append(ok)
                if not ok:  # as the executor does: by MPI
                    reqs.append(isend(view, 1, k))
                    keep.append(view)
            comm.barrier()  # all sent before rank 1 makes its receives
            for r in reqs:
                r.wait()
            comm.send(went, dest=1)
        else:
            inbox = ch.inbox(0)
            got = []
            comm.barrier()
            irecv = group.p2p()[1]
            for k in range(5):
                buf = np.empty(shape, np.float32)
                req = shm.ShmReceive(inbox, k, shape, F32,
                                     lambda buf=buf, k=k: (irecv(buf, 0, k), None))
                req.wait()
                data = buf if req.mpi is not None else req.tensor.numpy()
                got.append((req.mpi is not None, bool(np.array_equal(data, xs[k]))))
            went = comm.recv(source=0)
            report("small_region: a full region sends by MPI",
                   went == [True, True, True, False, False]
                   and got == [(False, True)] * 3 + [(True, True)] * 2, went=went, got=got)
        return
    raise SystemExit(f"unknown case {which}")


for name in sys.argv[1:]:  # "small_region" last: it shrinks the regions of later channels
    run(name)
