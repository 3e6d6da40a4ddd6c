"""``looped-bfs``: breadth-first looped pipelining (PyTorch's ``ScheduleLoopedBFS``).

Each rank runs ``v`` model chunks (stage ``c·p + r`` on rank ``r``, the interleaved placement).
Every microbatch goes through chunk 0 before any goes through chunk 1, and so on; then the
backwards run chunk ``v-1`` first, each chunk's microbatches in reverse order. That is GPipe
over ``p·v`` stages folded onto ``p`` ranks: with ``active_microbatches = a`` it runs in waves
of ``a`` microbatches. A rank holds ``v·m`` activation sets at its peak (``v·a`` in waves), for
the bubble of the interleaved 1F1B, ``(p-1)/(v·m + p-1)`` when ``m >= p``.

Staircase at p = 2, m = 4, v = 2, a chunk's forward 1/2 and backward 1 time unit
(``tfsmp schedule -p 2 -m 4 -v 2 --pipeline looped-bfs``; ``-`` = a backward's second half)::

    rank 0: 0F0 0F1 0F2 0F3 2F0 2F1 2F2 2F3 .   .   .   2B3 -   2B2 -   2B1 -   2B0 -   0B3 -   0B2 -   0B1 -   0B0 -
    rank 1: .   1F0 1F1 1F2 1F3 3F0 3F1 3F2 3F3 3B3 -   3B2 -   3B1 -   3B0 -   1B3 -   1B2 -   1B1 -   1B0 -   .   .
"""

from __future__ import annotations

from tfsmp.schedule.actions import Action, Op, Schedule
from tfsmp.schedule.registry import Pipeline, register


def _rank_order(rank: int, p: int, m: int, v: int, cap: int) -> list[Action]:
    """One rank's actions: per wave, forwards chunk by chunk, then backwards in reverse."""
    stages = [c * p + rank for c in range(v)]
    out: list[Action] = []
    for start in range(0, m, cap):
        wave = range(start, min(start + cap, m))
        out += [Action(s, Op.FORWARD, i) for s in stages for i in wave]
        out += [Action(s, Op.BACKWARD, i) for s in reversed(stages) for i in reversed(wave)]
    return out


def _generate(p: int, m: int, v: int, cap: int) -> Schedule:
    return {r: _rank_order(r, p, m, v, cap) for r in range(p)}


def _bubble(p: int, m: int, v: int, backward: float, weight: float) -> tuple[float | None, str]:
    value = (p - 1) / (v * m + p - 1)
    return value, (f"formula (p-1)/(v*m+p-1) = {value:.4f}"
                   f"{'' if m >= p else '; exact only when m >= p'}")


PIPELINE = register(Pipeline(
    "looped-bfs", "breadth-first looped: every microbatch through chunk 0, then chunk 1, ...; "
    "backwards in reverse (PyTorch's ScheduleLoopedBFS; set virtual_stages)",
    generate=_generate, bubble=_bubble, loops=True, rank=50,
    golden=(*((p, m, 2) for p in (1, 2, 4) for m in (1, 2, 4, 8)), (4, 8, 1), (2, 8, 3))))
