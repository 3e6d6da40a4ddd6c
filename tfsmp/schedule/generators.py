"""Schedule generators: the compute actions of SMP's pipelines and of the zero-bubble ones.

Example::

    generate("interleaved", num_ranks=4, num_microbatches=8)         # 1F1B (PipeDream-Flush)
    generate("interleaved", 4, 8, virtual_stages=2)                  # Megatron interleaved 1F1B
    generate("simple", 4, 8, active_microbatches=4)                  # GPipe in waves of 4
    generate("zb-h1", 4, 8)                                          # zero bubble, 1F1B memory
    generate("zb-v", 4, 8, virtual_stages=2)                         # ZB-V, V placement

``zb-h1`` and ``zb-v`` split each backward into B and W ([Note: weight actions]); ``zb-v``
places its stages in a V ([Note: placement]), the others stage ``s`` on rank ``s % p``.

Index legend: ``p`` ranks, ``m`` microbatches, ``v`` virtual stages (model chunks) per rank,
``r`` a rank, ``c`` a chunk; chunk ``c`` of rank ``r`` is stage ``c·p + r``.

[Note: microbatch groups] With ``v > 1`` a rank runs microbatches in groups of ``g = min(p, m, a)``
(``a`` = active_microbatches): the forwards of a group go through chunk 0, then chunk 1, ...; the
backwards through chunk v-1, ..., chunk 0 (Megatron's order, with its group size p). Megatron
rejects ``m % p != 0``. Here a short last group is padded with ghost microbatches up to ``g``,
the order is built for the padded count and the ghosts' actions are then dropped. Dropping
actions keeps every wait of the padded schedule, so it stays deadlock-free (a short group
ordered as is deadlocks, e.g. p = 4, m = 5, v = 3); its bubble lies between the v-chunk formula
and the one of v = 1.

[Note: warm-up] ``interleaved`` runs ``w`` forwards, then alternates one forward and one backward,
then drains the backwards. ``w = p - r - 1`` for v = 1 (PipeDream-Flush); for v > 1 Megatron's
``w = 2·(p - r - 1) + (v - 1)·g``: the first backward on rank r is chunk v-1's, which needs a
whole group through every earlier chunk first. With free messages ``(p - r - 1) + (v - 1)·g``
would already reach the formula bubble and hold fewer activations; the extra ``p - r - 1``
forwards hide message latency (simulated over p ∈ {2, 4, 8}, v ∈ {2, 4}, m ∈ {p, 2p, 4p} at
message time 0.5 of a forward: total makespan 948 against 1208). A forward that would exceed
``a`` microbatches in flight waits for a backward instead.

Staircase of ``interleaved``, p = 4, m = 6, forward and backward one time unit each
(`render_staircase`; ``.`` = idle)::

    rank 0: F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 .  B3 .  B4 .  B5
    rank 1: .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 .  B4 .  B5 .
    rank 2: .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 .  B5 .  .
    rank 3: .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 .  .  .

[Note: ZB-H1] (Qi et al. 2023, §2.1; PyTorch's ``ScheduleInterleavedZeroBubble`` with one
chunk): 1F1B's order of F and B, with rank r's W of each microbatch delayed by ``r`` B's
(``d_r = r``); the remaining Ws close the step. Rank r then holds 1F1B's ``p - r`` microbatches
until their B and ``p`` until their W — the peak of 1F1B (its rank 0) on every rank, the
paper's memory bound. At F = B = W each rank idles ``p - 1`` units against 1F1B's ``3(p - 1)``:
the makespan is ``3m + p - 1`` for m >= p, which is optimal under that bound (rank 0 holds p
microbatches before its first B can arrive, at ``2p - 1``). Capping every rank at its own
1F1B count ``p - r`` until W would force the last rank into F B W F B W ... and cost
``p - 1`` more units (makespan ``3m + 2p - 2``, bubble 0.73 of 1F1B's at p = 4, m = 8, and
a speed-up over 1F1B of 27/26 at p = 2, m = 8). With ``active_microbatches = a`` the F/B
order is 1F1B's under the cap and ``d_r = min(r, a - min(p - r, a))``, so a rank never holds
more than ``a`` microbatches until their W.

Staircase of ``zb-h1``, p = 4, m = 6, F = B = W = 1 (`render_staircase`)::

    rank 0: F0 F1 F2 F3 .  .  .  B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5
    rank 1: .  F0 F1 F2 .  .  B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 B4 W3 B5 W4 W5
    rank 2: .  .  F0 F1 .  B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 B5 W3 W4 W5
    rank 3: .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5

The zb-v order comes from `tfsmp.schedule.zero_bubble` ([Note: zero-bubble list scheduling]).
"""

