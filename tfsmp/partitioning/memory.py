"""Each pipeline rank's peak memory, predicted before launch from the plan and the schedule.

Pure: imports neither TensorFlow nor Keras.

Example::

    settings = MemorySettings(partitions=4, microbatches=8, pipeline="interleaved",
                              batch_size=64, optimizer="adam")
    ranks = predict_memory(plan, graph, settings)    # one RankMemory per pipeline rank
    ranks[0].total, ranks[0].parts()                 # bytes, and what they are made of
    fits(ranks, cap=2.5 * 2**30)                     # every rank within the cap?

[Note: memory model] A rank's peak is the sum of what it holds for the whole run and the most
it holds at once during a step:

    peak = baseline + weights + optimizer state + accumulators + receive buffers
           + max over the rank's actions (activations held + the action's working set)

- *baseline*: the process before any model (Python, TensorFlow, Keras, MPI: `BASELINE_BYTES`,
  measured here as a memory cgroup's usage), what running the first step adds besides tensors
  (kernel caches, thread stacks: `RUNTIME_BYTES`), the stage programs' graphs (`OP_BYTES` per
  operation of the stages' forward graphs, counted by `tfsmp.graph.costs.measure_activations`)
  and the pages TensorFlow's allocator keeps beyond its peak (`ALLOCATOR_SLACK` of it); a
  direct update's program costs `DIRECT_OP_BYTES` more per operation.
- *weights*: the stages' variables, tied copies included; *optimizer state*: slots per
  trainable byte by optimizer (`tfsmp.graph.ir.OPTIMIZER_SLOTS`); *accumulators*: one per
  trainable variable, except where a stage updates its variables inside its backward ([Note:
  direct update] in tfsmp/runtime/memory.py: one microbatch, one replica, one unsplit stage
  per rank, no tied copy), and except, with several microbatches and otherwise the same
  conditions, linear layers whose inputs and output gradients for the step are smaller than
  their weights: those are held for the step instead, and each gradient is computed inside its
  update ([Note: weights at the step's end] in tfsmp/runtime/stage.py, `late_weights_pay`);
  with d > 1 replicas at any microbatch count, from every replica's rows ([Note: late weights
  across replicas]; the gradient sums then reduce only the other variables' accumulators).
- [Note: sharded state] with ``shard_optimizer_state`` and d > 1 replicas, a rank's optimizer
  state is the busiest replica's share of its layers' slots, split as the runtime splits
  variables (`tfsmp.partitioning.shards`, layers standing for their variables), about 1/d;
  the weight exchange after the step holds `EXCHANGE_COPIES` buckets in turn with the tied
  copies' sum ([Note: host copies in turn]; `tfsmp.partitioning.shards.exchange_bytes`).
  Accumulators that remain (non-linear
  variables, or where late weights do not pay) stay whole: every replica holds the gradient of
  every such variable after the reduction. With d > 1 (sharded or not) the
  gradient sums hold one shared bucket-sized host buffer ([Note: reduction buckets] in
  tfsmp/runtime/reduction.py).
- *buffers*, host memory outside TensorFlow's allocator: every message of a step has its own
  pre-posted buffer, kept from step to step ([Note: receive buffers] in
  tfsmp/runtime/executor.py): the activations a rank receives and the gradients it gets back,
  for the whole batch (a received activation *is* the stage's input, so it is not counted
  again in what a stage stashes); and summing tied copies' gradients across stages holds
  `TIE_GRADIENT_COPIES` host copies of them. These add to the tensors' peak even when they
  come later in the step: TensorFlow's CPU allocator (oneDNN's, the x86 default) keeps the
  pages of freed tensors for reuse, so its peak stays resident.
- [Note: host copies in turn] The step's end runs the tied copies' sum, the data-parallel
  reduction, the update and the weight exchange one after another, each freeing its host
  copies before the next starts, so only the largest of the tied sum's and the exchange's
  copies counts (the reduction's shared bucket is kept from step to step: it counts
  always). Measured on GPT-2 at p = 2 x d = 2 with sharded Adam (a 48 MiB tied embedding),
  the cgroup's usage sampled every 2 ms: the exchange raised it 96 MiB above the level the
  step had left, and no higher than the tied sum had; the sum of the two was the model's
  whole 7-14 % excess on those ranks.
- A replica with fewer rows than microbatches runs one microbatch per row
  (`step_microbatches`, as `tfsmp.runtime.batching.Batching.step_shape` splits a batch).
- *activations*: the schedule is walked action by action. After a forward a stage holds the
  microbatch until its backward: under ``optimize: speed`` the products its backward replays (its
  Dense and EinsumDense outputs, ``product_bytes``, [Note: replayed products] in
  tfsmp/runtime/deferred.py) and its model inputs, or, on a stage that takes the taped fallback,
  everything its layers keep for the backward pass (``activation_bytes``: measured by
  `tfsmp.graph.costs.measure_activations`, else the layers' outputs); under ``optimize: memory``
  only its model inputs (the rest is recomputed). A split stage (zero-bubble: B, then W later)
  holds, from B to W, each linear layer's input and output gradient. The working set of an action
  is one microbatch's full activations for a backward (recomputed in one compiled call:
  ``recompute_bytes``, [Note: recomputed bytes] in tfsmp/graph/costs.py; or stashed) and for the
  fused last stage (also one compiled call), plus the gradients in flight: a few of the largest
  variable's size while accumulating or updating directly. A speed-mode backward that replays its
  products ([Note: stashing] in tfsmp/runtime/stage.py: a stage with a Dense or EinsumDense call
  and no convolution or recurrent layer, `replays`) is one compiled call that recomputes what lies
  between them and accumulates each gradient as it comes, so it is priced as a compiled backward
  is. The taped fallback (an eager ``tape.gradient``) holds all of the stage's weight gradients at
  once. The last stage keeps every microbatch's model outputs until the step ends (the loss and
  metrics read them). The optimizer step reads the accumulators and updates one variable at a time
  ([Note: one variable at a time]): two of the largest variable.

Nothing is added for the first step: what the runtime learns then about a lookup's sparse
gradient (concatenated or summed over microbatches, [Note: sparse structure] in
tfsmp/runtime/gradients.py) it reads from a trace's static shapes and holds no tensor for; run
eagerly, it held twice a microbatch's eager activations, 97 MiB above this model's peak on
GPT-2's first stage (the tests' ``gpt2_small``, rank 0 at 0.81 of its measured peak).

So GPipe (``simple``: every forward before any backward) holds m microbatches on every rank,
1F1B (``interleaved``) at most ``p - r`` on rank r, and zb-h1 as many as 1F1B plus, on split
stages, the microbatches between their B and W.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tfsmp.graph.ir import LayerGraph, LayerNode, optimizer_slots
from tfsmp.partitioning.plan import StagePlan
from tfsmp.partitioning.shards import exchange_bytes, largest_share
from tfsmp.partitioning.ties import copy_memory

__all__ = [
    "ALLOCATOR_SLACK",
    "BASELINE_BYTES",
    "CAP_ENV",
    "DIRECT_OP_BYTES",
    "OP_BYTES",
    "RUNTIME_BYTES",
    "MemorySettings",
    "RankMemory",
    "StageMemory",
    "cap_from_environment",
    "fits",
    "group_bytes",
    "late_weights_pay",
    "predict_memory",
    "recomputed_bytes",
    "settings_of",
    "stage_counts",
    "stage_memory",
    "step_microbatches",
]

MiB = 2**20
# A rank's memory cgroup usage after `import tensorflow, keras, tfsmp` and MPI's initialization,
# before any model (measured on this project's machines, TF 2.21 CPU, 2026-12: 243-251 MiB).
BASELINE_BYTES = 248 * MiB
# What the first training step adds besides tensors and the programs' graphs: kernel caches,
# thread stacks (fitted with the next two to 10 measured ranks of Dense stacks, GPT-2, ResNet50).
RUNTIME_BYTES = 15 * MiB
# Host memory per TensorFlow operation of a stage's forward graph, for its traced programs
# (forward, recomputing backward, optimizer step).
OP_BYTES = 117 * 1024
# More per forward operation where a stage updates its variables inside its backward ([Note:
# direct update] in tfsmp/runtime/memory.py): that program (the recomputed forward, the
# backward and every variable's update) is one graph, optimized and kept whole; sampled every
# 2 ms on ResNet50 at p = 2, m = 1, its first call raised a rank's usage 377 MiB where the
# backward and the optimizer step as two programs raised it 254 (1657-1705 operations a stage;
# 69-116 MiB above the model on those ranks).
DIRECT_OP_BYTES = 55 * 1024
# Pages TensorFlow's allocator holds beyond its peak of live tensors (fragmentation), as a
# fraction of that peak.
ALLOCATOR_SLACK = 0.06
# Copies of a tied variable's gradient a rank holds while the copies' gradients are summed
# across stages (pickled send, received copy, dense sum: [Note: tied reduction] in
# tfsmp/runtime/ties.py).
TIE_GRADIENT_COPIES = 4
# Weight gradients alive at once while a stage accumulates or updates them as backward produces
# them, in units of its largest layer's trainable bytes (two inter-op threads run ahead).
GRADIENTS_IN_FLIGHT = 3
# Copies of one bucket the weight exchange holds at once with sharded optimizer state: its
# host buffer and a variable's value on its way in or out of TensorFlow (measured: sharding
# 8 Dense(4096) layers at p=2 x d=2 saved 98-227 MiB of a rank's peak for 256 MiB of slots,
# with 64 MiB buckets; benchmarks/bench_sharded_state.py).
EXCHANGE_COPIES = 2
_LINEAR = ("Dense", "EinsumDense")


@dataclass(frozen=True)
class MemorySettings:
    """How a plan runs, as far as memory is concerned (`tfsmp.config` names).

    ``batch_size`` is the samples of one optimizer step on one pipeline replica (the global
    batch divided by the data-parallel degree); ``direct`` overrides the rule that decides
    whether stages update their variables inside their backward ([Note: direct update]).
    """

    partitions: int
    microbatches: int = 1
    pipeline: str = "interleaved"
    virtual_stages: int = 1
    active_microbatches: int | None = None
    batch_size: int = 1
    data_parallel: int = 1
    optimize: str = "memory"
    optimizer: str | None = None
    nonfinite: str = "raise"
    direct: bool | None = None
    shard_optimizer_state: bool = False  # each replica holds its share ([Note: sharded state])
    # `RunPlan.drain` ([Note: drain split] in tfsmp/runtime/executor.py); None: what the runtime
    # does for ``optimize`` (`drains`)
    drain: int | None = None
    baseline: int = BASELINE_BYTES
    runtime: int = RUNTIME_BYTES

    def drains(self) -> int:
        """The microbatches whose backward an unsplit stage splits: ``drain``, or where that
        is not given, the runtime's own count for ``optimize`` (`drain_count`). Settings built
        by hand used to price no drain in speed mode, where the runtime drains: `tfsmp plan
        --optimize speed` and the memory-model benchmark priced GPT-2's last stage 4-14 % low."""
        if self.drain is not None:
            return self.drain
        from tfsmp.schedule.run_plan import drain_count

        return drain_count(self.optimize)


