"""Closed-form bubble (idle) fractions of the pipelines, for balanced stages and free messages."""

from __future__ import annotations

__all__ = ["formula_bubble", "formula_bubble_zb_h1"]


def formula_bubble(num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """``(p-1)/(v·m + p-1)``: the idle share of the step for balanced stages, free messages and
    ``m`` a multiple of ``p`` when ``v > 1`` (see docs/schedules.md)."""
    p, m, v = num_ranks, num_microbatches, virtual_stages
    return (p - 1) / (v * m + p - 1)


def formula_bubble_zb_h1(num_ranks: int, num_microbatches: int, backward_ratio: float = 2.0,
                         weight_ratio: float = 1.0) -> float:
    """ZB-H1's idle share for m >= p (Qi et al. 2023): each rank idles ``(p-1)(F + B - W)``
    beside ``m(F + B + W)`` of work, in forward units (B = backward_ratio - weight_ratio)."""
    p, m = num_ranks, num_microbatches
    idle = (p - 1) * max(0.0, 1.0 + backward_ratio - 2.0 * weight_ratio)
    return idle / (m * (1.0 + backward_ratio) + idle)


def chunked(p: int, m: int, v: int, backward: float, weight: float) -> tuple[float | None, str]:
    """`formula_bubble` as a registry record's ``bubble`` (GPipe, 1F1B, their looped forms)."""
    value = formula_bubble(p, m, v)
    return value, (f"formula (p-1)/(v*m+p-1) = {value:.4f}"
                   f"{'' if v == 1 or m % p == 0 else '; exact only when m % p == 0'}")
