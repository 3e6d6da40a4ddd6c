"""Optimizer state sharded across data-parallel replicas: who owns what, and the step's weight exchange.

Example::

    owned = replica_owners(traced, plan, placement, keys, pipeline_rank=0, replicas=2)
    shards = WeightExchange(variables, mine=[key in my_keys for key in ...], group=comm.data)
    ...                        # this replica's optimizer updates the variables it owns
    shards.exchange()          # every replica now holds every owner's new values

[Note: weight exchange] After the step, each variable's new value lives only on its owner
([Note: optimizer shards] in tfsmp/partitioning/shards.py). One collective per bucket gives it
to the other replicas: every replica fills a flat buffer with the values it owns and zeros
elsewhere, and an in-place ``Allreduce`` sums the buffers, which is each owner's value exactly
(``x + 0 = x``; only a ``-0.0`` weight would come back as ``+0.0``). A broadcast per owner or
an ``Allgatherv`` would move half the bytes, but the sum needs no per-owner layout, reuses
the watched in-place allreduce of the comm seam, and costs at d = 2 what the gradient
reduction costs. Buckets are held only during the exchange and are at most `BUCKET_BYTES`
(or one variable, when a variable is larger), so the exchange adds one bucket to the peak, not
a copy of the weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from tfsmp.partitioning.shards import BUCKET_BYTES, owners

if TYPE_CHECKING:
    from tfsmp.comm.base import Group
    from tfsmp.graph.tracer import TracedModel
    from tfsmp.partitioning.plan import StagePlan
    from tfsmp.schedule.placement import Placement

__all__ = ["BUCKET_BYTES", "WeightExchange", "buckets", "replica_owners", "variable_bytes"]


def variable_bytes(v: Any) -> int:
    return int(np.prod(v.shape, dtype=np.int64)) * int(tf.as_dtype(v.dtype).size)


def buckets(variables: list[Any]) -> list[list[Any]]:
    """[Note: reduction buckets] Consecutive groups of ``variables`` of at most `BUCKET_BYTES`
    (a larger variable alone). One fused buffer of a rank's every gradient held its gradients
    three times more during the reduction (the buffer, the concatenation, the scaled copy);
    buckets, which take one shared host buffer in turn, hold a bucket's worth instead, and a
    model of small variables still reduces in one call."""
    out: list[list[Any]] = []
    size = 0
    for v in variables:
        n = variable_bytes(v)
        if out and size + n <= BUCKET_BYTES:
            out[-1].append(v)
            size += n
        else:
            out.append([v])
            size = n
    return out



def replica_owners(traced: TracedModel, plan: StagePlan, placement: Placement,
                   keys: Mapping[int, str], pipeline_rank: int, replicas: int) -> dict[str, int]:
    """``{checkpoint key: data rank}`` of the trainable variables of ``pipeline_rank``'s stages
    ([Note: optimizer shards]): computed from the plan alone, so any rank can tell who holds
    another pipeline rank's optimizer state."""
    sizes: dict[str, int] = {}
    for s in placement.stages(pipeline_rank):
        for v in traced.variables_of(set(plan.layers(s))):
            if v.trainable:
                sizes.setdefault(keys[id(v)], variable_bytes(v))
    return owners(sizes, replicas)


def _wire_dtype(v: Any) -> np.dtype[Any]:
    dtype = np.dtype(tf.as_dtype(v.dtype).as_numpy_dtype)
    return dtype if dtype.kind == "f" else np.dtype(np.float32)  # bfloat16: MPI has no sum


class WeightExchange:
    """Gives every replica the owners' values of a rank's variables ([Note: weight exchange])."""

    def __init__(self, variables: Sequence[Any], mine: Sequence[bool], group: Group,
                 watch: Callable[[str], Any] | None = None, what: str = "") -> None:
        self.group = group
        self.watch = watch or (lambda what: contextlib.nullcontext())
        self.what = what or "the exchange of the replicas' updated weights"
        owned = {id(v): m for v, m in zip(variables, mine)}
        by_dtype: dict[np.dtype[Any], list[Any]] = {}
        for v in variables:
            by_dtype.setdefault(_wire_dtype(v), []).append(v)
        self.buckets: list[list[tuple[Any, bool]]] = [
            [(v, owned[id(v)]) for v in bucket]
            for same in by_dtype.values() for bucket in buckets(same)]

    def exchange(self) -> None:
        """Every replica calls it after updating its own variables."""
        if self.group.size == 1:
            return
        for bucket in self.buckets:
            self._exchange(bucket)

    def _exchange(self, bucket: list[tuple[Any, bool]]) -> None:
        dtype = _wire_dtype(bucket[0][0])
        sizes = [int(np.prod(v.shape, dtype=np.int64)) for v, _ in bucket]
        flat = np.zeros(sum(sizes), dtype)
        start = 0
        for (v, mine), n in zip(bucket, sizes):
            if mine:
                flat[start:start + n] = np.asarray(v.value).reshape(-1)
            start += n
        with self.watch(self.what):
            self.group.allreduce_(flat)
        start = 0
        for (v, mine), n in zip(bucket, sizes):
            if not mine:
                v.assign(tf.cast(flat[start:start + n].reshape(tuple(v.shape)), v.dtype))
            start += n
