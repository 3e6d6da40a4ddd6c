"""Lowering: adds sends, receives, data-parallel reductions and the optimizer step to compute actions.

Example::

    compute = generate("interleaved", num_ranks=2, num_microbatches=2)
    lower(compute, None, 2)[0]
    # [0F0, 0SEND_F0>1, 0F1, 0SEND_F1>1, 0RECV_B0<1, 0B0, 0RECV_B1<1, 0B1, 0REDUCE, 0STEP]

[Note: lowering order] Around each compute action of stage s (producers q, consumers c, both
ascending, from the plan's boundaries, skip connections included)::

    sRECV_F{i}<q ...  sF{i}  sSEND_F{i}>c ...
    sRECV_B{i}<c ...  sB{i}  sSEND_B{i}>q ...
    sW{i}                                        (no message: [Note: weight actions])

The runtime pre-posts every receive of a step and never blocks in a send, so a rank can only wait
at a receive, for a send that its peer makes right after the compute action that produces the
data. A lowered schedule therefore deadlocks exactly when its compute order does, and the
validator checks that for every schedule (`tfsmp.schedule.validate`). Pairs of stages on the same
rank (virtual stages, and ZB-V's pairs, wherever the `Placement` puts them) keep their send and
receive: the runtime hands the tensors over locally.

[Note: reduce buckets] A stage's data-parallel gradient reduction comes right after its last
backward and that backward's sends (so the gradient a peer waits for leaves first); in a stage
with W actions, whose B leaves the weight gradients to W, right after its last W instead. With
``reduce_buckets = K > 1`` it is K actions ``sREDUCE0 .. sREDUCE{K-1}``: bucket k holds the k-th
of K near-equal slices of the stage's trainable variables, in the order backward finalizes their
gradients (last layers first), so a runtime may start bucket k's allreduce as soon as the last
backward (or W) has produced it. The runtime issues reductions without blocking; with v > 1 they overlap
the backwards of the rank's earlier chunks.

[Note: optimizer step] ``STEP`` is per rank, not per stage: one action at the end of each rank's
list, with ``stage`` = the rank's first stage (= the rank, in both placements), applying the
optimizer once to the variables of all the rank's stages after waiting for their reductions.
"""

from __future__ import annotations

from dataclasses import dataclass

from tfsmp.errors import ScheduleError
from tfsmp.schedule.actions import Action, Op, Schedule
from tfsmp.schedule.links import Links, as_links
from tfsmp.schedule.placement import Placement

__all__ = ["Lowered", "forward_only", "lower", "num_stages_of", "placement_of"]


@dataclass(frozen=True)
class Lowered:
    """Every rank's lowered actions and the placement they were lowered for: what runs a
    schedule needs both, so they travel together and no runner assumes a placement."""

    actions: Schedule
    placement: Placement


def lower(compute: Schedule, plan: Links | None = None, num_ranks: int | None = None, *,
          data_parallel: bool = True, reduce_buckets: int = 1,
          placement: Placement | None = None) -> Schedule:
    """Adds communication, reductions and the step to a compute-only schedule.

    Args:
        compute: ``{rank: [F/B actions]}``, e.g. from `tfsmp.schedule.generate`.
        plan: a `StagePlan` or `StageLinks` saying which stages talk; None means the chain
            ``s -> s+1``.
        num_ranks: pipeline ranks; defaults to ``len(compute)``.
        data_parallel: emit ``REDUCE`` actions (set False without data-parallel replicas).
        reduce_buckets: REDUCE actions per stage; see [Note: reduce buckets].
        placement: which rank runs each stage; default stage ``s`` on rank ``s % p``. Pass
            ``Placement.for_pipeline("zb-v", p, 2)`` for a ZB-V schedule.

    Returns:
        The lowered schedule, per [Note: lowering order].

    Raises:
        ScheduleError: ``compute`` holds non-compute actions, stages on the wrong rank, or does
            not match the plan's number of stages.
    """
    p = len(compute) if num_ranks is None else num_ranks
    if sorted(compute) != list(range(p)):
        raise ScheduleError(
            f"A schedule for {p} ranks has ranks 0..{p - 1}. Received: ranks {sorted(compute)}")
    if reduce_buckets < 1:
        raise ScheduleError(
            f"reduce_buckets must be a positive integer. Received: reduce_buckets={reduce_buckets}")
    where = placement_of(compute, p, placement)
    _check_compute_only(compute, where)
    links = as_links(plan, num_stages_of(compute))
    peers = {s: (links.peers_backward(s), links.peers_forward(s)) for s in range(links.num_stages)}
    return {rank: _lower_rank(rank, actions, peers, data_parallel, reduce_buckets)
            for rank, actions in compute.items()}