@dataclass(frozen=True)
class StageMemory:
    """Per-stage inputs of the model (bytes; ``*_sample`` per sample)."""

    stage: int
    weights: int
    trainable: int
    optimizer: float
    largest: int            # trainable bytes of its largest dense gradient (not a lookup's)
    saved_sample: int       # what its layers keep for backward
    inputs_sample: int      # model inputs its layers read
    received_sample: int    # activations it receives
    sent_sample: int        # activations it sends (their gradients come back)
    linear_sample: int      # its linear layers' inputs and outputs (a zero-bubble W keeps them)
    peak_layer_sample: int  # the largest single layer's saved bytes
    copies: bool            # holds a tied copy
    outputs_sample: int = 0  # model outputs it computes (the last stage keeps a step's)
    ops: int = 0            # TensorFlow operations of its forward graph
    tied: int = 0           # trainable bytes of tied variables summed with other stages
    linear: int = 0         # trainable bytes of its linear layers (weights at the step's end)
    # held per sample by its compiled forward and backward (a recomputing or fused call:
    # [Note: recomputed bytes] in tfsmp/graph/costs.py; `_recomputed`)
    recompute_sample: int = 0
    # its speed-mode backward replays its products in one compiled call ([Note: stashing] in
    # tfsmp/runtime/stage.py), not the taped fallback
    replays: bool = False
    product_sample: int = 0  # its linear layers' outputs: a replaying forward's stash (0: unknown)
    # what a tape keeps of its layers' calls, each tensor once ([Note: kept bytes] in
    # tfsmp/graph/costs.py): the taped fallback's stash (0: not measured)
    kept_sample: int = 0
    # per layer (and tied copy), its optimizer state and trainable bytes: the units replicas
    # split with sharded optimizer state ([Note: sharded state])
    optimizer_units: tuple[float, ...] = ()
    trainable_units: tuple[int, ...] = ()


