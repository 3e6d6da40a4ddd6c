"""The drain split on and off, side by side in one job: ``python benchmarks/drain_split.py``.

Benchmark 11's tfsmp workload (Dense(1024) × 8, MSE, SGD, batch 2048, m = 8, 2 ranks × 1
thread, ``optimize: speed``) as two models in one MPI job, one with the drain split ([Note:
drain split] in tfsmp/runtime/executor.py) and one without, stepping alternately (the fastest of
2 steps per model and round, which goes first alternating); prints per pipeline the median step
of each and the median and quartiles over rounds of off/on (> 1: the split is faster). Not part
of `run.py`.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/drain_split.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import launch

__all__ = ["main", "worker"]


def worker(args: dict[str, Any]) -> dict[str, Any]:
    from benchmarks import tfhelp

    tfhelp.setup_threads()
    import keras

    x, y = tfhelp.make_data(args["batch"], args["width"])
    smp = tfhelp.reinit({"partitions": 2, "microbatches": args["m"],
                         "pipeline": args["pipeline"], "optimize": "speed"})

    def build() -> Any:
        model = smp.DistributedModel(lambda: tfhelp.dense_stack(args["width"], args["depth"]))
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.01), loss="mse")
        for _ in range(2):  # build, trace, and make the executors
            model.train_on_batch(x, y)
        return model

    on, off = build(), build()
    for ex in off._engine.executors.cache.values():  # the switch under test
        ex._drain = {}
    times: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(args["rounds"]):
        pair = [("on", on), ("off", off)]
        for name, model in pair if r % 2 == 0 else pair[::-1]:
            best = float("inf")
            for _ in range(2):
                tfhelp.sleepy_barrier()
                start = time.perf_counter()
                model.train_on_batch(x, y)
                best = min(best, time.perf_counter() - start)
            times[name].append(best)
    return times


def main() -> None:
    for pipeline in ("interleaved", "simple"):
        args = {"pipeline": pipeline, "width": 1024, "depth": 8, "batch": 2048, "m": 8,
                "rounds": 12}
        times = launch(2, "drain_split", "worker", args, timeout=900)
        ratios = sorted(b / a for a, b in zip(times["on"], times["off"]))
        quartile = [ratios[int(q * (len(ratios) - 1))] for q in (0.25, 0.75)]
        print(f"{pipeline}: step with the drain split {statistics.median(times['on']):.3f} s, "
              f"without {statistics.median(times['off']):.3f} s; without / with "
              f"{statistics.median(ratios):.3f} [{quartile[0]:.3f}, {quartile[1]:.3f}] over "
              f"{len(ratios)} rounds")


if __name__ == "__main__":
    main()
