"""Stage programs called flat or through tf.function, side by side in one job:
``python benchmarks/dispatch.py``.

Benchmark 11's tfsmp workload (Dense(1024) × 8, MSE, SGD, batch 2048, m = 8, 2 ranks × 1
thread, ``optimize: speed``, ``blas: openblas``) as two models in one MPI job, one whose stage
programs are called flat once traced ([Note: program dispatch] in tfsmp/runtime/dispatch.py)
and one whose every call goes through `tf.function`'s own dispatch, stepping alternately (the
fastest of 2 steps per model and round, timed as the slowest rank's, which model goes first
alternating); prints per pipeline the median step of each and the median and quartiles over
rounds of tf.function / flat (> 1: calling flat is faster). Not part of `run.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/dispatch.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import launch, side_by_side

__all__ = ["main", "worker"]


def worker(args: dict[str, Any]) -> dict[str, Any]:
    from benchmarks import tfhelp

    tfhelp.setup_threads()
    from tfsmp.runtime.dispatch import Program

    x, y = tfhelp.make_data(args["batch"], args["width"])
    smp = tfhelp.reinit({"partitions": 2, "microbatches": args["m"],
                         "pipeline": args["pipeline"], "virtual_stages": args["v"],
                         "optimize": "speed", "blas": "openblas"})
    flat, own = (tfhelp.built_stack(smp, args["width"], args["depth"], x, y) for _ in range(2))
    switched = 0
    for prog in own._engine.programs.values():  # the switch under test
        for f in vars(prog).values():
            if isinstance(f, Program):
                f.flat = False
                switched += 1
    assert switched, "no stage program to switch"
    return tfhelp.alternate({"flat": flat, "tf.function": own}, x, y, args["rounds"])


def main() -> None:
    for pipeline, v in (("simple", 1), ("interleaved", 1), ("zb-v", 2)):
        args = {"pipeline": pipeline, "v": v, "width": 1024, "depth": 8, "batch": 2048, "m": 8,
                "rounds": 11}
        times = launch(2, "dispatch", "worker", args, timeout=900)
        print(side_by_side(f"{pipeline} v={v}", times, "flat", "tf.function"))


if __name__ == "__main__":
    main()