@dataclass(frozen=True)
class RankMemory:
    """A rank's predicted peak, by part. ``total`` is what a memory cgroup would report."""

    rank: int
    stages: tuple[int, ...]
    baseline: int
    weights: int
    optimizer: int
    accumulators: int
    buffers: int
    activations: int
    direct: bool
    held: int = 0
    notes: tuple[str, ...] = field(default=())

    @property
    def total(self) -> int:
        return (self.baseline + self.weights + self.optimizer + self.accumulators
                + self.buffers + self.activations)

    def parts(self) -> dict[str, int]:
        """``{part: bytes}`` in report order."""
        return {"baseline": self.baseline, "weights": self.weights,
                "optimizer": self.optimizer, "accumulators": self.accumulators,
                "buffers": self.buffers, "activations": self.activations}


def stage_memory(plan: StagePlan, graph: LayerGraph, stage: int,
                 optimizer: str | None) -> StageMemory:
    """What the memory model reads of one stage (see [Note: memory model])."""
    names = plan.layers(stage)
    nodes = [graph.nodes[n] for n in names]
    copies = [t for t in plan.ties if stage in t.stages and t.owner_stage != stage]
    trainable = sum(n.trainable_param_bytes for n in nodes) + sum(
        t.trainable_param_bytes for t in copies)
    read = {k for n in names for k in graph.reads.get(n, ())}
    linear = sum(n.linear_bytes for n in nodes) or sum(
        2 * graph.tensors[k].bytes_per_sample for n in nodes if n.kind in _LINEAR
        for k in graph.writes.get(n.name, ()))
    written = {k for n in names for k in graph.writes.get(n, ())}
    return StageMemory(
        stage=stage,
        weights=sum(n.param_bytes for n in nodes) + sum(t.param_bytes for t in copies),
        trainable=trainable,
        optimizer=sum(optimizer_slots(optimizer) * n.trainable_param_bytes for n in nodes)
        + sum(copy_memory(t, optimizer) - t.param_bytes for t in copies),
        largest=max([n.trainable_param_bytes for n in nodes if not n.kind.endswith("Embedding")]
                    + [t.trainable_param_bytes for t in copies], default=0),
        saved_sample=sum(n.activation_bytes for n in nodes),
        inputs_sample=sum(graph.tensors[k].bytes_per_sample for k in graph.inputs if k in read),
        received_sample=sum(b.bytes_per_sample for b in plan.recv_boundaries(stage)),
        sent_sample=sum(b.bytes_per_sample for b in plan.send_boundaries(stage)),
        linear_sample=linear,
        peak_layer_sample=max((n.activation_bytes for n in nodes), default=0),
        recompute_sample=recomputed_bytes(nodes),
        replays=replays(nodes),
        product_sample=sum(n.product_bytes for n in nodes),
        kept_sample=sum(n.kept_bytes for n in nodes),
        copies=bool(copies) or any(stage in t.stages and t.copies > 1 for t in plan.ties),
        outputs_sample=sum(graph.tensors[k].bytes_per_sample for k in graph.outputs
                           if k in written or stage == plan.num_stages - 1),
        ops=sum(n.ops for n in nodes),
        tied=sum(t.trainable_param_bytes for t in plan.ties
                 if stage in t.stages and t.copies > 1),
        # a layer whose calls include linear ones (measured: linear_bytes) counts whole
        linear=sum(n.trainable_param_bytes for n in nodes
                   if n.kind in _LINEAR or n.linear_bytes > 0),
        optimizer_units=tuple(optimizer_slots(optimizer) * n.trainable_param_bytes
                              for n in nodes if n.trainable_param_bytes)
        + tuple(copy_memory(t, optimizer) - t.param_bytes for t in copies),
        trainable_units=tuple(n.trainable_param_bytes for n in nodes if n.trainable_param_bytes)
        + tuple(t.trainable_param_bytes for t in copies),
    )


