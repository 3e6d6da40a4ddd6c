"""Benchmark 1, overhead: one stage, one microbatch — `DistributedModel.fit` vs plain Keras `fit`.

One process, one thread. Per round, the same model's steady-state `fit` steps run as plain Keras
(A), as a `DistributedModel` (B), and as the same `DistributedModel` with its timeline tracer
switched on (C). The figure is the median over rounds of B/A (and C/B: what tracing costs when
on; when off the executor holds no tracer and runs the same code as B).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from benchmarks.common import launch, median, ratio_summary

__all__ = ["run", "summarize", "verdict", "worker"]

NAME = "overhead"
TITLE = "Overhead (1 stage, 1 microbatch: DistributedModel.fit / Keras fit)"
GOAL = 1.03


def settings(quick: bool) -> dict[str, Any]:
    cases = [{"width": 1024, "depth": 8, "batch": 256}]
    if not quick:
        cases.append({"width": 1024, "depth": 8, "batch": 2048})
    return {"cases": cases, "optimizer": "adam", "steps": 2, "rounds": 10 if quick else 20}


def run(quick: bool) -> dict[str, Any]:
    args = settings(quick)
    result = launch(1, "bench_overhead", "worker", args, timeout=600)
    result["settings"] = args
    return result


def worker(args: dict[str, Any]) -> dict[str, Any]:
    from benchmarks import tfhelp

    tfhelp.setup_threads()
    smp = tfhelp.reinit({"partitions": 1, "microbatches": 1})
    return {"rows": [_case(smp, args, case) for case in args["cases"]]}


def _case(smp: Any, args: dict[str, Any], case: dict[str, Any]) -> dict[str, Any]:
    from benchmarks import tfhelp
    from tfsmp.timeline.events import Tracer

    width, depth, batch, steps = case["width"], case["depth"], case["batch"], args["steps"]
    x, y = tfhelp.make_data(batch * (steps + 1), width)
    keras_model = tfhelp.dense_stack(width, depth)
    keras_model.compile(optimizer=args["optimizer"], loss="mse", jit_compile=False)
    model = smp.DistributedModel(lambda: tfhelp.dense_stack(width, depth))
    model.compile(optimizer=args["optimizer"], loss="mse")
    for m in (keras_model, model):
        tfhelp.fit_step_times(m, x, y, batch, 1)
    engine = model._engine
    tracer = Tracer(tempfile.mkdtemp(prefix="tfsmp_bench_trace_"), rank=0)
    a: list[float] = []
    b: list[float] = []
    c: list[float] = []
    for _ in range(args["rounds"]):
        a.append(min(tfhelp.fit_step_times(keras_model, x, y, batch, steps)))
        b.append(min(tfhelp.fit_step_times(model, x, y, batch, steps)))
        engine._tracer = tracer
        c.append(min(tfhelp.fit_step_times(model, x, y, batch, steps)))
        engine._tracer = None
        tracer.events.clear()
    shutil.rmtree(os.path.dirname(tracer.path), ignore_errors=True)
    return {**case, "keras_step": median(a), "tfsmp_step": median(b), "traced_step": median(c),
            "overhead": ratio_summary([bi / ai for ai, bi in zip(a, b)]),
            "overhead_ms": 1e3 * median([bi - ai for ai, bi in zip(a, b)]),
            "tracing_on": ratio_summary([ci / bi for bi, ci in zip(b, c)])}


def summarize(result: dict[str, Any]) -> list[str]:
    """Markdown table of the result."""
    s = result["settings"]
    lines = [f"Model Dense({s['cases'][0]['width']})×{s['cases'][0]['depth']}, optimizer "
             f"{s['optimizer']}, 1 thread, {s['rounds']} rounds × {s['steps']} steps per arm "
             f"(A Keras, B tfsmp, C tfsmp traced).", "",
             "| batch | Keras step (s) | tfsmp step (s) | tfsmp / Keras [q1, q3] | extra ms/step | tracing on / off |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        o, t = r["overhead"], r["tracing_on"]
        lines.append(f"| {r['batch']} | {r['keras_step']:.4f} | {r['tfsmp_step']:.4f} | "
                     f"{o['median']:.3f} [{o['q1']:.3f}, {o['q3']:.3f}] | {r['overhead_ms']:.1f} | "
                     f"{t['median']:.3f} |")
    return lines


def verdict(result: dict[str, Any]) -> str:
    worst = max(r["overhead"]["median"] for r in result["rows"])
    if worst <= GOAL:
        return f"met: worst ratio {worst:.3f} ≤ {GOAL}"
    return f"missed by {worst - GOAL:.3f} (worst ratio {worst:.3f} > {GOAL})"
