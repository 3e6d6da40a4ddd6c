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

import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/dispatch.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import launch

__all__ = ["main", "worker"]


def worker(args: dict[str, Any]) -> dict[str, Any]:
    from benchmarks import tfhelp

    tfhelp.setup_threads()
    import keras

    from tfsmp.runtime.dispatch import Program

    x, y = tfhelp.make_data(args["batch"], args["width"])
    smp = tfhelp.reinit({"partitions": 2, "microbatches": args["m"],
                         "pipeline": args["pipeline"], "virtual_stages": args["v"],
                         "optimize": "speed", "blas": "openblas"})

    def build() -> Any:
        model = smp.DistributedModel(lambda: tfhelp.dense_stack(args["width"], args["depth"]))
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.01), loss="mse")
        for _ in range(2):  # build, trace, and make the executors
            model.train_on_batch(x, y)
        return model

    flat, own = build(), build()
    switched = 0
    for prog in own._engine.programs.values():  # the switch under test
        for f in vars(prog).values():
            if isinstance(f, Program):
                f.flat = False
                switched += 1
    assert switched, "no stage program to switch"
    times: dict[str, list[float]] = {"flat": [], "own": []}
    for r in range(args["rounds"]):
        pair = [("flat", flat), ("own", own)]
        for name, model in pair if r % 2 == 0 else pair[::-1]:
            tfhelp.sleepy_barrier()
            times[name].append(min(tfhelp.slowest_rank(
                [tfhelp.batch_step_time(model, x, y) for _ in range(2)])))
    return times


def main() -> None:
    for pipeline, v in (("simple", 1), ("interleaved", 1), ("zb-v", 2)):
        args = {"pipeline": pipeline, "v": v, "width": 1024, "depth": 8, "batch": 2048, "m": 8,
                "rounds": 11}
        times = launch(2, "dispatch", "worker", args, timeout=900)
        ratios = sorted(b / a for a, b in zip(times["flat"], times["own"]))
        quartile = [ratios[int(q * (len(ratios) - 1))] for q in (0.25, 0.75)]
        print(f"{pipeline} v={v}: step called flat {statistics.median(times['flat']):.3f} s, "
              f"through tf.function {statistics.median(times['own']):.3f} s; tf.function / flat "
              f"{statistics.median(ratios):.3f} [{quartile[0]:.3f}, {quartile[1]:.3f}] over "
              f"{len(ratios)} rounds")


if __name__ == "__main__":
    main()