_COSTLY = ("Conv", "RNN", "LSTM", "GRU", "Bidirectional")  # what `replays` refuses


def replays(nodes: Sequence[LayerNode]) -> bool:
    """Whether a stage of these layers runs speed mode's compiled backward ([Note: stashing] in
    tfsmp/runtime/stage.py, `_replays` there, which reads the live layers): a Dense or
    EinsumDense call to replay and no convolution or recurrent layer. From the graph, a layer
    whose measured calls include linear ones counts as one, and any kind naming a
    convolution or a recurrent layer refuses (``TFSMP_TAPED_BACKWARD=1``: none replays)."""
    if os.environ.get("TFSMP_TAPED_BACKWARD", "") not in ("", "0"):
        return False
    return (any(n.kind in _LINEAR or n.linear_bytes > 0 for n in nodes)
            and not any(c in n.kind for n in nodes for c in _COSTLY))


def _recomputed(node: LayerNode) -> int:
    """Bytes per sample a layer holds in a compiled forward and backward ([Note: recomputed
    bytes] in tfsmp/graph/costs.py): the smaller of two figures that both bound it from above,
    the compiled call's growth (which also counts the call's own backward temporaries: for
    ResNet50's layers a median 2x the taped figure, and only one layer's are alive at a time)
    and what the taped call keeps (for GPT-2's blocks 1.2x the compiled growth)."""
    if node.recompute_bytes:
        return min(node.recompute_bytes, node.activation_bytes)
    return node.activation_bytes


