"""Which data-parallel replica owns each variable's optimizer state (``shard_optimizer_state``).

Example::

    owners({"d0/kernel": 4096, "d0/bias": 64, "d1/kernel": 4096}, parts=2)
    # {"d0/bias": 0, "d0/kernel": 0, "d1/kernel": 1}
    largest_share([4096, 64, 4096], parts=2)     # 4160: what the busiest replica holds

[Note: optimizer shards] With ``shard_optimizer_state`` the replicas of one pipeline rank split
its trainable variables between them, whole variables each (as torch's
``ZeroRedundancyOptimizer`` does, DeepSpeed's ZeRO stage 1 at variable granularity): the
largest first, each to the replica holding the fewest bytes so far (ties: the lower data
rank), so no replica holds more than an even share plus one variable. A replica's optimizer
builds slots for, and updates, only the variables it owns; the owners' new values then reach
the other replicas (tfsmp/runtime/sharding.py). The split depends only on the variables'
checkpoint keys and sizes, so every replica, the checkpoint writers and the memory model
compute the same one without talking.

Pure: imports neither TensorFlow nor mpi4py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["BUCKET_BYTES", "exchange_bytes", "largest_share", "owners", "split"]

# The most bytes one collective of the weight exchange carries ([Note: weight exchange] in
# tfsmp/runtime/sharding.py); a larger variable goes alone.
BUCKET_BYTES = 32 * 2**20


def split(sizes: Sequence[float], parts: int) -> list[int]:
    """The owner (0 .. parts-1) of each item of ``sizes`` ([Note: optimizer shards]); items
    of equal size go in their order.

    Raises:
        ValueError: ``parts`` is below 1 or a size is negative.
    """
    if parts < 1:
        raise ValueError(f"Optimizer state is split among at least one replica. Received: "
                         f"parts={parts}. Pass the data-parallel degree (>= 1).")
    if any(s < 0 for s in sizes):
        raise ValueError(f"Variable sizes must be >= 0. Received: sizes={list(sizes)}.")
    load = [0.0] * parts
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        part = min(range(parts), key=lambda p: (load[p], p))
        out[i] = part
        load[part] += sizes[i]
    return out


def owners(sizes: Mapping[str, float], parts: int) -> dict[str, int]:
    """``{key: owning replica}`` of variables by checkpoint key; the split is of the keys in
    sorted order, so it does not depend on the order a rank lists its variables in."""
    keys = sorted(sizes)
    return dict(zip(keys, split([sizes[k] for k in keys], parts)))


def largest_share(sizes: Sequence[float], parts: int) -> float:
    """What the busiest of ``parts`` replicas holds when ``sizes`` are split among them."""
    load = [0.0] * max(parts, 1)
    for size, part in zip(sizes, split(sizes, max(parts, 1))):
        load[part] += size
    return max(load)


def exchange_bytes(sizes: Sequence[float]) -> float:
    """The largest buffer the weight exchange holds for variables of ``sizes`` bytes: a
    bucket of up to `BUCKET_BYTES`, or one larger variable."""
    return min(max(BUCKET_BYTES, max(sizes, default=0.0)), sum(sizes))
