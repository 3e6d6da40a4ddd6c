"""Golden schedule files: the generated and lowered schedules of a grid of (pipeline, p, m, v).

Regenerate after an intended change, then review the diff::

    python -m tfsmp.schedule.golden tests/golden/schedules

Each file ``<pipeline>_p{p}_m{m}_v{v}[_<links>].txt`` holds a ``[compute]`` section (generator
output), a ``[lowered]`` section (chain links, or the named skip links; one REDUCE per stage) and
a ``[forward only]`` section (`forward_only`, what predict and evaluate run), one line per rank
in `format_schedule` form. ``tests/pure/test_schedule_golden.py`` compares.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from tfsmp.schedule.actions import format_schedule
from tfsmp.schedule.generators import generate
from tfsmp.schedule.links import StageLinks
from tfsmp.schedule.lowering import forward_only, lower
from tfsmp.schedule.placement import Placement
from tfsmp.schedule.registry import pipelines

__all__ = ["CASES", "REGENERATE", "GoldenCase", "golden_text", "main", "write_all"]

REGENERATE = "python -m tfsmp.schedule.golden tests/golden/schedules"

# Named stage graphs besides the chain: a skip connection from stage 0 straight to stage 3.
_LINKS = {"skip": StageLinks(4, {0: [1, 3], 1: [2], 2: [3]})}


@dataclass(frozen=True)
class GoldenCase:
    pipeline: str
    p: int
    m: int
    v: int
    links: str | None = None

    @property
    def filename(self) -> str:
        suffix = f"_{self.links}" if self.links else ""
        return f"{self.pipeline}_p{self.p}_m{self.m}_v{self.v}{suffix}.txt"

    @property
    def placement(self) -> Placement:
        return Placement.for_pipeline(self.pipeline, self.p, self.v)


def _cases() -> list[GoldenCase]:
    """Every registered pipeline's golden grid ([Note: pipeline registry] in registry.py)."""
    cases = []
    for record in pipelines():
        cases += [GoldenCase(record.name, p, m, v) for p, m, v in record.golden]
        cases += [GoldenCase(record.name, p, m, v, links) for p, m, v, links in record.golden_links]
    return cases


CASES = _cases()


def golden_text(case: GoldenCase) -> str:
    """The file content for one case."""
    compute = generate(case.pipeline, case.p, case.m, case.v)
    links = _LINKS[case.links] if case.links else None
    placement = case.placement
    lowered = lower(compute, links, case.p, placement=placement)
    forward = {rank: forward_only(links or StageLinks.chain(placement.num_stages), placement, rank,
                                  case.m) for rank in range(case.p)}
    where = f", links={case.links}: {dict(links.forward)}" if links else ""
    if placement.kind != "interleaved":
        where += f"\n# placement {placement.kind}: {placement.describe()}"
    return (f"# {case.pipeline} pipeline, p={case.p} ranks, m={case.m} microbatches, "
            f"v={case.v} virtual stages{where}\n"
            f"# Regenerate: {REGENERATE}\n"
            f"[compute]\n{format_schedule(compute)}\n"
            f"[lowered]\n{format_schedule(lowered)}\n"
            f"[forward only]\n{format_schedule(forward)}\n")


def write_all(directory: str | Path) -> list[Path]:
    """Writes every case's file into ``directory``; returns the paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for case in CASES:
        path = out / case.filename
        path.write_text(golden_text(case))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: {REGENERATE}", file=sys.stderr)
        return 2
    paths = write_all(args[0])
    print(f"wrote {len(paths)} golden schedules to {args[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
