"""Benchmark 3, memory: per-rank variables, optimizer state and peak RSS for p = 1, 2, 4.

A weight-dominated model (equal Dense layers, small batch) is trained for a few steps with Adam
on p ranks (one stage each, built inside `deferred_init`, so no rank ever holds the whole
model). Each rank reports the bytes of the variables it holds, of its optimizer state, of its
gradient accumulators, and its peak resident set size (``ru_maxrss``) with the RSS it had after
TensorFlow started but before the model was built. The goal compares variables + optimizer state
with ``total/p``, where total is the whole model's (computed from the variable shapes).
"""

from __future__ import annotations

import itertools
from typing import Any

from benchmarks.common import launch

__all__ = ["run", "summarize", "verdict", "worker"]

NAME = "memory"
TITLE = "Memory (per-rank state and peak RSS, p = 1, 2, 4)"
GOAL = 1.05  # state per rank / (total / p)


def settings(quick: bool) -> dict[str, Any]:
    return {"width": 2048, "depth": 8, "batch": 64, "microbatches": 2, "steps": 2 if quick else 4,
            "partitions": [1, 2, 4], "optimizer": "adam"}


def run(quick: bool) -> dict[str, Any]:
    args = settings(quick)
    rows = []
    for p in args["partitions"]:
        rows.append(launch(p, "bench_memory", "worker", {**args, "p": p}, timeout=600))
    return {"rows": rows, "settings": args}


def _current_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _bytes(variables: Any) -> int:
    import numpy as np

    def itemsize(dtype: Any) -> int:  # Keras variables name their dtype, tf.Variables hold a DType
        return int(getattr(dtype, "size", 0) or np.dtype(dtype).itemsize)

    return sum(int(np.prod(v.shape)) * itemsize(v.dtype) for v in variables)


def worker(args: dict[str, Any]) -> dict[str, Any]:
    from benchmarks import tfhelp
    from tfsmp.keras.porting import rank_variables  # what this rank holds

    tfhelp.setup_threads()
    smp = tfhelp.reinit({"partitions": args["p"], "microbatches": args["microbatches"]})
    width, depth, batch = args["width"], args["depth"], args["batch"]
    x, y = tfhelp.make_data(batch * args["steps"], width)
    before = _current_rss()
    model = smp.DistributedModel(lambda: tfhelp.dense_stack(width, depth))
    model.compile(optimizer=args["optimizer"], loss="mse")
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    mine = {
        "variables": int(model.held_variable_bytes()),
        "optimizer": _bytes(rank_variables(model.optimizer)),
        # every stage's gradient accumulators (placeholders of late weights are empty)
        "accumulators": _bytes([a for prog in model._engine.programs.values()
                                for a in prog.grads.accumulators]),
        "rss_before_model": before, "peak_rss": tfhelp.peak_rss_bytes(),
    }
    total_vars = _bytes(model.source_model().weights)
    trainable = _bytes(model.source_model().trainable_weights)
    ranks = tfhelp.world().gather(mine, root=0)
    if ranks is None:
        return {}
    # Adam keeps two slots per trainable variable (plus two scalars, negligible).
    total_state = total_vars + 2 * trainable
    return {"p": args["p"], "ranks": ranks, "total_variables": total_vars,
            "total_state": total_state, "per_rank_goal": total_state / args["p"]}


def _mb(n: float) -> str:
    return f"{n / 2**20:.0f}"


def summarize(result: dict[str, Any]) -> list[str]:
    """Markdown table of the result."""
    s = result["settings"]
    lines = [f"Model Dense({s['width']})×{s['depth']} ({_mb(result['rows'][0]['total_variables'])} MB "
             f"of variables), optimizer {s['optimizer']}, batch {s['batch']}, "
             f"{s['microbatches']} microbatches, {s['steps']} steps; worst rank shown; MB.", "",
             "| p | variables | optimizer | state = var + opt | total/p | state / (total/p) | accumulators | RSS before model | peak RSS | peak − before |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        worst = max(row["ranks"], key=lambda r: r["variables"] + r["optimizer"])
        state = worst["variables"] + worst["optimizer"]
        rss = max(r["peak_rss"] for r in row["ranks"])
        before = max(r["rss_before_model"] for r in row["ranks"])
        grown = max(r["peak_rss"] - r["rss_before_model"] for r in row["ranks"])
        lines.append(f"| {row['p']} | {_mb(worst['variables'])} | {_mb(worst['optimizer'])} | "
                     f"{_mb(state)} | {_mb(row['per_rank_goal'])} | "
                     f"{state / row['per_rank_goal']:.3f} | {_mb(worst['accumulators'])} | "
                     f"{_mb(before)} | {_mb(rss)} | {_mb(grown)} |")
    return lines


def verdict(result: dict[str, Any]) -> str:
    ratios = [max(r["variables"] + r["optimizer"] for r in row["ranks"]) / row["per_rank_goal"]
              for row in result["rows"]]
    rss = [max(r["peak_rss"] for r in row["ranks"]) for row in result["rows"]]
    falls = all(b < a for a, b in itertools.pairwise(rss))
    worst = max(ratios)
    state = (f"state met (worst {worst:.3f} ≤ {GOAL})" if worst <= GOAL
             else f"state missed by {worst - GOAL:.3f} (worst {worst:.3f})")
    return f"{state}; peak RSS {'falls' if falls else 'does not fall'} with p"
