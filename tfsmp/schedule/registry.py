"""The pipeline registry: one record per schedule, read by every layer that names schedules.

Example::

    from tfsmp.schedule.registry import get, names
    names()                                  # ('simple', 'interleaved', 'zb-h1', 'zb-v', ...)
    zb = get("zb-v")
    zb.placement, zb.chunks, zb.splits_backward      # 'v', 2, True
    zb.generate(4, 8, 2, 8)                          # {rank: [Action, ...]}: F, B and W
    get("interleaved").bubble(4, 8, 1, 2.0, 1.0)     # (3/11, 'formula (p-1)/(v*m+p-1) = ...')

[Note: pipeline registry] A schedule is one module in `tfsmp/schedule/pipelines/` that calls
`register(Pipeline(...))`: its name, its stage placement (`tfsmp.schedule.placement`), the chunk
count it needs, its generator (compute actions only), its closed-form bubble and the golden grid
its tests compare against. The config's choices and help (`tfsmp.config`), the CLI
(`tfsmp schedule`, `tfsmp plan`), the generators, placement, simulator, memory model and the
runtime (`tfsmp.schedule.run_plan`) all read these records, so a new schedule is that one file
plus its golden files (``python -m tfsmp.schedule.golden tests/golden/schedules``). Modules of
the package are found by listing it: nothing else names them.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

from tfsmp.errors import ScheduleError
from tfsmp.schedule.actions import Schedule

__all__ = ["Bubble", "Generator", "Pipeline", "get", "names", "pipelines", "register"]

# (num_ranks p, num_microbatches m, virtual_stages v, active_microbatches cap <= m) -> actions
Generator = Callable[[int, int, int, int], Schedule]
# (p, m, v, backward time, W time; in forward units per rank) -> (bubble or None, how to print it)
Bubble = Callable[[int, int, int, float, float], tuple[float | None, str]]


@dataclass(frozen=True)
class Pipeline:
    """One schedule ([Note: pipeline registry]).

    Example::

        register(Pipeline("looped-bfs", "every microbatch through chunk 0, then chunk 1, ...",
                          generate=_looped_bfs, bubble=_bubble, rank=50,
                          golden=((2, 4, 2), (4, 8, 2))))
    """

    name: str
    summary: str  # one sentence: config help and CLI help
    generate: Generator
    bubble: Bubble
    placement: str = "interleaved"  # a `Placement` kind: "interleaved" (s % p) or "v"
    chunks: int | None = None  # the virtual_stages it needs; None: any (1 by default)
    splits_backward: bool = False  # emits W actions ([Note: weight actions])
    loops: bool = False  # a config may ask for virtual_stages > 1 (model chunks per rank)
    rank: int = 100  # where it is listed (choices, messages); ties by name
    golden: tuple[tuple[int, int, int], ...] = ()  # (p, m, v) of its golden files
    golden_links: tuple[tuple[int, int, int, str], ...] = ()  # (p, m, v, named links)

    def chunks_for(self, virtual_stages: int) -> int:
        """The chunks per rank it runs when the config asks for ``virtual_stages``."""
        return self.chunks if self.chunks is not None else virtual_stages


_REGISTRY: dict[str, Pipeline] = {}
_loaded = False


def register(pipeline: Pipeline) -> Pipeline:
    """Adds ``pipeline``; called once by its module in `tfsmp.schedule.pipelines`.

    Raises:
        ScheduleError: another record already has its name.
    """
    if pipeline.name in _REGISTRY and _REGISTRY[pipeline.name] is not pipeline:
        raise ScheduleError(
            f"Every pipeline needs a name of its own. Received: a second pipeline named "
            f"{pipeline.name!r}. Rename one of the modules' records.")
    _REGISTRY[pipeline.name] = pipeline
    return pipeline


def _load() -> None:
    """Imports every module of `tfsmp.schedule.pipelines` once (each registers itself)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    package = importlib.import_module("tfsmp.schedule.pipelines")
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        importlib.import_module(f"{package.__name__}.{info.name}")


def pipelines() -> list[Pipeline]:
    """Every registered pipeline, in listing order."""
    _load()
    return sorted(_REGISTRY.values(), key=lambda p: (p.rank, p.name))


def names() -> tuple[str, ...]:
    """The registered pipelines' names, in listing order."""
    return tuple(p.name for p in pipelines())


def get(name: str) -> Pipeline:
    """The record of pipeline ``name``.

    Raises:
        ScheduleError: no pipeline has that name.
    """
    _load()
    found = _REGISTRY.get(name) if isinstance(name, str) else None
    if found is None:
        raise ScheduleError(
            f"pipeline must be one of {list(names())}. Received: pipeline={name!r}")
    return found
