"""METIS k-way partitioning of the group graph, repaired into ordered, non-empty stages.

Pure: uses pymetis (C METIS), never TensorFlow.

Example::

    stage = partition_metis(problem, 4)            # stage of each group, ordered

[Note: METIS repair] METIS minimises the bytes cut under a balance constraint but knows nothing
of direction: its parts are unordered and the part graph may have cycles. We rank the parts by
the mean topological position of their groups, giving each group a wanted stage ``r``, and build
three ordered candidates from it:
  (a) a topological order of the groups that follows ``r`` wherever dependencies allow (Kahn's
      algorithm taking the ready group with the smallest ``r``), split optimally by the
      contiguous DP: METIS decides which groups sit together, the DP where to cut;
  (b) push forward: ``s = max(r, stages of predecessors)``, the least ordered assignment >= r;
  (c) pull back: ``s = min(r, stages of successors)``, the greatest ordered assignment <= r.
Each candidate then has empty stages filled (shift a stage's last group in topological order to
the next stage: it feeds only later stages, so the order holds) and, with ``contiguous``, its
disconnected pieces moved to a neighbouring stage they touch where the order allows. The best
candidate by the planner objective is refined by moving single groups out of the bottleneck
stage to a neighbour while (excess, bottleneck, sum of squared stage costs) decreases. Every step keeps all edges forward, so the result is ordered whatever METIS returned.
"""

from __future__ import annotations

import heapq
from typing import Any

from tfsmp.partitioning.contiguous import partition_contiguous
from tfsmp.partitioning.planner import Problem, StageLoad, better

__all__ = ["metis_parts", "partition_metis"]

_WEIGHT_SCALE = 1_000_000  # METIS takes integer weights; this keeps 6 significant digits
_SEED = 0  # fixed, so every rank computes the same plan


def partition_metis(problem: Problem, num_stages: int, *, contiguous: bool = True) -> list[int]:
    """The stage of each group: METIS parts repaired per [Note: METIS repair].

    Args:
        problem: the contracted graph (`tfsmp.partitioning.planner.build_problem`).
        num_stages: stages wanted; at most ``len(problem)``.
        contiguous: also make each stage connected where the graph allows.

    Returns:
        Stage per group; every stage non-empty, every edge from a stage to the same or a later one.
    """
    n, k = len(problem), num_stages
    if k == 1:
        return [0] * n
    if n == k:
        return list(range(n))
    wanted = _rank_parts(metis_parts(problem, k))
    split = partition_contiguous(problem, k, _metis_order(problem, wanted))
    best: StageLoad | None = None
    for stage in (split, _push_forward(problem, wanted), _pull_back(problem, wanted)):
        _fill_empty(problem, stage, k)
        load = problem.load(stage, k)
        if contiguous:
            _connect(load)
        if best is None or better(load.objective(), best.objective()):
            best = load
    if best is None:
        return split
    # Refining only the leader keeps the cost down; a trailing candidate is rarely close.
    _refine(best, contiguous)
    return best.stage


def metis_parts(problem: Problem, num_parts: int) -> list[int]:
    """METIS k-way part of each group: balanced group weights, fewest bytes cut."""
    import pymetis

    starts, adjacent, eweights = [0], [], []
    top = max((b for nb in problem.adj for b in nb.values()), default=1) or 1
    for nb in problem.adj:
        for other in sorted(nb):
            adjacent.append(other)
            # relative scale keeps huge byte counts inside METIS's 32-bit weights
            eweights.append(max(1, round(nb[other] * _WEIGHT_SCALE / top)))
        starts.append(len(adjacent))
    vweights = [max(1, round(w * _WEIGHT_SCALE)) for w in problem.weight]
    options = pymetis.Options(seed=_SEED)
    kwargs: dict[str, Any] = {"vweights": vweights, "eweights": eweights or None,
                              "options": options, "recursive": False}
    if hasattr(pymetis, "CSRAdjacency"):
        result = pymetis.part_graph(num_parts, pymetis.CSRAdjacency(starts, adjacent), **kwargs)
    else:  # pymetis < 2025.2
        result = pymetis.part_graph(num_parts, xadj=starts, adjncy=adjacent, **kwargs)
    return [int(p) for p in result[1]]


def _rank_parts(parts: list[int]) -> list[int]:
    """Renumbers parts by the mean position of their groups (ties: part id)."""
    positions: dict[int, list[int]] = {}
    for g, p in enumerate(parts):
        positions.setdefault(p, []).append(g)
    order = sorted(positions, key=lambda p: (sum(positions[p]) / len(positions[p]), p))
    rank = {p: r for r, p in enumerate(order)}
    return [rank[p] for p in parts]


