"""The partitioner's cost model and `plan_graph`, the one entry point to every planner.

Pure: imports neither TensorFlow nor Keras.

Example::

    plan = plan_graph(graph, 4, optimize="speed")           # auto: METIS vs contiguous DP
    plan = plan_graph(graph, 2, method="manual", manual={"d1": 0}, default_partition=1)

[Note: objective] All planners are judged by one objective (docs/partitioning.md). Every non-input
layer has a weight ``w`` (`vertex_weights`), normalised so the weights sum to 1; ``W_s`` sums a
stage's weights. A stage's cost adds its communication:

    cost_s = W_s + kappa * (in_s + out_s)

``in_s``/``out_s`` are the boundary bytes per sample it receives/sends (a tensor sent to two later
stages counts twice for its producer), and ``kappa`` prices a byte in weight units:
``(1 - memory_weight) * 2 * flops_per_byte / total_compute`` (2: the activation goes forward and
its gradient comes back; with profiled seconds, ``2 / bandwidth / total_seconds``). The objective
is the triple, compared lexicographically,

    (excess, max_s cost_s, sum_s out_s)    excess = max(0, max_s W_s - cap)

with ``cap = max(IMBALANCE_TARGET / N, W*)`` and ``W*`` the least largest stage weight of any
contiguous split of the group order (what layer granularity allows). So a plan first keeps every
stage within 1.10x the mean where the layers allow it; then minimises the bottleneck stage, which
bounds pipeline throughput; then sends the fewest bytes. Tied copies add their memory to ``W_s``
and their gradient reduction to ``in_s``/``out_s`` ([Note: pricing copies] in `ties.py`); plans
that keep each tie on one stage compete with plans that copy ([Note: tie candidates]).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tfsmp.errors import ConfigError, PartitionError
from tfsmp.graph.ir import LayerGraph
from tfsmp.partitioning.contiguous import min_bottleneck, partition_contiguous
from tfsmp.partitioning.manual import plan_manual
from tfsmp.partitioning.plan import StagePlan
from tfsmp.partitioning.ties import GroupTie, group_ties

if TYPE_CHECKING:
    from tfsmp.partitioning.memory import MemorySettings

__all__ = [
    "BYTES_PER_SECOND",
    "FLOPS_PER_BYTE",
    "IMBALANCE_TARGET",
    "METHODS",
    "Objective",
    "Problem",
    "StageLoad",
    "build_problem",
    "effective_memory_weight",
    "objective",
    "plan_graph",
    "vertex_weights",
]

METHODS = ("auto", "metis", "contiguous", "manual")
# FLOPs a stage could run in the time one boundary byte takes to cross between two processes:
# ~50 GFLOP/s per CPU core against ~5-10 GB/s shared-memory MPI (measured here, 2026-12). GPUs with
# slower links have a much higher ratio; pass `flops_per_byte` to plan for them.
FLOPS_PER_BYTE = 10.0
# Bandwidth used when layer costs are profiled seconds instead of FLOPs.
BYTES_PER_SECOND = 1e10
IMBALANCE_TARGET = 1.10  # max/mean stage weight a plan stays within where the layers allow it
_DEFAULT_MEMORY_WEIGHT = 0.8  # SMP's default for optimize="memory"
_REL_TOL = 1e-9

Objective = tuple[float, float, int]
"""(balance excess, bottleneck stage cost, boundary bytes per sample): [Note: objective]."""


# -- vertex weights ------------------------------------------------------------------------------


def effective_memory_weight(optimize: str, memory_weight: float | None) -> float:
    """The weight of memory against compute in a layer's cost.

    ``optimize="speed"`` balances compute only, whatever ``memory_weight`` says (the issue's
    definition); ``"memory"`` blends memory and compute, with ``memory_weight`` (default 0.8,
    SMP's default for ``optimize="memory"``).

    Raises:
        ConfigError: for an unknown ``optimize`` or a weight outside [0, 1].
    """
    if optimize not in ("speed", "memory"):
        raise ConfigError(
            f"optimize must be 'speed' or 'memory'. Received: optimize={optimize!r}")
    if memory_weight is not None and not 0.0 <= memory_weight <= 1.0:
        raise ConfigError(
            f"memory_weight must be between 0.0 and 1.0. Received: memory_weight={memory_weight}")
    if optimize == "speed":
        return 0.0
    return _DEFAULT_MEMORY_WEIGHT if memory_weight is None else float(memory_weight)


def vertex_weights(graph: LayerGraph, optimize: str = "speed", memory_weight: float | None = None,
                   optimizer: str | None = None, batch_size: int = 1) -> dict[str, float]:
    """Each non-input layer's share of the model's cost; the shares sum to 1.

    ``w = m * memory / total_memory + (1 - m) * compute / total_compute`` with ``m`` from
    `effective_memory_weight`; memory is parameters + optimizer state + activations of
    ``batch_size`` samples (`LayerGraph.memory_of`). A total of zero (an unprofiled graph)
    falls back to counting layers.

    Args:
        graph: the layer graph.
        optimize: ``"speed"`` or ``"memory"``.
        memory_weight: weight of memory in the blend (``optimize="memory"`` only).
        optimizer: Keras optimizer name, for its state size (``None``: Adam).
        batch_size: samples whose activations a stage holds at once.

    Returns:
        Layer name -> weight, for every non-input layer.
    """
    mw = effective_memory_weight(optimize, memory_weight)
    names = [n.name for n in graph if not n.is_input]
    compute = _normalized({n: graph.nodes[n].compute for n in names})
    if mw == 0.0:
        return compute
    memory = _normalized({n: graph.memory_of(n, optimizer, batch_size) for n in names})
    return {n: mw * memory[n] + (1.0 - mw) * compute[n] for n in names}


def _normalized(values: Mapping[str, float]) -> dict[str, float]:
    total = sum(values.values())
    if total <= 0:
        return {n: 1.0 / len(values) for n in values} if values else {}
    return {n: v / total for n, v in values.items()}


# -- the contracted problem ----------------------------------------------------------------------


@dataclass(frozen=True)
class GroupTensor:
    """A tensor that leaves its producer's group: consumers are other groups; ``output`` means
    the last stage needs it too (it computes the loss)."""

    producer: int
    consumers: tuple[int, ...]
    output: bool
    nbytes: int


@dataclass
class Problem:
    """The layer graph contracted to groups (`LayerGraph.groups`), which is what planners split.

    Groups are numbered in topological order, so an assignment whose stage never decreases along
    the numbering is ordered. ``kappa`` is the objective's price of a boundary byte.
    """

    groups: list[list[str]]
    weight: list[float]
    tensors: list[GroupTensor]
    kappa: float
    ties: list[GroupTie] = field(default_factory=list)
    succ: list[list[int]] = field(default_factory=list)
    pred: list[list[int]] = field(default_factory=list)
    # undirected neighbours with the bytes between them (METIS edge weights)
    adj: list[dict[int, int]] = field(default_factory=list)
    t_out: list[list[int]] = field(default_factory=list)
    t_in: list[list[int]] = field(default_factory=list)
    g_ties: list[list[int]] = field(default_factory=list)  # group -> ties it runs a node of
    _caps: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.groups)
        self.g_ties = [[] for _ in range(n)]
        for ti, tie in enumerate(self.ties):
            for g in tie.groups:
                self.g_ties[g].append(ti)
        succ: list[set[int]] = [set() for _ in range(n)]
        self.adj = [{} for _ in range(n)]
        self.t_out = [[] for _ in range(n)]
        self.t_in = [[] for _ in range(n)]
        for ti, t in enumerate(self.tensors):
            self.t_out[t.producer].append(ti)
            for c in t.consumers:
                succ[t.producer].add(c)
                self.t_in[c].append(ti)
                for a, b in ((t.producer, c), (c, t.producer)):
                    self.adj[a][b] = self.adj[a].get(b, 0) + t.nbytes
        self.succ = [sorted(s) for s in succ]
        pred: list[list[int]] = [[] for _ in range(n)]
        for a, cs in enumerate(self.succ):
            for c in cs:
                pred[c].append(a)
        self.pred = pred

    def __len__(self) -> int:
        return len(self.groups)

    def cuts(self, order: Sequence[int] | None = None) -> list[int]:
        """Bytes crossing each position of a topological group order (default: the numbering).

        ``cuts()[p]`` counts tensors made before the group at position ``p`` and needed at or
        after it; entries 0 and ``len`` are 0. An output is needed at the last position.
        """
        n = len(self.groups)
        pos = list(range(n)) if order is None else _positions(order)
        diff = [0] * (n + 2)
        for t in self.tensors:
            a = pos[t.producer]
            last = n - 1 if t.output else max((pos[c] for c in t.consumers), default=a)
            if last > a:
                diff[a + 1] += t.nbytes
                diff[last + 1] -= t.nbytes
        out, run = [0] * (n + 1), 0
        for p in range(n):
            run += diff[p]
            out[p] = run
        return out

    def cap(self, num_stages: int) -> float:
        """The largest stage weight a plan may have without excess (see [Note: objective])."""
        if num_stages not in self._caps:
            best = min_bottleneck(self.weight, num_stages) if len(self) >= num_stages else 1.0
            self._caps[num_stages] = max(IMBALANCE_TARGET / num_stages, best)
        return self._caps[num_stages]

    def load(self, stage: Sequence[int], num_stages: int) -> StageLoad:
        return StageLoad(self, list(stage), num_stages)

    def stage_of(self, stage: Sequence[int]) -> dict[str, int]:
        """Group stages -> layer stages."""
        return {n: stage[g] for g, members in enumerate(self.groups) for n in members}


def _positions(order: Sequence[int]) -> list[int]:
    pos = [0] * len(order)
    for i, g in enumerate(order):
        pos[g] = i
    return pos


def build_problem(graph: LayerGraph, *, optimize: str = "speed", memory_weight: float | None = None,
                  optimizer: str | None = None, batch_size: int = 1,
                  flops_per_byte: float = FLOPS_PER_BYTE, step_samples: int | None = None
                  ) -> Problem:
    """Contracts ``graph`` to its groups and prices boundary bytes and tied copies (see [Note:
    objective]; ``step_samples``: samples per optimizer step, default ``batch_size``)."""
    weights = vertex_weights(graph, optimize, memory_weight, optimizer, batch_size)
    groups = [[n for n in g if not graph.nodes[n].is_input] for g in graph.groups()]
    groups = [g for g in groups if g]
    where = {n: gi for gi, g in enumerate(groups) for n in g}
    readers: dict[str, list[str]] = {}
    for layer, keys in graph.reads.items():
        for k in keys:
            readers.setdefault(k, []).append(layer)
    outputs = set(graph.outputs)
    tensors: list[GroupTensor] = []
    for key, info in graph.tensors.items():
        src = where.get(info.producer)
        if src is None:
            continue  # model inputs are read by every rank, never sent
        cons = sorted({where[c] for c in readers.get(key, ()) if c in where} - {src})
        if cons or key in outputs:
            tensors.append(GroupTensor(src, tuple(cons), key in outputs, info.bytes_per_sample))
    mw = effective_memory_weight(optimize, memory_weight)
    ties = group_ties(graph, groups, memory_weight=mw, optimizer=optimizer,
                      batch_size=batch_size, step_samples=step_samples)
    return Problem(groups, [sum(weights[n] for n in g) for g in groups], tensors,
                   kappa=(1.0 - mw) * _byte_price(graph, flops_per_byte), ties=ties)


def _byte_price(graph: LayerGraph, flops_per_byte: float) -> float:
    layers = [n for n in graph if not n.is_input]
    total = sum(n.compute for n in layers)
    if total <= 0:
        return 0.0  # no compute scale to compare bytes with: balance alone decides
    if layers and all(n.measured_seconds is not None for n in layers):
        return 2.0 / BYTES_PER_SECOND / total
    return 2.0 * flops_per_byte / total


class StageLoad:
    """Per-stage weight and boundary traffic of a group assignment, updated move by move.

    Example::

        load = problem.load(stage, num_stages)
        load.move(g, 2)
        load.objective()     # (excess, bottleneck cost, total bytes)
    """

    def __init__(self, problem: Problem, stage: list[int], num_stages: int) -> None:
        self.p = problem
        self.k = num_stages
        self.cap = problem.cap(num_stages)
        self.stage = stage
        self.w = [0.0] * num_stages
        self.inb = [0] * num_stages
        self.outb = [0] * num_stages
        self.members: list[set[int]] = [set() for _ in range(num_stages)]
        for g, s in enumerate(stage):
            self.w[s] += problem.weight[g]
            self.members[s].add(g)
        # per tensor: stage -> how many of its readers sit there (the output counts as a reader)
        self.readers: list[dict[int, int]] = []
        for ti, t in enumerate(problem.tensors):
            r: dict[int, int] = {}
            for c in t.consumers:
                r[stage[c]] = r.get(stage[c], 0) + 1
            if t.output:
                r[num_stages - 1] = r.get(num_stages - 1, 0) + 1
            self.readers.append(r)
            self._account(ti, 1)
        # per tie: stage -> how many of its groups sit there ([Note: pricing copies])
        self.holders: list[dict[int, int]] = []
        for k, tie in enumerate(problem.ties):
            h: dict[int, int] = {}
            for g in tie.groups:
                h[stage[g]] = h.get(stage[g], 0) + 1
            self.holders.append(h)
            self._account_tie(k, 1)

    def _account_tie(self, k: int, sign: int) -> None:
        """Adds (``sign`` 1) or removes (-1) a tie's copies: memory on every holder but the
        owner's stage; the gradient reduction on every holder when there are two or more."""
        tie = self.p.ties[k]
        holders = self.holders[k]
        owner = self.stage[tie.owner]
        for s in holders:
            if s != owner:
                self.w[s] += sign * tie.weight
            if len(holders) > 1:
                self.inb[s] += sign * tie.nbytes
                self.outb[s] += sign * tie.nbytes

    def _account(self, ti: int, sign: int) -> None:
        t = self.p.tensors[ti]
        src = self.stage[t.producer]
        dests = [s for s in self.readers[ti] if s != src]
        self.outb[src] += sign * t.nbytes * len(dests)
        for s in dests:
            self.inb[s] += sign * t.nbytes

    def move(self, g: int, to: int) -> None:
        """Puts group ``g`` on stage ``to`` (no ordering check: callers check `can_move`)."""
        old = self.stage[g]
        if old == to:
            return
        touched = dict.fromkeys(self.p.t_out[g] + self.p.t_in[g])
        ties = self.p.g_ties[g]
        for ti in touched:
            self._account(ti, -1)
        for k in ties:
            self._account_tie(k, -1)
            h = self.holders[k]
            h[old] -= 1
            if h[old] == 0:
                del h[old]
            h[to] = h.get(to, 0) + 1
        for ti in self.p.t_in[g]:
            r = self.readers[ti]
            r[old] -= 1
            if r[old] == 0:
                del r[old]
            r[to] = r.get(to, 0) + 1
        self.stage[g] = to
        self.w[old] -= self.p.weight[g]
        self.w[to] += self.p.weight[g]
        self.members[old].discard(g)
        self.members[to].add(g)
        for ti in touched:
            self._account(ti, 1)
        for k in ties:
            self._account_tie(k, 1)

    def can_move(self, g: int, to: int) -> bool:
        """Whether ``g`` may go to the adjacent stage ``to`` keeping every edge forward and its
        stage non-empty."""
        s = self.stage[g]
        if len(self.members[s]) < 2 or abs(to - s) != 1 or not 0 <= to < self.k:
            return False
        if to > s:
            return all(self.stage[c] >= to for c in self.p.succ[g])
        return all(self.stage[a] <= to for a in self.p.pred[g])

    def cost(self, s: int) -> float:
        return self.w[s] + self.p.kappa * (self.inb[s] + self.outb[s])

    def costs(self) -> list[float]:
        return [self.cost(s) for s in range(self.k)]

    def excess(self) -> float:
        over = max(self.w) - self.cap
        return over if over > _REL_TOL * self.cap else 0.0

    def objective(self) -> Objective:
        return self.excess(), max(self.costs()), sum(self.outb)

    def key(self) -> tuple[float, float, float]:
        """Local-search key: excess, bottleneck, then the sum of squared costs (spreads ties)."""
        c = self.costs()
        return self.excess(), max(c), sum(x * x for x in c)


def better(a: Objective, b: Objective) -> bool:
    """Whether objective ``a`` is strictly better than ``b``: less excess, then a smaller
    bottleneck (within a relative tolerance), then fewer bytes."""
    if abs(a[0] - b[0]) > _REL_TOL:
        return a[0] < b[0]
    tol = _REL_TOL * max(abs(a[1]), abs(b[1]), 1e-300)
    if abs(a[1] - b[1]) > tol:
        return a[1] < b[1]
    return a[2] < b[2]


def objective(graph: LayerGraph, stage_of: Mapping[str, int], num_stages: int, *,
              optimize: str = "speed", memory_weight: float | None = None,
              optimizer: str | None = None, batch_size: int = 1,
              flops_per_byte: float = FLOPS_PER_BYTE) -> Objective:
    """The [Note: objective] of an assignment (layer -> stage; non-input layers)."""
    problem = build_problem(graph, optimize=optimize, memory_weight=memory_weight,
                            optimizer=optimizer, batch_size=batch_size,
                            flops_per_byte=flops_per_byte)
    stage = [_group_stage(stage_of, members) for members in problem.groups]
    return problem.load(stage, num_stages).objective()


def _group_stage(stage_of: Mapping[str, int], members: list[str]) -> int:
    stages = {stage_of[n] for n in members}
    if len(stages) != 1:
        where = ", ".join(f"'{n}'->{stage_of[n]}" for n in members)
        raise PartitionError(
            f"Layers that must share a stage are split. Received: {where}.")
    return stages.pop()


# -- the entry point -----------------------------------------------------------------------------


def plan_graph(graph: LayerGraph, num_stages: int, *, optimize: str = "speed",
               memory_weight: float | None = None, method: str = "auto",
               manual: Mapping[str, int] | None = None, default_partition: int | None = None,
               contiguous: bool = True, optimizer: str | None = None, batch_size: int = 1,
               flops_per_byte: float = FLOPS_PER_BYTE, step_samples: int | None = None,
               memory: MemorySettings | None = None, memory_cap: float | None = None
               ) -> StagePlan:
    """Splits ``graph`` into ``num_stages`` ordered stages.

    With ``optimize="memory"`` and no ``memory_weight``, the plan keeps every rank within
    ``memory_cap`` bytes (predicted by `tfsmp.partitioning.memory`) and among those plans
    balances compute ([Note: memory plans]); without a cap it is the compute plan.

    Args:
        graph: the layer graph (`tfsmp.graph.tracer.trace(model).graph`).
        num_stages: stages of one pipeline replica (``partitions * virtual_stages``).
        optimize: ``"speed"`` (balance compute) or ``"memory"`` (blend memory and compute).
        memory_weight: weight of memory in the blend, ``optimize="memory"`` only.
        method: ``"auto"`` (run ``"metis"`` and ``"contiguous"``, keep the better objective),
            ``"metis"``, ``"contiguous"`` or ``"manual"``.
        manual: layer -> stage for layers inside ``smp.partition(i)`` scopes (``"manual"``
            only; ignored otherwise, as SMP ignores the scopes when ``auto_partition`` is on).
        default_partition: the stage of every layer ``manual`` does not name.
        contiguous: METIS only: also make each stage connected where the graph allows.
        optimizer: Keras optimizer name, for optimizer-state memory (``None``: Adam).
        batch_size: samples whose activations a stage holds at once (memory weights).
        flops_per_byte: the objective's price of a boundary byte, in FLOPs.
        step_samples: samples per optimizer step, to price tied copies' gradient reduction
            (default ``batch_size``; [Note: pricing copies] in `ties.py`).
        memory: how the plan will run (schedule, microbatches, batch), for memory plans
            (default: ``num_stages`` ranks, one microbatch of ``batch_size``).
        memory_cap: bytes each rank may use (``tfsmp run --memory-per-rank``), memory plans.

    Returns:
        A validated `StagePlan` whose notes record the objective.

    Raises:
        PartitionError: if the model cannot be split so (too few layers or groups, or a manual
            plan that sends a tensor backwards or splits layers that share variables).
        ConfigError: for an unknown ``method`` or ``optimize``.
    """
    if method not in METHODS:
        raise ConfigError(f"method must be one of {METHODS}. Received: method={method!r}")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be at least 1. Received: batch_size={batch_size}")
    if method == "manual":
        return plan_manual(graph, num_stages, manual or {}, default_partition, optimizer=optimizer)
    def problem_of(g: LayerGraph) -> Problem:
        return build_problem(g, optimize=optimize, memory_weight=memory_weight,
                             optimizer=optimizer, batch_size=batch_size,
                             flops_per_byte=flops_per_byte, step_samples=step_samples)

    if optimize == "memory" and memory_weight is None:  # [Note: memory plans]
        from tfsmp.partitioning.memory import MemorySettings
        from tfsmp.partitioning.memory_plan import plan_within_memory

        settings = memory or MemorySettings(partitions=num_stages, batch_size=batch_size,
                                            optimizer=optimizer)
        compute = plan_graph(graph, num_stages, optimize="speed", method=method,
                             contiguous=contiguous, optimizer=optimizer, batch_size=batch_size,
                             flops_per_byte=flops_per_byte, step_samples=step_samples)
        return plan_within_memory(graph, num_stages, settings, memory_cap, compute,
                                  flops_per_byte=flops_per_byte, step_samples=step_samples)
    problem = problem_of(graph)
    check_feasible(problem, num_stages)
    name, stage, notes = _best_automatic(problem, num_stages, method, contiguous)
    if graph.ties:
        name, stage, notes = _tie_candidates(graph, problem, problem_of(graph.with_ties_colocated()),
                                             num_stages, method, contiguous, (name, stage, notes))
    return StagePlan.from_assignment(graph, problem.stage_of(stage), num_stages, planner=name,
                                     optimizer=optimizer, notes=tuple(notes))


def _tie_candidates(graph: LayerGraph, problem: Problem, together: Problem, k: int, method: str,
                    contiguous: bool, apart: tuple[str, list[int], list[str]]
                    ) -> tuple[str, list[int], list[str]]:
    """[Note: tie candidates] The planners split the groups with tied layers free to sit apart
    (holding copies); when keeping every tie on one stage still leaves ``k`` groups, they also
    split that graph. Both are scored by the copy-aware objective of ``problem`` (a plan
    without copies pays nothing for ties), and the better one is kept."""
    name, stage, notes = apart
    score = problem.load(stage, k).objective()
    if len(together) < k:
        return name, stage, [*notes, f"ties: copies needed ({len(together)} groups without)"]
    t_name, t_stage, _ = _best_automatic(together, k, method, contiguous)
    layer_stage = together.stage_of(t_stage)
    mapped = [_group_stage(layer_stage, members) for members in problem.groups]
    t_score = problem.load(mapped, k).objective()
    text = (f"ties: copies {score[1]:.6g}/{score[2]} vs one stage {t_score[1]:.6g}/"
            f"{t_score[2]} (bottleneck/bytes)")
    if better(t_score, score):
        name, stage = t_name, mapped
    split = any(len({stage[g] for g in tie.groups}) > 1 for tie in problem.ties)
    return name, stage, [*notes, text, "ties: kept the copies" if split
                         else "ties: kept each tie on one stage"]


def _best_automatic(problem: Problem, k: int, method: str,
                    contiguous: bool) -> tuple[str, list[int], list[str]]:
    # Imported here, not at the top: metis.py builds on this module's Problem and StageLoad.
    from tfsmp.partitioning.metis import partition_metis

    candidates: list[tuple[str, list[int]]] = []
    if method in ("auto", "contiguous"):
        candidates.append(("contiguous", partition_contiguous(problem, k)))
    if method in ("auto", "metis"):
        candidates.append(("metis", partition_metis(problem, k, contiguous=contiguous)))
    scored = [(name, stage, problem.load(stage, k).objective()) for name, stage in candidates]
    best = scored[0]
    for cand in scored[1:]:
        if better(cand[2], best[2]):
            best = cand
    notes = [f"objective ({name}): excess={obj[0]:.4g} bottleneck={obj[1]:.6g} bytes={obj[2]}"
             for name, _, obj in scored]
    if len(scored) > 1:
        notes.append(f"auto: kept {best[0]}")
    return best[0], best[1], notes


def check_feasible(problem: Problem, k: int) -> None:
    layers = [n for g in problem.groups for n in g]
    if k < 1:
        raise PartitionError(f"num_stages must be at least 1. Received: num_stages={k}")
    if len(layers) < k:
        shown = ", ".join(layers[:8]) + (", ..." if len(layers) > 8 else "")
        raise PartitionError(
            f"Every stage needs at least one layer, so a model with {len(layers)} layers cannot "
            f"be split into more stages. Received: partitions={k}, layers={len(layers)} "
            f"[{shown}]. Use partitions <= {len(layers)}.")
    if len(problem) < k:
        joined = [g for g in problem.groups if len(g) > 1]
        shown = "; ".join("{" + ", ".join(g[:6]) + (", ..." if len(g) > 6 else "") + "}"
                          for g in joined[:4])
        raise PartitionError(
            f"Every stage needs at least one group of layers that must stay together (layers "
            f"sharing variables, or calls of a shared layer forming a cycle), and this model has "
            f"only {len(problem)}. Received: partitions={k}, groups={len(problem)}: {shown}. "
            f"Use partitions <= {len(problem)}.")