from __future__ import annotations

from collections.abc import Sequence

from tfsmp.errors import ScheduleError
from tfsmp.schedule.actions import Action, Op, Schedule
from tfsmp.schedule.placement import check_virtual_stages
from tfsmp.schedule.registry import Pipeline, get, names

__all__ = ["fuse_last_stage", "generate", "interleaved_order", "simple_order",
           "zb_h1_order"]


def generate(pipeline: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1,
             active_microbatches: int | None = None) -> Schedule:
    """The compute actions of every rank for one optimizer step.

    Args:
        pipeline: ``"simple"`` (every forward before any backward, GPipe), ``"interleaved"``
            (backward first whenever possible, 1F1B; Megatron's interleaving when v > 1),
            ``"zb-h1"`` (zero bubble at 1F1B's peak memory, v = 1) or ``"zb-v"`` (ZB-V,
            v = 2 chunks per rank in a V).
        num_ranks: pipeline ranks ``p``.
        num_microbatches: microbatches ``m`` per step.
        virtual_stages: model chunks ``v`` per rank; the model has ``p·v`` stages.
        active_microbatches: at most this many microbatches in flight (forward started, last
            backward not done; last W for the zero-bubble pipelines) on any rank. ``simple``
            then runs in waves of this size.

    Returns:
        ``{rank: [Action, ...]}`` holding only compute actions: F and B, and W for ``zb-*``.

    Raises:
        ScheduleError: an argument is out of range.
    """
    record = _check_args(pipeline, num_ranks, num_microbatches, virtual_stages,
                         active_microbatches)
    cap = num_microbatches if active_microbatches is None else min(active_microbatches,
                                                                    num_microbatches)
    return record.generate(num_ranks, num_microbatches, virtual_stages, cap)


def zb_h1_order(rank: int, p: int, m: int, cap: int) -> list[Action]:
    """1F1B's F/B order with each W delayed by ``d_r`` B's ([Note: ZB-H1])."""
    order = interleaved_order(rank, p, m, 1, cap)
    delay = min(rank, cap - min(p - rank, cap))
    out: list[Action] = []
    pending: list[Action] = []
    for a in order:
        out.append(a)
        if a.op is Op.BACKWARD:
            pending.append(a)
        while len(pending) > delay:
            b = pending.pop(0)
            out.append(Action(b.stage, Op.WEIGHT, b.microbatch))
    return out + [Action(b.stage, Op.WEIGHT, b.microbatch) for b in pending]


def fuse_last_stage(schedule: Schedule) -> Schedule:
    """The order the runtime executes: each backward of the last stage right after its forward.

    [Note: fused last stage] The runtime computes the last stage's forward, loss and backward in
    one compiled call at its forward action; its backward action only hands the gradients on.
    A schedule that runs the last stage's backwards after all its forwards (``simple``, textbook
    GPipe) would hold those gradients back until the m-th forward, leaving the stage before it
    idle: measured bubble 0.41 at p = 2, m = 8, where the formula gives 1/9. Moving each such
    backward to right after its own forward cannot add a wait (it depends on nothing else and
    its send does not block), so the result stays deadlock-free; ``interleaved`` with v = 1
    already has this order and is returned unchanged, and so are ``zb-h1`` and ``zb-v``, which
    are generated in it (their W actions stay where they are). The schedules of `generate` keep
    the textbook orders (the simulator's formulas, peak activations m for ``simple``); the
    runtime and the timeline comparison use this one.

    Args:
        schedule: compute actions per rank (`generate`'s result).

    Returns:
        A new schedule with the same actions per rank.
    """
    last = max((a.stage for actions in schedule.values() for a in actions), default=0)
    out: Schedule = {}
    for rank, actions in schedule.items():
        late = {a.microbatch for a in actions if a.stage == last and a.op == Op.BACKWARD}
        order: list[Action] = []
        for a in actions:
            if a.stage == last and a.op == Op.BACKWARD and a.microbatch in late:
                continue
            order.append(a)
            if a.stage == last and a.op == Op.FORWARD and a.microbatch in late:
                order.append(Action(last, Op.BACKWARD, a.microbatch))
        out[rank] = order
    return out