def _metis_order(problem: Problem, wanted: list[int]) -> list[int]:
    """A topological order of the groups that follows the ranked METIS parts where it can."""
    indegree = [len(a) for a in problem.pred]
    ready = [(wanted[g], g) for g in range(len(problem)) if indegree[g] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, g = heapq.heappop(ready)
        order.append(g)
        for c in problem.succ[g]:
            indegree[c] -= 1
            if indegree[c] == 0:
                heapq.heappush(ready, (wanted[c], c))
    return order


def _push_forward(problem: Problem, wanted: list[int]) -> list[int]:
    stage = list(wanted)
    for g in range(len(problem)):  # groups are numbered topologically
        stage[g] = max([wanted[g], *(stage[a] for a in problem.pred[g])])
    return stage


def _pull_back(problem: Problem, wanted: list[int]) -> list[int]:
    stage = list(wanted)
    for g in reversed(range(len(problem))):
        stage[g] = min([wanted[g], *(stage[c] for c in problem.succ[g])])
    return stage


def _fill_empty(problem: Problem, stage: list[int], k: int) -> None:
    """Shifts groups until every stage has one. A stage's last group (in topological order)
    feeds only later stages, and its first group is fed only by earlier ones, so moving those
    one stage forward or back keeps the order."""
    while True:
        counts = [0] * k
        for s in stage:
            counts[s] += 1
        empty = [s for s in range(k) if counts[s] == 0]
        if not empty:
            return
        e = empty[0]
        donors = [d for d in range(k) if counts[d] >= 2]
        d = min(donors, key=lambda d: (abs(d - e), d > e))
        step = 1 if d < e else -1
        for x in range(d, e, step):
            members = [g for g in range(len(problem)) if stage[g] == x]
            stage[max(members) if step == 1 else min(members)] = x + step


def _components(load: StageLoad, s: int, without: int = -1) -> list[set[int]]:
    """Connected pieces of stage ``s`` (edges in either direction), optionally minus a group."""
    left = set(load.members[s]) - {without}
    pieces: list[set[int]] = []
    while left:
        todo = [min(left)]
        piece = set(todo)
        left -= piece
        while todo:
            g = todo.pop()
            for other in load.p.adj[g]:
                if other in left:
                    left.discard(other)
                    piece.add(other)
                    todo.append(other)
        pieces.append(piece)
    return pieces


def _connect(load: StageLoad) -> None:
    """Moves each stage's smaller disconnected pieces to a stage they touch, if the order allows."""
    for _ in range(3 * load.k):
        moved = False
        for s in range(load.k):
            pieces = _components(load, s)
            if len(pieces) < 2:
                continue
            pieces.sort(key=lambda c: (-sum(load.p.weight[g] for g in c), min(c)))
            for piece in pieces[1:]:
                moved |= _move_piece(load, piece, s)
        if not moved:
            return


def _move_piece(load: StageLoad, piece: set[int], s: int) -> bool:
    p = load.p
    lo = max((load.stage[a] for g in piece for a in p.pred[g] if a not in piece), default=0)
    hi = min((load.stage[c] for g in piece for c in p.succ[g] if c not in piece),
             default=load.k - 1)
    touching = {load.stage[o] for g in piece for o in p.adj[g] if o not in piece} - {s}
    targets = sorted(t for t in touching if lo <= t <= hi)
    best: tuple[tuple[float, float, float], int] | None = None
    for t in targets:
        for g in piece:
            load.move(g, t)
        key = load.key()
        for g in piece:
            load.move(g, s)
        if best is None or key < best[0]:
            best = (key, t)
    if best is None:
        return False
    for g in piece:
        load.move(g, best[1])
    return True


def _refine(load: StageLoad, contiguous: bool) -> None:
    """Greedy: move one group out of the bottleneck stage to a neighbour while the key improves."""
    for _ in range(20 * len(load.p) + 100):
        # the stage that sets the first term of the key: heaviest while over the cap
        costs = load.w if load.excess() > 0 else load.costs()
        b = max(range(load.k), key=lambda s: (costs[s], -s))
        current = load.key()
        options: list[tuple[tuple[float, float, float], int, int]] = []
        for g in sorted(load.members[b]):
            for t in (b - 1, b + 1):
                if load.can_move(g, t):
                    load.move(g, t)
                    key = load.key()
                    load.move(g, b)
                    if key < current:
                        options.append((key, g, t))
        for _, g, t in sorted(options):
            if not contiguous or _stays_connected(load, g, b, t):
                load.move(g, t)
                break
        else:
            return


def _stays_connected(load: StageLoad, g: int, s: int, t: int) -> bool:
    """Whether moving ``g`` from ``s`` to ``t`` adds no disconnected piece to either stage."""
    if not any(load.stage[o] == t for o in load.p.adj[g]):
        return False
    return len(_components(load, s, without=g)) <= len(_components(load, s))