def recomputed_bytes(nodes: Sequence[LayerNode]) -> int:
    """Bytes per sample a stage of ``nodes`` holds in one compiled forward and backward: the
    smaller of the layers' own figures summed (`_recomputed`) and what their gradients keep
    ([Note: kept bytes] in tfsmp/graph/costs.py) plus one layer's backward temporaries at a
    time (its compiled growth beyond what it keeps). The first is the tighter bound for
    GPT-2's blocks, which a compiled graph prunes; the second for ResNet50, whose batch
    normalizations' outputs no gradient keeps (25-30 % of its taped bytes per row)."""
    own = sum(_recomputed(n) for n in nodes)
    measured = [n for n in nodes if n.recompute_bytes]
    if not measured or not any(n.kept_bytes for n in nodes):  # measured without the kept bytes
        return own
    kept = sum(n.kept_bytes for n in nodes) + max(
        max(n.recompute_bytes - n.kept_bytes, 0) for n in measured)
    return min(own, kept)


def predict_memory(plan: StagePlan, graph: LayerGraph, settings: MemorySettings
                   ) -> list[RankMemory]:
    """Every pipeline rank's predicted peak memory. See [Note: memory model].

    Raises:
        ScheduleError: the settings name no valid schedule.
    """
    s = settings
    run = run_of(s, plan)
    compute = run.compute
    stages = {st: stage_memory(plan, graph, st, s.optimizer) for st in range(plan.num_stages)}
    split = set(run.split_stages)
    drain = {st: run.drain_microbatches(st) for st in range(plan.num_stages)}
    out = []
    for rank in range(s.partitions):
        mine = [stages[st] for st in run.stages(rank)]
        late = _late(mine, run.late_possible(rank), s)
        # a stage takes late weights before a direct update ([Note: late before direct])
        direct = _direct(mine, run.direct_possible(rank), s) and not late
        out.append(_rank(rank, mine, compute.get(rank, []), split, plan.num_stages - 1, s,
                         direct, late, drain))
    return out


def run_of(settings: MemorySettings, plan: StagePlan | None = None) -> Any:
    """The `RunPlan` the runtime will execute for ``settings`` ([Note: one description of the
    run] in tfsmp/schedule/run_plan.py): its schedule, split stages and direct updates; with
    ``plan``, its drain as the runtime reads it (none where the plan says ``drain_split`` is
    off, as `tfsmp.runtime.engine` does)."""
    from tfsmp.schedule.run_plan import RunPlan

    s = settings
    drain = s.drains() if plan is None or plan.drain_split else 0
    return RunPlan.of(s.pipeline, s.partitions, s.microbatches, virtual_stages=s.virtual_stages,
                      active_microbatches=s.active_microbatches, data_parallel=s.data_parallel,
                      nonfinite=s.nonfinite, drain=drain)


def _direct(mine: Sequence[StageMemory], possible: bool, s: MemorySettings) -> bool:
    if s.direct is not None:
        return s.direct
    return possible and not any(m.copies for m in mine)