def forward_only(plan: Links, placement: Placement, rank: int, num_microbatches: int
                 ) -> list[Action]:
    """Inference actions of one rank: per microbatch, its stages in order, each with its
    receives before and sends after ([Note: lowering order]). Stages are acyclic, so it cannot
    deadlock."""
    out: list[Action] = []
    stages = placement.stages(rank)
    for i in range(num_microbatches):
        for s in stages:
            out.extend(_with_comm(Action(s, Op.FORWARD, i), plan.peers_backward(s),
                                  plan.peers_forward(s)))
    return out


def num_stages_of(schedule: Schedule) -> int:
    """One more than the highest stage of any compute action (0 for an empty schedule)."""
    return 1 + max((a.stage for acts in schedule.values() for a in acts if a.is_compute),
                   default=-1)


def placement_of(schedule: Schedule, num_ranks: int, placement: Placement | None) -> Placement:
    """``placement``, checked against the schedule's size, or the interleaved default over it.

    Raises:
        ScheduleError: ``placement`` is for another number of ranks or stages.
    """
    stages = max(1, num_stages_of(schedule))
    if placement is None:
        return Placement(max(1, num_ranks), stages)
    if placement.num_ranks != num_ranks or placement.num_stages != stages:
        raise ScheduleError(
            f"The placement must be for the schedule's ranks and stages. Received: placement "
            f"num_ranks={placement.num_ranks}, num_stages={placement.num_stages}; schedule "
            f"num_ranks={num_ranks}, num_stages={stages}.")
    return placement


def _check_compute_only(compute: Schedule, placement: Placement) -> None:
    for rank, actions in compute.items():
        for step, a in enumerate(actions):
            if not a.is_compute:
                raise ScheduleError(
                    f"lower() takes compute actions (F/B/W) only. Received: {a} at rank {rank}, "
                    f"step {step}. Lower the generator's output, not a lowered schedule.")
            if placement.rank(a.stage) != rank:
                raise ScheduleError(
                    f"{placement.rule()}. Received: {a} at rank {rank}, step {step}. Pass the "
                    f"schedule's placement (a zb-v schedule needs "
                    f"placement=Placement.for_pipeline('zb-v', p, 2)).")


def _lower_rank(rank: int, actions: list[Action], peers: dict[int, tuple[list[int], list[int]]],
                data_parallel: bool, buckets: int) -> list[Action]:
    # [Note: reduce buckets]: after the last W of a stage that has Ws, else its last B; W
    # follows B, so the later of the two positions is the right one either way.
    last_gradient = {a.stage: step for step, a in enumerate(actions)
                     if a.op in (Op.BACKWARD, Op.WEIGHT)}
    out: list[Action] = []
    for step, a in enumerate(actions):
        out += _with_comm(a, *peers[a.stage])
        if data_parallel and last_gradient.get(a.stage) == step:
            out += ([Action(a.stage, Op.REDUCE)] if buckets == 1
                    else [Action(a.stage, Op.REDUCE, k) for k in range(buckets)])
    out.append(Action(rank, Op.STEP))
    return out


def _with_comm(a: Action, producers: list[int], consumers: list[int]) -> list[Action]:
    """``a`` with its receives before and its sends after ([Note: lowering order])."""
    s, i = a.stage, a.microbatch
    if a.op is Op.WEIGHT:
        return [a]
    if a.op is Op.FORWARD:
        return ([Action(s, Op.RECV_F, i, q) for q in producers] + [a]
                + [Action(s, Op.SEND_F, i, c) for c in consumers])
    return ([Action(s, Op.RECV_B, i, c) for c in consumers] + [a]
            + [Action(s, Op.SEND_B, i, q) for q in producers])
