"""The optimal contiguous split of a topological order: dynamic programming, exact for chains.

Pure: numpy only.

Example::

    split_sequence([3, 1, 1, 3], cuts=[0, 0, 0, 0, 0], num_stages=2)   # [0, 2]: {3, 1} {1, 3}

[Note: contiguous DP] Items ``0..n-1`` (groups in topological order) have weights ``w``; a stage
is a run ``[i, j)`` and costs ``P[j] - P[i] + kappa * (cut[i] + cut[j])`` (``P``: prefix sums;
``cut[p]``: bytes crossing position ``p``, 0 at both ends). Runs heavier than the balance cap are
forbidden (the cap is first raised to the least achievable heaviest run, computed by the same
recurrence with ``kappa = 0``). Pass 1 computes the least possible bottleneck ``B*`` with
``f_t[j] = min_i max(f_{t-1}[i], cost(i, j))`` (``t`` stages covering the first ``j`` items).
Pass 2 computes, among splits whose every stage costs at most ``B*``, the one with the fewest
bytes crossing its cuts, and backtracks it. Each pass evaluates ``cost(i, j)`` for all ``i`` at
once per block of ``j`` columns: O(n² k) arithmetic in numpy, about 0.05 s per pass for n = 1000,
k = 8. On a chain the stage cost is exactly the [Note: objective] of `tfsmp.partitioning.planner`,
so the split is optimal; on a DAG a tensor that skips over a stage is priced at every cut it
crosses, an upper bound of what is sent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from tfsmp.errors import PartitionError

if TYPE_CHECKING:  # planner imports this module; it only hands us its Problem
    from tfsmp.partitioning.planner import Problem

__all__ = ["MemoryLimits", "min_bottleneck", "partition_contiguous", "split_sequence",
           "split_within_memory"]

_TOL = 1e-9  # relative: the tolerance `planner.better` treats as a tie
_BLOCK_ELEMENTS = 2_000_000  # cells of the cost matrix held at once (16 MB)
_BLOCK_WIDTH = 128  # columns per block: narrow blocks let the weight cap skip most rows

Array = npt.NDArray[np.float64]


@dataclass(frozen=True)
class MemoryLimits:
    """Per-stage memory limits of a contiguous split ([Note: memory limits]).

    ``fixed[p]``/``held[p]`` are prefix sums over items of the bytes a stage holds whatever
    the schedule and per microbatch it holds; ``count[t]`` is how many microbatches stage
    ``t`` holds at its peak and ``limit[t]`` its budget: a run ``[i, j)`` may be stage ``t``
    when ``fixed[j] - fixed[i] + count[t] * (held[j] - held[i]) <= limit[t]``.
    """

    fixed: Array
    held: Array
    count: tuple[float, ...]
    limit: tuple[float, ...]

    def allowed(self, t: int, i: Any, j: Any) -> Any:
        return (self.fixed[j] - self.fixed[i] + self.count[t] * (self.held[j] - self.held[i])
                <= self.limit[t])


def partition_contiguous(problem: Problem, num_stages: int,
                         order: Sequence[int] | None = None) -> list[int]:
    """The stage of each group under the optimal contiguous split of a topological group order.

    Args:
        problem: the contracted graph.
        num_stages: number of stages.
        order: a topological order of the groups (default: their numbering).

    Returns:
        Stage per group (indexed by group number, not position).
    """
    seq = list(range(len(problem))) if order is None else list(order)
    weights = [problem.weight[g] for g in seq]
    starts = split_sequence(weights, problem.cuts(seq), num_stages, problem.kappa,
                            cap=problem.cap(num_stages))
    ends = [*starts[1:], len(seq)]
    stage = [0] * len(seq)
    for s, (a, b) in enumerate(zip(starts, ends)):
        for g in seq[a:b]:
            stage[g] = s
    return stage


def split_sequence(weights: Sequence[float], cuts: Sequence[float], num_stages: int,
                   kappa: float = 0.0, cap: float = math.inf) -> list[int]:
    """Splits items into ``num_stages`` non-empty runs: runs weigh at most ``cap`` (or as little
    as the items allow), then the largest run cost is least, then the fewest bytes cross the
    cuts. See [Note: contiguous DP].

    Args:
        weights: item weights, in order.
        cuts: ``len(weights) + 1`` byte counts; ``cuts[p]`` crosses the position before item ``p``.
        num_stages: number of runs.
        kappa: price of a byte in weight units.
        cap: largest run weight wanted; raised to the least achievable when below it.

    Returns:
        The first item of each run, ascending, starting with 0.

    Raises:
        PartitionError: if there are fewer items than runs.
    """
    n, k = len(weights), num_stages
    if not 1 <= k <= n:
        raise PartitionError(
            f"A contiguous split needs 1 <= num_stages <= items. Received: num_stages={k}, "
            f"items={n}.")
    if len(cuts) != n + 1:
        raise PartitionError(
            f"cuts needs one entry per position. Received: len(cuts)={len(cuts)}, items={n}.")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(weights, dtype=np.float64))])
    cut = np.asarray(cuts, dtype=np.float64).copy()
    cut[0] = cut[n] = 0.0
    price = kappa * cut
    heaviest = cap + _TOL * max(cap, 1e-300)
    best = _bottleneck(prefix, price, k, heaviest)
    if best == math.inf:  # the cap is below what these items allow: allow the least possible
        least = _bottleneck(prefix, np.zeros(n + 1), k, math.inf)
        heaviest = least + _TOL * max(least, 1e-300)
        best = _bottleneck(prefix, price, k, heaviest)
    limit = best + _TOL * max(abs(best), 1e-300)
    return _fewest_bytes(prefix, price, cut, k, limit, heaviest)


def split_within_memory(weights: Sequence[float], cuts: Sequence[float], num_stages: int,
                        limits: MemoryLimits, kappa: float = 0.0) -> list[int] | None:
    """Like `split_sequence` with every run within its stage's memory budget and no weight
    cap: the least bottleneck cost among the splits that fit, then the fewest bytes. None when
    no split fits. See [Note: memory limits].

    [Note: memory limits] ``optimize: memory`` first keeps every stage within its memory and
    then balances compute: a run may be stage ``t`` only if its bytes fit stage ``t``'s budget,
    which depends on ``t`` because the schedule does (1F1B's first stage holds p microbatches,
    its last one). The two passes of [Note: contiguous DP] then run over the allowed runs only.
    """
    n, k = len(weights), num_stages
    if not 1 <= k <= n or len(cuts) != n + 1:
        raise PartitionError(
            f"A contiguous split needs 1 <= num_stages <= items and one cut per position. "
            f"Received: num_stages={k}, items={n}, len(cuts)={len(cuts)}.")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(weights, dtype=np.float64))])
    cut = np.asarray(cuts, dtype=np.float64).copy()
    cut[0] = cut[n] = 0.0
    price = kappa * cut
    best = _bottleneck(prefix, price, k, math.inf, limits)
    if best == math.inf:
        return None
    limit = best + _TOL * max(abs(best), 1e-300)
    return _fewest_bytes(prefix, price, cut, k, limit, math.inf, limits)


def min_bottleneck(weights: Sequence[float], num_stages: int) -> float:
    """The least possible weight of the heaviest run when splitting ``weights`` into
    ``num_stages`` contiguous runs."""
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(weights, dtype=np.float64))])
    return _bottleneck(prefix, np.zeros(len(prefix)), num_stages, math.inf)


def _blocks(prefix: Array, heaviest: float) -> list[tuple[int, int, int]]:
    """Column blocks ``[j0, j1)`` with the rows ``[i0, j1)`` that can start a run ending in
    them: ``i < j``, and the run no heavier than ``heaviest`` (weights are non-negative)."""
    n = len(prefix) - 1
    width = max(1, min(_BLOCK_WIDTH, _BLOCK_ELEMENTS // (n + 1)))
    out = []
    for j0 in range(0, n + 1, width):
        i0 = int(np.searchsorted(prefix, prefix[j0] - heaviest)) if heaviest < math.inf else 0
        out.append((min(i0, j0), j0, min(j0 + width, n + 1)))
    return out


def _costs(prefix: Array, price: Array, i0: int, j0: int, j1: int, heaviest: float,
           limits: MemoryLimits | None = None, t: int = 0) -> Array:
    """``cost(i, j)`` for ``i`` in ``[i0, j1)`` (rows) and ``j`` in ``[j0, j1)`` (columns); inf
    where ``i >= j``, the run weighs more than ``heaviest`` or does not fit stage ``t``."""
    i = np.arange(i0, j1)[:, None]
    j = np.arange(j0, j1)[None, :]
    weight = prefix[j] - prefix[i]
    c = weight + (price[i] + price[j])
    ok = (i < j) & (weight <= heaviest)
    if limits is not None:
        ok &= limits.allowed(t, i, j)
    return np.where(ok, c, np.inf)


def _first_row(prefix: Array, price: Array, heaviest: float,
               limits: MemoryLimits | None = None) -> Array:
    weight = prefix - prefix[0]
    ok = weight <= heaviest
    if limits is not None:
        ok &= limits.allowed(0, 0, np.arange(len(prefix)))
    row: Array = np.where(ok, weight + (price[0] + price), np.inf)
    row[0] = np.inf
    return row


def _bottleneck(prefix: Array, price: Array, k: int, heaviest: float,
                limits: MemoryLimits | None = None) -> float:
    n = len(prefix) - 1
    f = _first_row(prefix, price, heaviest, limits)
    blocks = _blocks(prefix, heaviest)
    for t in range(1, k):
        nxt = np.full(n + 1, np.inf)
        for i0, j0, j1 in blocks:
            costs = _costs(prefix, price, i0, j0, j1, heaviest, limits, t)
            nxt[j0:j1] = np.maximum(f[i0:j1, None], costs).min(axis=0)
        f = nxt
    return float(f[n])


def _fewest_bytes(prefix: Array, price: Array, cut: Array, k: int, limit: float,
                  heaviest: float, limits: MemoryLimits | None = None) -> list[int]:
    n = len(prefix) - 1
    h = np.where(_first_row(prefix, price, heaviest, limits) <= limit, cut, np.inf)
    blocks = _blocks(prefix, heaviest)
    back: list[npt.NDArray[np.intp]] = []
    for t in range(1, k):
        nxt = np.full(n + 1, np.inf)
        arg = np.zeros(n + 1, dtype=np.intp)
        for i0, j0, j1 in blocks:
            ok = _costs(prefix, price, i0, j0, j1, heaviest, limits, t) <= limit
            m = np.where(ok, h[i0:j1, None], np.inf)
            a = m.argmin(axis=0)
            arg[j0:j1] = a + i0
            nxt[j0:j1] = m[a, np.arange(j1 - j0)] + cut[j0:j1]
        back.append(arg)
        h = nxt
    starts = [n]
    for arg in reversed(back):
        starts.append(int(arg[starts[-1]]))
    return [0, *reversed(starts[1:])]