def _rank(rank: int, mine: Sequence[StageMemory], actions: Sequence[object], split: set[int],
          last: int, s: MemorySettings, direct: bool, late: set[int],
          drain: Mapping[int, frozenset[int]] | None = None) -> RankMemory:
    b = s.batch_size / s.microbatches  # samples per microbatch
    buffers = s.batch_size * sum(m.received_sample + m.sent_sample for m in mine)
    # a direct update splits nothing ([Note: drain split] in tfsmp/runtime/executor.py)
    drained = {} if direct else {st: mbs for st, mbs in (drain or {}).items()
                                 if st not in late and mbs}
    walk = _ActivationWalk({m.stage: m for m in mine}, split | late, last, b, s.optimize,
                           drained)
    held, peak = walk.run(actions)
    largest = max((m.largest for m in mine), default=0)
    # the step, after the last backward: a step's model outputs are still held (last stage);
    # late stages compute each gradient inside its update (one gradient and the optimizer's
    # temporaries: GRADIENTS_IN_FLIGHT of the largest), from the inputs kept for the step
    step = walk.kept + (0 if direct else 2 * largest)
    if late:  # across replicas, every replica's rows ([Note: late weights across replicas])
        step = (walk.kept + s.data_parallel * walk.waiting_total
                + GRADIENTS_IN_FLIGHT * largest)
    ops = sum(m.ops for m in mine)
    weights, optimizer = sum(m.weights for m in mine), int(sum(m.optimizer for m in mine))
    bucket = exchange_bytes([u for m in mine for u in m.trainable_units])
    accumulators = 0 if direct else sum(m.trainable - (m.linear if m.stage in late else 0)
                                        for m in mine)
    if s.data_parallel > 1:  # the gradient sums' shared host buffer ([Note: reduction buckets])
        buffers += int(min(bucket, accumulators))  # late linear layers reduce no gradient
    # the step's end runs the tied copies' sum, then the update, then the weight exchange:
    # their host copies come one after another ([Note: host copies in turn])
    in_turn = float(TIE_GRADIENT_COPIES * sum(m.tied for m in mine))
    if s.shard_optimizer_state and s.data_parallel > 1:  # [Note: sharded state]
        optimizer = int(largest_share([u for m in mine for u in m.optimizer_units],
                                      s.data_parallel))
        in_turn = max(in_turn, EXCHANGE_COPIES * bucket)
    tensors = weights + optimizer + accumulators + max(peak, step)
    return RankMemory(
        rank=rank, stages=tuple(m.stage for m in mine),
        baseline=s.baseline + s.runtime + int((OP_BYTES + (DIRECT_OP_BYTES if direct else 0))
                                              * ops + ALLOCATOR_SLACK * tensors),
        weights=weights, optimizer=optimizer, accumulators=accumulators,
        buffers=int(buffers + in_turn),
        activations=int(max(peak, step)), direct=direct, held=held)


def _late(mine: Sequence[StageMemory], possible: bool, s: MemorySettings) -> set[int]:
    """The rank's stages whose linear layers' weight gradients are computed at the step's end
    ([Note: weights at the step's end] in tfsmp/runtime/stage.py): where the run allows it
    (`RunPlan.late_possible`, the runtime's own rule) and `late_weights_pay` for the stage."""
    if s.direct is False or not possible or any(m.copies for m in mine):
        return set()
    rows = s.batch_size * s.data_parallel  # every replica's ([Note: late weights across replicas])
    return {m.stage for m in mine
            if late_weights_pay(rows * m.linear_sample, min(m.linear, m.trainable), m.trainable)}


