"""Benchmark 10, bytes per parameter: what each rank holds per parameter of its stages, by
microbatch count, against plain Keras's.

A stack of equal Dense layers is trained for a few steps by plain Keras (one process, ``L``
layers) and by tfsmp at p pipeline stages of ``L`` layers each (``optimize: memory``, 1F1B, the
model built in `tfsmp.deferred_init`), for Adam and SGD and m = 1, 2, 4, 8. Every process runs
in a memory cgroup of its own (`tfsmp.launch.memcap`, no cap: the cgroup only measures) and
reports the cgroup's maximum usage; a rank that holds nothing (imports, MPI, ``tfsmp.init``) is
the baseline. A rank's bytes per parameter are (peak - baseline) / the parameters of its stages;
the goal is every rank, the last included, at most plain Keras's at every m. Threads: one
intra-op and two inter-op threads in every process (what a tfsmp rank runs with).

The stack is small enough for this shared 2-core machine (``TFSMP_BENCH_WIDTH`` and
``TFSMP_BENCH_LAYERS`` change it): bytes per parameter is a ratio, and with 4 Dense(4096)
layers per rank (67M parameters, 256 MiB of weights) the fixed costs beside the baseline
(the programs' graphs, kernel caches) are a few percent of it.
"""

from __future__ import annotations

import os
from typing import Any

from benchmarks.common import launch

__all__ = ["run", "summarize", "trial", "verdict", "worker"]

NAME = "bytes_per_param"
TITLE = "Bytes per parameter (per rank, by microbatch count, against plain Keras)"
GOAL = 1.0  # a rank's bytes per parameter / plain Keras's, at every m
UNCAPPED = 64 * 2**30  # the cgroup only measures
NAME_MODULE = "bench_bytes_per_param"


def settings(quick: bool) -> dict[str, Any]:
    return {"width": int(os.environ.get("TFSMP_BENCH_WIDTH", 4096)),
            "layers": int(os.environ.get("TFSMP_BENCH_LAYERS", 4)), "batch": 8,
            "partitions": 2, "microbatches": _ints("TFSMP_BENCH_MICROBATCHES", [1, 2, 4, 8]),
            "optimizers": os.environ.get("TFSMP_BENCH_OPTIMIZERS", "adam,sgd").split(","),
            "steps": 2 if quick else 3,
            # TFSMP_BENCH_JIT=1: plain Keras and tfsmp both compile with jit_compile=True
            "jit": os.environ.get("TFSMP_BENCH_JIT") == "1"}


def _ints(name: str, default: list[int]) -> list[int]:
    found = os.environ.get(name)
    return [int(v) for v in found.split(",")] if found else default


def run(quick: bool) -> dict[str, Any]:
    args = settings(quick)
    env = {"TF_NUM_INTEROP_THREADS": "2"}
    base = launch(1, NAME_MODULE, "baseline", {}, timeout=300, memory_per_rank=UNCAPPED,
                  env=env)["peak"]
    rows = []
    for opt in args["optimizers"]:
        spec = {**args, "optimizer": opt}
        plain = launch(1, NAME_MODULE, "trial", {**spec, "p": 1, "m": 1}, timeout=600,
                       memory_per_rank=UNCAPPED, env=env)
        for m in args["microbatches"]:
            got = launch(args["partitions"], NAME_MODULE, "trial", {**spec, "p":
                         args["partitions"], "m": m}, timeout=900, memory_per_rank=UNCAPPED,
                         env=env)
            rows.append({"optimizer": opt, "m": m, "plain": plain["ranks"][0],
                         "ranks": got["ranks"]})
    return {"settings": args, "baseline": base, "rows": rows}


# -- rank side -----------------------------------------------------------------------------------

def _threads() -> None:
    from benchmarks import tfhelp

    tfhelp.setup_threads()
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(2)


def baseline(args: dict[str, Any]) -> dict[str, Any]:
    """A rank that imports what a trial imports and initializes tfsmp, holding no model."""
    from benchmarks import tfhelp

    _threads()
    from tfsmp.launch.memcap import peak_bytes

    tfhelp.reinit({})
    return {"peak": peak_bytes() or 0}


def trial(args: dict[str, Any]) -> dict[str, Any]:
    """Every rank: train the stack ``steps`` steps; report its cgroup peak and its parameters."""
    from benchmarks import tfhelp

    _threads()
    import keras

    import tfsmp
    from tfsmp.launch.memcap import peak_bytes

    p, width, layers = args["p"], args["width"], args["layers"]
    batch = args["batch"]
    x, y = tfhelp.make_data(batch * args["steps"], width)
    keras.utils.set_random_seed(0)
    if p == 1:  # plain Keras, one process
        model = tfhelp.dense_stack(width, layers)
        model.compile(optimizer=args["optimizer"], loss="mse", jit_compile=args.get("jit", False))
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
        return {"ranks": [{"peak": peak_bytes() or 0, "params": model.count_params(),
                           "layers": layers}]}
    smp = tfhelp.reinit({"partitions": p, "microbatches": args["m"], "optimize": "memory"})
    with tfsmp.deferred_init():
        source = tfhelp.dense_stack(width, p * layers)
    model = smp.DistributedModel(source)
    model.compile(optimizer=args["optimizer"], loss="mse", jit_compile=args.get("jit", False))
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    stage = smp.mp_rank()
    mine = {"peak": peak_bytes() or 0, "layers": len(model.plan.layers(stage)),
            "params": int(model.held_variable_bytes()) // 4}  # float32 weights
    ranks = tfhelp.world().gather(mine, root=0)
    return {"ranks": ranks} if ranks is not None else {}


worker = trial  # `benchmarks/run.py`'s interface


# -- report ------------------------------------------------------------------------------------

def per_param(rank: dict[str, Any], base: int) -> float:
    return (rank["peak"] - base) / rank["params"]


def summarize(result: dict[str, Any]) -> list[str]:
    s, base = result["settings"], result["baseline"]
    lines = [f"Dense({s['width']}) stack, {s['layers']} layers per rank, p = {s['partitions']}, "
             f"batch {s['batch']}, optimize memory, 1F1B, {s['steps']} steps"
             + (", jit_compile=True (XLA) in both" if s.get("jit") else "") + "; bytes per "
             f"parameter = (cgroup peak - baseline {base / 2**20:.0f} MiB) / parameters held.", "",
             "| optimizer | m | plain Keras | " + " | ".join(
                 f"rank {r}" for r in range(s["partitions"])) + " | worst / plain |",
             "|---|---|---|" + "---|" * s["partitions"] + "---|"]
    for row in result["rows"]:
        plain = per_param(row["plain"], base)
        mine = [per_param(r, base) for r in row["ranks"]]
        lines.append(f"| {row['optimizer']} | {row['m']} | {plain:.2f} | "
                     + " | ".join(f"{b:.2f}" for b in mine) + f" | {max(mine) / plain:.3f} |")
    return lines


def verdict(result: dict[str, Any]) -> str:
    base = result["baseline"]
    worst = max(max(per_param(r, base) for r in row["ranks"]) / per_param(row["plain"], base)
                for row in result["rows"])
    return (f"met (worst rank {worst:.3f} x plain Keras's bytes per parameter)" if worst <= GOAL
            else f"missed (worst rank {worst:.3f} x plain Keras's bytes per parameter)")