def _check_args(pipeline: str, p: int, m: int, v: int, a: int | None) -> Pipeline:
    record = get(pipeline)
    for name, value in (("num_ranks", p), ("num_microbatches", m), ("virtual_stages", v)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer. Received: {name}={value!r}")
    check_virtual_stages(pipeline, v)
    if a is not None and (not isinstance(a, int) or a < 1):
        raise ScheduleError(
            f"active_microbatches must be a positive integer or None. "
            f"Received: active_microbatches={a!r}")
    return record


def __getattr__(name: str) -> tuple[str, ...]:
    """``PIPELINES``: the registered pipelines' names ([Note: pipeline registry])."""
    if name == "PIPELINES":
        return names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _forward_order(rank: int, p: int, v: int, mbs: Sequence[int], group: int) -> list[Action]:
    """Forwards of one rank: per group of microbatches, chunk 0 for all of them, then chunk 1 ..."""
    return [Action(c * p + rank, Op.FORWARD, i)
            for start in range(0, len(mbs), group)
            for c in range(v)
            for i in mbs[start:start + group]]


def _backward_order(rank: int, p: int, v: int, mbs: Sequence[int], group: int) -> list[Action]:
    """Backwards of one rank: per group, chunk v-1 for all of them, then chunk v-2 ..."""
    return [Action(c * p + rank, Op.BACKWARD, i)
            for start in range(0, len(mbs), group)
            for c in reversed(range(v))
            for i in mbs[start:start + group]]


def simple_order(rank: int, p: int, m: int, v: int, cap: int) -> list[Action]:
    """GPipe fill-drain, in waves of ``cap`` microbatches."""
    out: list[Action] = []
    for start in range(0, m, cap):
        wave = range(start, min(start + cap, m))
        group = min(p, len(wave))
        out += _forward_order(rank, p, v, wave, group)
        out += _backward_order(rank, p, v, wave, group)
    return out


def interleaved_order(rank: int, p: int, m: int, v: int, cap: int) -> list[Action]:
    """1F1B (v = 1) or Megatron's interleaved 1F1B (v > 1); see [Note: warm-up]."""
    if v == 1:
        forwards = [Action(rank, Op.FORWARD, i) for i in range(m)]
        backwards = [Action(rank, Op.BACKWARD, i) for i in range(m)]
        return _one_forward_one_backward(forwards, backwards, p - rank - 1, cap)
    group = min(p, m, cap)
    padded = -(-m // group) * group  # see [Note: microbatch groups]
    forwards = _forward_order(rank, p, v, range(padded), group)
    backwards = _backward_order(rank, p, v, range(padded), group)
    warmup = 2 * (p - rank - 1) + (v - 1) * group
    limit = padded if cap >= m else cap  # ghosts must not use up a cap the user did not set
    order = _one_forward_one_backward(forwards, backwards, warmup, limit)
    return [a for a in order if a.microbatch is not None and a.microbatch < m]


def _one_forward_one_backward(forwards: list[Action], backwards: list[Action], warmup: int,
                              cap: int) -> list[Action]:
    """Warm-up forwards, then forward/backward pairs, then the remaining backwards.

    A forward that would put more than ``cap`` microbatches in flight waits (a backward goes
    first); a backward whose own forward has not run yet waits (a forward goes first).
    """
    out: list[Action] = []
    done: set[tuple[int, int | None]] = set()
    held: dict[int | None, int] = {}  # microbatch -> chunks whose activations are held
    fi = bi = 0

    def can_forward() -> bool:
        return fi < len(forwards) and (forwards[fi].microbatch in held or len(held) < cap)

    def forward() -> None:
        nonlocal fi
        a = forwards[fi]
        out.append(a)
        done.add((a.stage, a.microbatch))
        held[a.microbatch] = held.get(a.microbatch, 0) + 1
        fi += 1

    def backward() -> None:
        nonlocal bi
        a = backwards[bi]
        out.append(a)
        held[a.microbatch] -= 1
        if not held[a.microbatch]:
            del held[a.microbatch]
        bi += 1

    while fi < warmup and can_forward():
        forward()
    while fi < len(forwards) or bi < len(backwards):
        progressed = can_forward()
        if progressed:
            forward()
        if bi < len(backwards) and (backwards[bi].stage, backwards[bi].microbatch) in done:
            backward()
            progressed = True
        if not progressed:  # unreachable while group <= cap; kept so a bug cannot spin
            raise ScheduleError(
                f"Could not order forwards and backwards under active_microbatches={cap}. "
                f"Received: next forward {forwards[fi] if fi < len(forwards) else None}, "
                f"next backward {backwards[bi]}")
    return out