class _ActivationWalk:
    """Walks one rank's compute actions, tracking what each (stage, microbatch) holds."""

    def __init__(self, stages: dict[int, StageMemory], split: set[int], last: int, b: float,
                 optimize: str, drain: Mapping[int, frozenset[int]] | None = None) -> None:
        self.stages, self.split, self.last, self.b, self.optimize = stages, split, last, b, optimize
        self.drain = drain or {}  # [Note: drain split]: held from B until the step's end
        self.kept = 0.0
        self.waiting_total = 0.0

    def stash(self, m: StageMemory) -> float:
        """Held from F to B: the replayed products (speed, [Note: stashing]) or the tape's
        saved tensors (speed's taped fallback, or products not measured), or the model inputs
        (memory)."""
        if self.optimize == "speed" and m.replays and m.product_sample:
            return self.b * (m.product_sample + m.inputs_sample)
        if self.optimize == "speed":  # taped: what the tape keeps, each tensor once
            return self.b * ((m.kept_sample or m.saved_sample) + m.inputs_sample)
        return self.b * m.inputs_sample

    def waiting(self, m: StageMemory) -> float:
        """Held from B to W on a split stage: linear layers' inputs and output gradients."""
        return self.b * m.linear_sample

    def working(self, m: StageMemory, op: str) -> float:
        """The transient of one action beyond what is held."""
        grads = GRADIENTS_IN_FLIGHT * m.largest
        # a compiled forward and backward (recomputing, or the fused last stage)
        full = self.b * (m.recompute_sample + m.inputs_sample)
        if op == "F":
            if m.stage == self.last:  # fused forward, loss and backward
                return full + grads
            return 0.0 if self.optimize == "speed" else self.b * m.peak_layer_sample
        if op == "B":
            if m.stage == self.last:
                return 0.0
            if self.optimize == "speed" and not m.replays:  # taped: stash counted; all
                # weight gradients at once (a split stage's B builds none for its linear
                # layers: [Note: split stages])
                deferred = min(m.linear, m.trainable) if m.stage in self.split else 0
                return self.b * m.peak_layer_sample + m.trainable - deferred
            return full + grads  # one compiled call, accumulating (recomputing or replaying)
        return grads  # W

    def run(self, actions: Sequence[object]) -> tuple[int, float]:
        """(most microbatches held at once, peak bytes); ``kept`` is then what the last
        stage keeps of the step's outputs until the step ends."""
        held: dict[tuple[int, int], float] = {}
        peak, most = 0.0, 0
        self.kept = 0.0
        for a in actions:
            op, st, mb = a.op.value, a.stage, a.microbatch  # type: ignore[attr-defined]
            m = self.stages.get(st)
            if m is None or op not in ("F", "B", "W"):
                continue
            drained = mb in self.drain.get(st, ())
            # a drained backward (the last stage's: its fused call) makes what its W will
            # read while its working set is still alive ([Note: drain split])
            made = self.waiting(m) if drained and (op == "B" or st == self.last) else 0.0
            peak = max(peak, sum(held.values()) + self.kept + self.working(m, op) + made)
            if op == "F" and st == self.last:
                self.kept += self.b * m.outputs_sample
                if st in self.split or drained:  # its B is fused: it waits from here
                    held[(st, mb)] = self.waiting(m)
            elif op == "F":
                held[(st, mb)] = self.stash(m)
            elif op == "B":
                held.pop((st, mb), None)
                if st in self.split or drained:
                    held[(st, mb)] = self.waiting(m)
            elif op == "W":
                held.pop((st, mb), None)
            most = max(most, len(held))
            peak = max(peak, sum(held.values()) + self.kept)
        for (st, mb) in [k for k in held if k[1] in self.drain.get(k[0], ())]:
            # the drain's W's, before the step's REDUCE or STEP ([Note: drain split])
            peak = max(peak, sum(held.values()) + self.kept + self.working(self.stages[st], "W"))
            held.pop((st, mb))
        self.waiting_total = sum(held.values())  # what split stages still hold at the end
        return most, peak


CAP_ENV = "TFSMP_MEMORY_PER_RANK"  # bytes, set by `tfsmp run --memory-per-rank`


