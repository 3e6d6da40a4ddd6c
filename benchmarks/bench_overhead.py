"""Benchmark 1, overhead: one stage, one microbatch — `DistributedModel.fit` vs plain Keras `fit`.

One process, one thread. Per round, the same model's steady-state `fit` steps run as plain Keras
(A), as a `DistributedModel` (B), and as the same `DistributedModel` with its timeline tracer
switched on (C), in the order A B C B A: each arm keeps its fastest step of the round, and the
order puts A and B at the same mean time (a load that rises or falls through the round weighs
on both alike). The figure is the median over rounds of B/A (and C/B: what tracing costs when
on; when off the executor holds no tracer and runs the same code as B). The same ratio of the
steps' process CPU time is reported beside it: other jobs on a shared machine disturb it far
less than wall-clock time.
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
    cases: list[dict[str, Any]] = [{"width": 1024, "depth": 8, "batch": 256}]
    if not quick:  # its steps are 8 times longer, and less noisy
        cases.append({"width": 1024, "depth": 8, "batch": 2048, "rounds": 12})
    return {"cases": cases, "optimizer": "adam", "steps": 3, "rounds": 20 if quick else 30}


def run(quick: bool) -> dict[str, Any]:
    args = settings(quick)
    result = launch(1, "bench_overhead", "worker", args, timeout=1500)
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

    def fastest(m: Any, traced: bool = False) -> tuple[float, float]:
        engine._tracer = tracer if traced else None
        wall, cpu = tfhelp.fit_step_clocks(m, x, y, batch, steps)
        engine._tracer = None
        tracer.events.clear()
        return min(wall), min(cpu)

    a: list[tuple[float, float]] = []  # per round: an arm's fastest step, wall and CPU time
    b: list[tuple[float, float]] = []
    traced: list[float] = []  # C against its neighbours, each the fastest of as many steps
    for _ in range(case.get("rounds", args["rounds"])):
        first_a, first_b = fastest(keras_model), fastest(model)
        c = fastest(model, traced=True)
        second_b, second_a = fastest(model), fastest(keras_model)
        a.append(_fastest_of(first_a, second_a))
        b.append(_fastest_of(first_b, second_b))
        traced.append(c[0] / ((first_b[0] + second_b[0]) / 2))
    shutil.rmtree(os.path.dirname(tracer.path), ignore_errors=True)
    return {**case, "keras_step": median([t[0] for t in a]),
            "tfsmp_step": median([t[0] for t in b]),
            "overhead": ratio_summary([bi[0] / ai[0] for ai, bi in zip(a, b)]),
            "overhead_ms": 1e3 * median([bi[0] - ai[0] for ai, bi in zip(a, b)]),
            "tracing_on": ratio_summary(traced),
            "keras_cpu": median([t[1] for t in a]),
            "overhead_cpu": ratio_summary([bi[1] / ai[1] for ai, bi in zip(a, b)])}


def _fastest_of(*times: tuple[float, float]) -> tuple[float, float]:
    """The fastest wall-clock step and the fastest CPU-time step of an arm's steps."""
    return min(t[0] for t in times), min(t[1] for t in times)


def summarize(result: dict[str, Any]) -> list[str]:
    """Markdown table of the result."""
    s = result["settings"]
    lines = [f"Model Dense({s['cases'][0]['width']})×{s['cases'][0]['depth']}, optimizer "
             f"{s['optimizer']}, 1 thread, {s['rounds']} rounds (batch 2048: "
             f"{_rounds(s, 2048)}) of A B C B A, {s['steps']} steps per arm each time "
             f"(A Keras, B tfsmp, C tfsmp traced; each arm's fastest step of the round).", "",
             "| batch | Keras step (s) | tfsmp step (s) | tfsmp / Keras [q1, q3] | extra ms/step | "
             "by CPU time [q1, q3] | tracing on / off |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        o, t = r["overhead"], r["tracing_on"]
        cpu = r.get("overhead_cpu")
        by_cpu = f"{cpu['median']:.3f} [{cpu['q1']:.3f}, {cpu['q3']:.3f}]" if cpu else "-"
        lines.append(f"| {r['batch']} | {r['keras_step']:.4f} | {r['tfsmp_step']:.4f} | "
                     f"{o['median']:.3f} [{o['q1']:.3f}, {o['q3']:.3f}] | {r['overhead_ms']:.1f} | "
                     f"{by_cpu} | {t['median']:.3f} |")
    return lines


def _rounds(s: dict[str, Any], batch: int) -> Any:
    found = [c.get("rounds", s["rounds"]) for c in s["cases"] if c["batch"] == batch]
    return found[0] if found else "not run"


def verdict(result: dict[str, Any]) -> str:
    worst = max(r["overhead"]["median"] for r in result["rows"])
    if worst <= GOAL:
        return f"met: worst ratio {worst:.3f} ≤ {GOAL}"
    return f"missed by {worst - GOAL:.3f} (worst ratio {worst:.3f} > {GOAL})"
