"""``interleaved``: 1F1B (PipeDream-Flush), Megatron's interleaved 1F1B with ``v > 1`` chunks."""

from tfsmp.schedule.bubble import chunked
from tfsmp.schedule.generators import interleaved_order
from tfsmp.schedule.registry import Pipeline, register

_GRID = tuple((p, m, 1) for p in (1, 2, 4) for m in (1, 2, 4, 8))
_CHUNKED = tuple((p, m, 2) for p in (2, 4) for m in (1, 2, 4, 8))

PIPELINE = register(Pipeline(
    "interleaved", "a backward pass runs as soon as it can (1F1B; Megatron's interleaving with "
    "virtual_stages > 1)",
    generate=lambda p, m, v, cap: {r: interleaved_order(r, p, m, v, cap) for r in range(p)},
    bubble=chunked, chunks=None, loops=True, rank=20, golden=(*_GRID, *_CHUNKED, (1, 4, 2), (4, 6, 2)),
    golden_links=((4, 4, 1, "skip"),)))