def cap_from_environment(environ: Mapping[str, str] | None = None) -> int | None:
    """The rank's memory cap in bytes (``tfsmp run --memory-per-rank``), or None."""
    value = (os.environ if environ is None else environ).get(CAP_ENV, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def settings_of(config: Any, optimizer: str | None, batch_size: int | None,
                data_parallel: int = 1) -> MemorySettings:
    """The `MemorySettings` of a `tfsmp.config.Config` (``batch_size``: samples per step of
    one pipeline replica, None when not yet known), with the microbatches the runtime runs
    for a known batch (`step_microbatches`)."""
    from tfsmp.schedule.run_plan import drain_count

    return MemorySettings(
        partitions=config.partitions,
        microbatches=step_microbatches(config.microbatches, batch_size),
        pipeline=config.pipeline, virtual_stages=config.chunks,
        active_microbatches=config.active_microbatches, batch_size=max(batch_size or 1, 1),
        data_parallel=data_parallel, optimize=config.optimize, optimizer=optimizer,
        nonfinite=config.nonfinite,
        shard_optimizer_state=bool(getattr(config, "shard_optimizer_state", False)),
        drain=drain_count(config.optimize))


def step_microbatches(microbatches: int, batch_size: int | None) -> int:
    """The microbatches a step runs on a replica of ``batch_size`` rows: at most one per row
    (`tfsmp.runtime.batching.Batching.step_shape`); with the batch not yet known (None), the
    configured count. A model that priced 8 microbatches of half a row where the runtime ran 4
    of one row was 5-13 % low (GPT-2 at p = 2 x d = 2, batch 8)."""
    if batch_size is None:
        return microbatches
    return max(min(microbatches, batch_size), 1)


def late_weights_pay(held_per_step: float, accumulators: float, trainable: float) -> bool:
    """Whether a stage computes its linear layers' weight gradients at the step's end ([Note:
    weights at the step's end] in tfsmp/runtime/stage.py): when their inputs and
    pre-activation gradients for a whole step (``held_per_step`` bytes) are less than the
    accumulators of their variables (``accumulators`` bytes), and those variables are at least
    half of the stage's ``trainable`` bytes: late weights add programs (a backward that defers
    the linear layers, the step's-end update of every variable), whose graphs cost host memory
    by the stage's operations, not its linear bytes. On ResNet50's second stage (one Dense head
    among 53 convolutions: 0.8 of 81 MiB of trainable bytes) they saved 0.8 MiB of accumulators
    and added 93 MiB to the rank's peak at m = 1, 137 MiB at m = 4. The runtime decides with
    the first batch's shapes, the memory model with the graph's; both ask here."""
    return 0 < held_per_step < accumulators and 2 * accumulators >= trainable


def fits(ranks: Sequence[RankMemory], cap: float) -> bool:
    """Whether every rank's predicted peak is within ``cap`` bytes."""
    return all(r.total <= cap for r in ranks)


# -- planning within memory ----------------------------------------------------------------------


def stage_counts(settings: MemorySettings, num_stages: int) -> list[int]:
    """Per stage, the most microbatches it holds at once under the schedule (F to B, or to W
    on a split stage); the fused last stage holds none."""
    run = run_of(settings)
    compute, split = run.compute, run.split_stages
    counts = [0] * num_stages
    for actions in compute.values():
        held: dict[int, set[int | None]] = {}
        for a in actions:
            op, mine = a.op.value, held.setdefault(a.stage, set())
            if (op == "F" and a.stage != num_stages - 1) or (op == "B" and a.stage in split):
                mine.add(a.microbatch)  # until its B, or its W on a split stage
            elif op == ("W" if a.stage in split else "B"):
                mine.discard(a.microbatch)
            if a.stage < num_stages:
                counts[a.stage] = max(counts[a.stage], len(held.get(a.stage, ())))
    return counts


def group_bytes(graph: LayerGraph, groups: Sequence[Sequence[str]], settings: MemorySettings
                ) -> tuple[list[float], list[float]]:
    """Per group, (bytes its stage holds whatever the schedule, bytes per microbatch held):
    weights, optimizer state, accumulators and one microbatch's activations (the working set
    of a backward), and what a stage stashes per microbatch in flight ([Note: memory model])."""
    s = settings
    b = s.batch_size / s.microbatches
    slots = optimizer_slots(s.optimizer)
    if s.shard_optimizer_state and s.data_parallel > 1:
        slots /= s.data_parallel  # an even share: the plan's groups are split per replica later
    direct = s.direct if s.direct is not None else run_of(s).direct_possible(0)
    read: dict[str, set[str]] = {}
    for k in graph.inputs:
        for n in graph.consumers(k):
            read.setdefault(n, set()).add(k)
    # [Note: weights at the step's end] in tfsmp/runtime/stage.py, decided per group here
    # (at one microbatch before a direct update: [Note: late before direct] in stage.py)
    late_ok = (s.direct is not False and s.data_parallel == 1 and s.virtual_stages == 1
               and s.pipeline in ("interleaved", "simple") and s.nonfinite == "raise")
    fixed, held = [], []
    for g in groups:
        nodes = [graph.nodes[n] for n in g]
        trainable = sum(n.trainable_param_bytes for n in nodes)
        state = sum(n.param_bytes + slots * n.trainable_param_bytes for n in nodes)
        linear = [n for n in nodes if n.kind in _LINEAR or n.linear_bytes > 0]
        kept = s.batch_size * sum(n.linear_bytes or 2 * sum(
            graph.tensors[k].bytes_per_sample for k in graph.writes.get(n.name, ()))
            for n in linear)
        avoided = sum(n.trainable_param_bytes for n in linear)
        if late_ok and late_weights_pay(kept, avoided, trainable):
            state += kept + trainable - avoided  # the other variables' accumulators
        elif not direct:
            state += trainable  # an accumulator per variable
        inputs = sum(graph.tensors[k].bytes_per_sample for n in g for k in read.get(n, ()))
        saved = sum(n.activation_bytes for n in nodes)
        # a backward's working set: taped (speed) or compiled ([Note: recomputed bytes])
        working = saved if s.optimize == "speed" else recomputed_bytes(nodes)
        fixed.append(state + b * (working + inputs))
        held.append(b * ((saved + inputs) if s.optimize == "speed" else inputs))
    return fixed, held
