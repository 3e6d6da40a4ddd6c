"""Sharded optimizer state: each rank's cgroup peak with and without ``shard_optimizer_state``.

Usage (root, for the memory cgroups)::

    python -m benchmarks.bench_sharded_state          # prints the table and a JSON line

4 ranks, p = 2 stages x d = 2 replicas, a stack of 8 Dense(4096) layers (134M parameters, 537
MB of weights; each stage 4 layers), Adam, batch 8, m = 4, ``optimize: memory``, 3 steps of
``fit``. Every rank runs in a memory cgroup of its own (`tfsmp.launch.memcap`, a cap far above
what it needs: nothing is killed); its peak is the cgroup's maximum usage. Unsharded and sharded
are two jobs (one job running both would report the larger peak for both). Beside each
rank's peak, the memory model's prediction (`predict_memory`, [Note: sharded state]) and the
optimizer state its model predicts. Expected: Adam's slots (8 bytes a parameter, 537 MB a stage)
halved on each replica, ~268 MB less per rank.
"""

from __future__ import annotations

import json
from typing import Any

from benchmarks.common import launch

__all__ = ["run", "summarize", "verdict", "worker"]

NAME = "sharded_state"
TITLE = "Sharded optimizer state (per-rank cgroup peak, p=2 x d=2, Adam)"
SPEC = {"width": 4096, "depth": 8, "batch": 8, "microbatches": 4, "steps": 3, "partitions": 2}
CAP = 4 * 2**30
MiB = 2**20


def run(quick: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"settings": {**SPEC, "ranks": 4, "cap": CAP}, "jobs": {}}
    for shard in (False, True):
        got = launch(4, "bench_sharded_state", "worker", {**SPEC, "shard": shard},
                     timeout=1200, memory_per_rank=CAP,
                     env={"TF_NUM_INTEROP_THREADS": "2", "TFSMP_MEMORY_CHECK": "off"})
        out["jobs"]["sharded" if shard else "unsharded"] = got
    return out


def worker(args: dict[str, Any]) -> dict[str, Any]:
    """Every rank: fit ``steps`` steps; rank 0 gathers peaks and predictions."""
    from benchmarks import tfhelp

    tfhelp.setup_threads()
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(2)
    from tfsmp.keras.porting import rank_variables  # what this rank holds
    from tfsmp.launch.memcap import peak_bytes
    from tfsmp.partitioning.memory import predict_memory, settings_of

    smp = tfhelp.reinit({"partitions": args["partitions"], "microbatches": args["microbatches"],
                         "optimize": "memory", "shard_optimizer_state": args["shard"]})
    with smp.deferred_init():  # no rank ever holds the whole model
        stack = tfhelp.dense_stack(args["width"], args["depth"])
    model = smp.DistributedModel(stack)
    x, y = tfhelp.make_data(args["batch"] * args["steps"], args["width"])
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=args["batch"], epochs=1, verbose=0, shuffle=False)
    engine = model._engine
    dp = smp.dp_size()
    settings = settings_of(engine.config, "adam", args["batch"] // dp, dp)
    predicted = predict_memory(engine.plan, engine.traced.graph, settings)
    mine = predicted[smp.mp_rank()]
    slots = sum(int(v.numpy().nbytes) for v in rank_variables(model.optimizer) if len(v.shape))
    row = {"peak": peak_bytes() or 0, "predicted": mine.total,
           "predicted_optimizer": mine.optimizer, "slot_bytes": slots,
           "pipeline_rank": smp.mp_rank(), "data_rank": smp.dp_rank()}
    rows = tfhelp.world().gather(row, root=0)
    return {"rows": rows} if rows is not None else {}


def summarize(result: dict[str, Any]) -> list[str]:
    lines = ["| job | rank | (p, d) | peak MiB | predicted MiB | slots MiB | predicted slots MiB |",
             "|---|---|---|---|---|---|---|"]
    for name, job in result["jobs"].items():
        for rank, r in enumerate(job["rows"]):
            lines.append(
                f"| {name} | {rank} | ({r['pipeline_rank']}, {r['data_rank']}) | "
                f"{r['peak'] / MiB:.0f} | {r['predicted'] / MiB:.0f} | {r['slot_bytes'] / MiB:.0f} "
                f"| {r['predicted_optimizer'] / MiB:.0f} |")
    return lines


def verdict(result: dict[str, Any]) -> str:
    full, half = result["jobs"]["unsharded"]["rows"], result["jobs"]["sharded"]["rows"]
    saved = [(f["peak"] - h["peak"]) / MiB for f, h in zip(full, half)]
    return f"sharding saved {min(saved):.0f}-{max(saved):.0f} MiB of peak per rank"


if __name__ == "__main__":
    result = run()
    print("\n".join(summarize(result)))
    print(verdict(result))
    print(json.dumps(result))
