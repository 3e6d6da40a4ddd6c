"""The schedule simulator: makespan, bubble (idle) fraction and peak held activations per rank.

Example::

    result = simulate(generate("interleaved", 4, 8), forward_time=1.0, backward_time=2.0)
    result.bubble_fraction        # 0.2727... = (p-1)/(m+p-1) = 3/11
    result.peak_activations       # [4, 3, 2, 1]

[Note: cost model] Each rank runs its actions in order. A forward or backward of stage s takes
``forward_time[s]`` / ``backward_time[s]``; ``backward_time`` is the whole backward, so in a
stage with W actions ([Note: weight actions]) B takes ``backward_time[s] - weight_time[s]`` and
W ``weight_time[s]``. A send costs its rank nothing (the runtime never blocks in one) and its
message arrives ``comm_time`` later (nothing for a hand-off between two stages of one rank, by
the `Placement`); a receive waits until its message has arrived. REDUCE runs in the
background on the rank's reduction channel, one after another, taking ``reduce_time[s]``
divided among the stage's buckets; STEP waits for them and takes ``step_time``. A rank's bubble
is its idle share of the makespan, ``1 - busy/makespan`` with busy = its F, B and W time; the
overall bubble is ``1 - Σ busy / (p · makespan)``. Peak activations count a stage-microbatch
pair from its F until its B, or its W in a stage with W actions.

``drain`` ([Note: drain split] in tfsmp/runtime/executor.py) names, per stage without W actions,
the microbatches whose backward the runtime splits: their B takes ``backward_time[s] -
weight_time[s]`` and leaves a W of ``weight_time[s]``, which the rank runs as the executor does:
before a receive whose message has not arrived at the rank's clock (one W, then it looks
again), before its stage's REDUCE, before the STEP, or at the end of the rank's actions.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from tfsmp.errors import ScheduleError
from tfsmp.schedule.actions import Action, MessageKey, Op, Schedule, message_key, weight_stages
from tfsmp.schedule.links import Links
from tfsmp.schedule.lowering import lower, num_stages_of, placement_of
from tfsmp.schedule.placement import Placement
from tfsmp.schedule.validate import peak_activations, validate

__all__ = ["SimResult", "TimelineEntry", "simulate"]


class TimelineEntry(NamedTuple):
    """One action as simulated: a receive's span is its wait, a REDUCE's its transfer."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """What `simulate` predicts for one step. Times are in the units of the inputs."""

    num_ranks: int
    makespan: float
    busy: list[float]
    bubble_fraction: float
    rank_bubble_fraction: list[float]
    peak_activations: list[int]
    timeline: list[TimelineEntry]  # by rank, each rank's actions in program order
    placement: Placement | None = None  # the stage -> rank placement simulated

    def to_dict(self) -> dict[str, Any]:
        """The summary (no timeline) as JSON-ready values."""
        return {
            "num_ranks": self.num_ranks,
            "makespan": self.makespan,
            "busy": self.busy,
            "bubble_fraction": self.bubble_fraction,
            "rank_bubble_fraction": self.rank_bubble_fraction,
            "peak_activations": self.peak_activations,
        }


Times = float | Sequence[float]


def simulate(schedule: Schedule, *, forward_time: Times = 1.0, backward_time: Times = 2.0,
             comm_time: Callable[[Action], float] | float = 0.0, reduce_time: Times = 0.0,
             step_time: float = 0.0, num_ranks: int | None = None,
             links: Links | None = None, weight_time: Times = 0.0,
             placement: Placement | None = None,
             drain: Mapping[int, Collection[int]] | None = None) -> SimResult:
    """Simulates one step of a schedule under [Note: cost model].

    Args:
        schedule: compute-only (then lowered along ``links``, without REDUCE) or lowered.
        forward_time: seconds of one microbatch's forward, one value or one per stage.
        backward_time: the same for the whole backward (B, plus W where the stage has Ws).
        comm_time: seconds from a cross-rank send to its arrival: a number, or a function of
            the SEND action.
        reduce_time: seconds of one stage's gradient reduction (one value or per stage).
        step_time: seconds of the optimizer step.
        num_ranks: pipeline ranks; defaults to ``len(schedule)``.
        links: stage graph (`StagePlan` or `StageLinks`); default the chain.
        weight_time: seconds of one W (weight gradients), one value or one per stage; part of
            ``backward_time``, and used only by stages with W actions.
        placement: which rank runs each stage; default stage ``s`` on rank ``s % p``.
        drain: per stage without W actions, the microbatches whose backward is split at the
            step's end and whose W runs while the rank would wait (`RunPlan.drain_microbatches`;
            [Note: cost model]); their W time is ``weight_time``.

    Returns:
        Makespan, busy time and bubble fraction per rank and overall, peak held activation
        sets per rank, and the timeline.

    Raises:
        ScheduleError: the schedule is invalid (see `tfsmp.schedule.validate`), a time list
            has the wrong length, or a W takes longer than its stage's whole backward.
    """
    p = len(schedule) if num_ranks is None else num_ranks
    lowered = schedule
    if all(a.is_compute for acts in schedule.values() for a in acts):
        lowered = lower(schedule, links, p, data_parallel=False, placement=placement)
    validate(lowered, links=links, placement=placement)
    stages = num_stages_of(lowered)
    where = placement_of(lowered, p, placement)
    split = weight_stages(lowered)
    drained = {s: frozenset(mbs) for s, mbs in (drain or {}).items() if mbs}
    if drained.keys() & split:
        raise ScheduleError(
            f"drain names stages without W actions (a split stage's W's are the schedule's). "
            f"Received: drain for stage(s) {sorted(drained.keys() & split)}, which have W "
            f"actions. Leave them out of drain.")
    whole = _per_stage("backward_time", backward_time, stages)
    weights = _per_stage("weight_time", weight_time, stages)
    backward, weight = _split_backward(whole, weights, split | set(drained))
    costs = _Costs(
        forward=_per_stage("forward_time", forward_time, stages),
        backward=backward, weight=weight,
        reduce=_per_stage("reduce_time", reduce_time, stages),
        comm=comm_time, step=step_time, placement=where,
        buckets={a.stage: 0 for acts in lowered.values() for a in acts if a.op is Op.REDUCE},
        whole=whole, drain=drained)
    for acts in lowered.values():
        for a in acts:
            if a.op is Op.REDUCE:
                costs.buckets[a.stage] += 1
    timeline = _run(lowered, costs)
    return _summarize(lowered, timeline, p, where)


@dataclass
class _Costs:
    forward: list[float]
    backward: list[float]  # of B alone: the whole backward minus W in stages with Ws
    weight: list[float]
    reduce: list[float]
    comm: Callable[[Action], float] | float
    step: float
    placement: Placement
    buckets: dict[int, int]
    whole: list[float]  # the whole backward (B + W) per stage
    drain: dict[int, frozenset[int]]  # [Note: cost model]: split backwards of unsplit stages

    def message(self, a: Action) -> float:
        if a.peer is None or self.placement.rank(a.peer) == self.placement.rank(a.stage):
            return 0.0
        return float(self.comm(a)) if callable(self.comm) else float(self.comm)


def _split_backward(backward: list[float], weight: list[float],
                    split: set[int]) -> tuple[list[float], list[float]]:
    """(B time, W time) per stage: the whole backward is B + W where a stage has Ws."""
    for s in sorted(split):
        if not 0.0 <= weight[s] <= backward[s]:
            raise ScheduleError(
                f"weight_time is the part of backward_time that W computes: 0 <= weight_time "
                f"<= backward_time. Received: stage {s}: weight_time={weight[s]}, "
                f"backward_time={backward[s]}")
    return ([b - w if s in split else b for s, (b, w) in enumerate(zip(backward, weight))],
            [w if s in split else 0.0 for s, w in enumerate(weight)])


def _per_stage(name: str, value: Times, stages: int) -> list[float]:
    if isinstance(value, int | float):
        return [float(value)] * stages
    values = [float(x) for x in value]
    if len(values) != stages:
        raise ScheduleError(
            f"{name} needs one value per stage. Received: {len(values)} values for {stages} "
            f"stages. Pass a number for balanced stages.")
    return values


def _run(schedule: Schedule, costs: _Costs) -> list[TimelineEntry]:
    """Event-driven run of every rank in program order; validated, so it cannot stall (a
    rank holding drained W's runs them while no rank can go on: [Note: cost model])."""
    pc = dict.fromkeys(schedule, 0)
    clock = dict.fromkeys(schedule, 0.0)
    channel = dict.fromkeys(schedule, 0.0)  # when the rank's reduction channel is free
    deferred: dict[int, list[Action]] = {r: [] for r in schedule}  # drained W's to run
    arrival: dict[MessageKey, float] = {}
    timeline: list[TimelineEntry] = []

    def weight(rank: int, w: Action) -> None:
        deferred[rank].remove(w)
        start = clock[rank]
        clock[rank] = start + costs.weight[w.stage]
        timeline.append(TimelineEntry(rank, w, start, clock[rank]))

    while any(pc[r] < len(schedule[r]) or deferred[r] for r in schedule):
        moved = False
        waiting: list[int] = []  # ranks at a receive not yet sent, holding W's
        for rank, actions in schedule.items():
            while pc[rank] < len(actions):
                a = actions[pc[rank]]
                key = message_key(a)
                if a.op in (Op.RECV_F, Op.RECV_B):
                    if key not in arrival:
                        if deferred[rank]:
                            waiting.append(rank)
                        break
                    while deferred[rank] and arrival[key] > clock[rank]:
                        weight(rank, deferred[rank][0])  # not there yet: one W, then look again
                elif a.op is Op.REDUCE or a.op is Op.STEP:
                    for w in [w for w in deferred[rank] if a.op is Op.STEP or w.stage == a.stage]:
                        weight(rank, w)
                start, end = _time(a, clock[rank], channel[rank], arrival, costs)
                if a.op is Op.REDUCE:
                    channel[rank] = end
                else:
                    clock[rank] = end
                if a.op in (Op.SEND_F, Op.SEND_B):
                    arrival[key] = start + costs.message(a)
                timeline.append(TimelineEntry(rank, a, start, end))
                if a.op is Op.BACKWARD and a.microbatch in costs.drain.get(a.stage, ()):
                    deferred[rank].append(Action(a.stage, Op.WEIGHT, a.microbatch))
                pc[rank] += 1
                moved = True
            if pc[rank] == len(actions) and deferred[rank]:  # the step's end: the rest
                for w in list(deferred[rank]):
                    weight(rank, w)
                moved = True
        if not moved:  # every rank waits for a message no rank can send yet: W's run
            if not waiting:
                raise ScheduleError("the simulated schedule stalled: every rank waits for a "
                                    "message no rank sends (a validated schedule cannot)")
            for rank in waiting:
                weight(rank, deferred[rank][0])
    return timeline


def _time(a: Action, clock: float, channel: float,
          arrival: dict[MessageKey, float], costs: _Costs) -> tuple[float, float]:
    """(start, end) of one action given the rank's clock and reduction channel."""
    if a.op is Op.FORWARD:
        return clock, clock + costs.forward[a.stage]
    if a.op is Op.BACKWARD:
        drained = costs.drain.get(a.stage)
        whole = drained is not None and a.microbatch not in drained  # an unsplit backward
        return clock, clock + (costs.whole[a.stage] if whole else costs.backward[a.stage])
    if a.op is Op.WEIGHT:
        return clock, clock + costs.weight[a.stage]
    if a.op in (Op.RECV_F, Op.RECV_B):
        return clock, max(clock, arrival[message_key(a)])
    if a.op is Op.REDUCE:
        start = max(clock, channel)
        return start, start + costs.reduce[a.stage] / max(1, costs.buckets.get(a.stage, 1))
    if a.op is Op.STEP:
        start = max(clock, channel)
        return start, start + costs.step
    return clock, clock


def _summarize(schedule: Schedule, timeline: list[TimelineEntry], p: int,
               placement: Placement) -> SimResult:
    makespan = max((e.end for e in timeline), default=0.0)
    busy = [0.0] * p
    for e in timeline:
        if e.action.is_compute:
            busy[e.rank] += e.end - e.start
    if makespan > 0:
        rank_bubble = [1.0 - b / makespan for b in busy]
        bubble = 1.0 - sum(busy) / (p * makespan)
    else:
        rank_bubble, bubble = [0.0] * p, 0.0
    return SimResult(num_ranks=p, makespan=makespan, busy=busy, bubble_fraction=bubble,
                     rank_bubble_fraction=rank_bubble, peak_activations=peak_activations(schedule),
                     timeline=sorted(timeline, key=lambda e: e.rank),  # stable: program order
                     placement=placement)
