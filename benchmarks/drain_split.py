"""The drain split on and off, side by side in one job: ``python benchmarks/drain_split.py``.

Benchmark 11's tfsmp workload (Dense(1024) × 8, MSE, SGD, batch 2048, m = 8, 2 ranks × 1
thread, ``optimize: speed``) as two models in one MPI job, one with the drain split ([Note:
drain split] in tfsmp/runtime/executor.py) and one without, stepping alternately (the fastest of
2 steps per model and round, timed as the slowest rank's, which goes first alternating); prints
per pipeline the median step of each and the median and quartiles over rounds of off/on (> 1:
the split is faster). Not part of `run.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/drain_split.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import launch, side_by_side

__all__ = ["main", "worker"]


def worker(args: dict[str, Any]) -> dict[str, Any]:
    from benchmarks import tfhelp

    tfhelp.setup_threads()
    x, y = tfhelp.make_data(args["batch"], args["width"])
    smp = tfhelp.reinit({"partitions": 2, "microbatches": args["m"],
                         "pipeline": args["pipeline"], "optimize": "speed"})
    on, off = (tfhelp.built_stack(smp, args["width"], args["depth"], x, y) for _ in range(2))
    for ex in off._engine.executors.cache.values():  # the switch under test
        ex._drain = {}
    return tfhelp.alternate({"on": on, "off": off}, x, y, args["rounds"])


def main() -> None:
    for pipeline in ("interleaved", "simple"):
        args = {"pipeline": pipeline, "width": 1024, "depth": 8, "batch": 2048, "m": 8,
                "rounds": 12}
        times = launch(2, "drain_split", "worker", args, timeout=900)
        print(side_by_side(pipeline, times, "on", "off"))


if __name__ == "__main__":
    main()
