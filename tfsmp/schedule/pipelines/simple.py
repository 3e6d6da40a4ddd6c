"""``simple``: GPipe's fill-drain, every forward before any backward (in waves of ``a``)."""

from tfsmp.schedule.bubble import chunked
from tfsmp.schedule.generators import simple_order
from tfsmp.schedule.registry import Pipeline, register

_GRID = tuple((p, m, 1) for p in (1, 2, 4) for m in (1, 2, 4, 8))

PIPELINE = register(Pipeline(
    "simple", "all forward passes, then all backward passes (GPipe)",
    generate=lambda p, m, v, cap: {r: simple_order(r, p, m, v, cap) for r in range(p)},
    bubble=chunked, chunks=None, rank=10, golden=(*_GRID, (4, 8, 2)),
    golden_links=((4, 4, 1, "skip"),)))
