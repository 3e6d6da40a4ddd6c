"""`testall`: never blocks, tests every request, and hands same-typed requests to their batch call."""

from __future__ import annotations

import numpy as np

from tfsmp.comm import (
    base,  # `base.testall`: a bare `testall` name would be collected as a test
    create_local_comms,
)
from tfsmp.topology import Topology


def test_testall_is_true_only_once_every_receive_arrived() -> None:
    c0, c1 = (c.world for c in create_local_comms(Topology(world_size=2, partitions=2)))
    a, b = np.empty(2), np.empty(2)
    reqs = [c1.irecv(a, 0, tag=1), c1.irecv(b, 0, tag=2)]
    assert base.testall([]) and not base.testall(reqs)
    c0.isend(np.array([1.0, 2.0]), 1, tag=1)
    assert not base.testall(reqs)  # one of two
    c0.isend(np.array([3.0, 4.0]), 1, tag=2)
    assert base.testall(reqs) and a.tolist() == [1.0, 2.0] and b.tolist() == [3.0, 4.0]


class _Batched:
    calls: list[int] = []

    def test(self) -> bool:
        raise AssertionError("a batched type is tested in one call")

    @staticmethod
    def testall(reqs: list[_Batched]) -> bool:
        _Batched.calls.append(len(reqs))
        return True


def test_requests_of_one_type_with_a_batch_call_are_tested_together() -> None:
    assert base.testall([_Batched(), _Batched(), _Batched()])
    assert _Batched.calls == [3]
