"""``zb-v``: ZB-V, zero bubble with 2 model chunks per rank in a V ([Note: placement])."""

from tfsmp.schedule.actions import Schedule
from tfsmp.schedule.placement import Placement
from tfsmp.schedule.registry import Pipeline, register
from tfsmp.schedule.zero_bubble import zero_bubble


def _generate(p: int, m: int, v: int, cap: int) -> Schedule:
    """ZB-V holds at most ``2p`` half-size chunks on every rank until their W (1F1B's rank-0
    bytes)."""
    return zero_bubble(Placement(p, 2 * p, "v"), m, [2 * p] * p,
                       microbatch_cap=cap if cap < m else None)


def _bubble(p: int, m: int, v: int, backward: float, weight: float) -> tuple[float | None, str]:
    return None, "no closed form; shrinks toward 0 as m grows"


PIPELINE = register(Pipeline(
    "zb-v", "zero-bubble with 2 model chunks per rank in a V (the first and the last chunk on "
    "rank 0)",
    generate=_generate, bubble=_bubble, placement="v", chunks=2, splits_backward=True, rank=40,
    golden=tuple((p, m, 2) for p in (1, 2, 4) for m in (1, 2, 4, 8))))
