"""Benchmark 7, data-parallel reduction: tfsmp's MPI path vs its Horovod path vs raw MPI.

Two ranks form one stage's data-parallel group (``partitions: 1, horovod: True``). Each model is
wrapped in a `DistributedModel` and partitioned; one variable per trainable variable of its
stage stands for that variable's gradient (what the runtime reduces where a stage keeps
accumulators; linear layers at d > 1 take theirs at the step's end instead, [Note: late weights
across replicas] in tfsmp/runtime/stage.py). Every arm sums them over the two ranks through the
runtime's own code of `Reduction.reduce_stage`: arm A its MPI path (`Reduction.sum_`: 32 MiB
buckets flattened into one numpy buffer, ``MPI_Allreduce`` in place, assigned back), arm B its
Horovod path (``hvd.grouped_allreduce`` of the variables, assigned back). Arm C is the
floor: one raw mpi4py ``Allreduce`` of a preallocated buffer of the gradients' total size. Rounds alternate A B C; times are
medians over rounds.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.common import launch, median, ratio_summary

__all__ = ["run", "summarize", "verdict", "worker"]

NAME = "reduction"
TITLE = "Data-parallel reduction (MPI vs Horovod, 2 replicas)"


def settings(quick: bool) -> dict[str, Any]:
    return {"models": ["dense_1024x8", "transformer", "resnet50"], "rounds": 5 if quick else 15,
            "repeats": 3}


def run(quick: bool) -> dict[str, Any]:
    args = settings(quick)
    result = launch(2, "bench_reduction", "worker", args, timeout=600)
    result["settings"] = args
    return result


def _model_and_sample(name: str) -> tuple[Any, Any]:
    """A builder of the benchmark model and a two-row sample input for it."""
    import numpy as np

    from benchmarks import models, tfhelp

    if name == "dense_1024x8":
        return (lambda: tfhelp.dense_stack(1024, 8)), tfhelp.make_data(2, 1024)[0]
    if name == "transformer":
        return models.transformer_encoder, models.transformer_data(2)[0]
    if name == "resnet50":
        return models.PLAN_MODELS["ResNet50"], np.zeros((2, 224, 224, 3), np.float32)
    raise ValueError(f"model must be dense_1024x8, transformer or resnet50. Received: {name!r}")


def worker(args: dict[str, Any]) -> dict[str, Any]:
    from benchmarks import tfhelp

    tfhelp.setup_threads()
    smp = tfhelp.reinit({"partitions": 1, "horovod": True})
    rows = [_model(smp, name, args) for name in args["models"]]
    return {"rows": rows}


def _model(smp: Any, name: str, args: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    from mpi4py import MPI

    build, sample = _model_and_sample(name)
    model = smp.DistributedModel(build)
    model.compile(optimizer="sgd", loss="mse")
    import tensorflow as tf

    from tfsmp.runtime.reduction import Reduction

    model.partition(sample)  # traced, planned, the stage's variables built
    engine = model._engine
    accs = [tf.Variable(tf.ones(v.shape, dtype=v.dtype), trainable=False)
            for v in engine.programs[0].trainable if v.dtype == "float32"]
    floats = sum(int(np.prod(a.shape)) for a in accs)
    flat = np.ones(floats, dtype=np.float32)
    comm = engine.comm.data.mpi_comm
    mpi_path = Reduction(engine.comm.data)  # reduce_stage's MPI path
    hvd = engine.reduction.horovod          # ... and its Horovod path

    def reduce_with(horovod: bool) -> float:
        start = time.perf_counter()
        for _ in range(args["repeats"]):
            if horovod:
                summed = hvd.grouped_allreduce([a.value() for a in accs], name="bench_grads")
                for a, g in zip(accs, summed):
                    a.assign(g)
            else:
                mpi_path.sum_(accs, "the benchmark's allreduce")
        return float(time.perf_counter() - start) / int(args["repeats"])

    def raw() -> float:
        start = time.perf_counter()
        for _ in range(args["repeats"]):
            comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        return float(time.perf_counter() - start) / int(args["repeats"])

    reduce_with(False), reduce_with(True), raw()
    a: list[float] = []
    b: list[float] = []
    c: list[float] = []
    for _ in range(args["rounds"]):
        comm.Barrier()
        a.append(reduce_with(False))
        comm.Barrier()
        b.append(reduce_with(True))
        comm.Barrier()
        c.append(raw())
    return {"model": name, "tensors": len(accs), "bytes": 4 * floats,
            "mpi": median(a), "horovod": median(b), "raw_mpi": median(c),
            "horovod_over_mpi": ratio_summary([bi / ai for ai, bi in zip(a, b)]),
            "mpi_over_raw": ratio_summary([ai / ci for ai, ci in zip(a, c)])}


def summarize(result: dict[str, Any]) -> list[str]:
    """Markdown table of the result."""
    s = result["settings"]
    lines = [f"2 ranks = 2 data-parallel replicas of one stage; {s['rounds']} rounds × "
             f"{s['repeats']} reductions per arm; ms per reduction of all gradients.", "",
             "| model | tensors | MB | tfsmp MPI | tfsmp Horovod | raw MPI_Allreduce | Horovod / MPI [q1, q3] | tfsmp MPI / raw |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        h, m = r["horovod_over_mpi"], r["mpi_over_raw"]
        lines.append(f"| {r['model']} | {r['tensors']} | {r['bytes'] / 2**20:.1f} | "
                     f"{1e3 * r['mpi']:.1f} | {1e3 * r['horovod']:.1f} | {1e3 * r['raw_mpi']:.1f} | "
                     f"{h['median']:.2f} [{h['q1']:.2f}, {h['q3']:.2f}] | {m['median']:.2f} |")
    return lines


def verdict(result: dict[str, Any]) -> str:
    faster = [r["model"] for r in result["rows"] if r["horovod_over_mpi"]["median"] < 1.0]
    return (f"no goal set; Horovod faster for {', '.join(faster)}" if faster
            else "no goal set; the MPI path is at least as fast as Horovod for every model")
