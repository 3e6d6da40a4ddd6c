"""``zb-h1``: zero bubble at 1F1B's peak memory ([Note: ZB-H1] in generators.py)."""

from tfsmp.schedule.bubble import formula_bubble_zb_h1
from tfsmp.schedule.generators import zb_h1_order
from tfsmp.schedule.registry import Pipeline, register


def _bubble(p: int, m: int, v: int, backward: float, weight: float) -> tuple[float | None, str]:
    value = formula_bubble_zb_h1(p, m, backward, weight)
    return value, (f"formula (p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W)) = {value:.4f}"
                   f"{'' if m >= p else '; exact only when m >= p'}")


PIPELINE = register(Pipeline(
    "zb-h1", "zero-bubble 1F1B, each backward split into input gradients (B) and weight "
    "gradients (W) that fill the bubbles, with 1F1B's peak memory",
    generate=lambda p, m, v, cap: {r: zb_h1_order(r, p, m, cap) for r in range(p)},
    bubble=_bubble, chunks=1, splits_backward=True, rank=30,
    golden=tuple((p, m, 1) for p in (1, 2, 4) for m in (1, 2, 4, 8)),
    golden_links=((4, 4, 1, "skip"),)))
