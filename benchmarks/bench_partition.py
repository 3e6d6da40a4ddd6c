"""Benchmark 5, partition quality: tfsmp's plan vs the optimal contiguous split vs equal layer counts.

For each model the three plans are scored by the planner's compute model (FLOPs per layer):
max/mean stage compute (1.00 = perfectly balanced) and boundary bytes per sample. "tfsmp" is
`plan_graph(method="auto")` (METIS repaired to ordered stages, or the contiguous DP when its
objective is better); "contiguous" is the exact contiguous DP alone; "equal layers" cuts the
topological layer order into runs of equal layer count, what a user splitting by hand would do.

Where a model trains in seconds here (the Transformer, and ResNet50 on 32×32 images), each plan
is also run: 2 ranks × 1 thread, the three `DistributedModel`s alternating A B C in rounds, and
the step time of each plan is reported relative to tfsmp's, with each plan's measured balance
(max/mean over stages of one microbatch's traced forward + backward time).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from benchmarks.common import launch, median, ratio_summary

__all__ = ["equal_count_assignment", "run", "summarize", "verdict", "worker"]

NAME = "partition"
TITLE = "Partition quality (max/mean stage compute; step time where runnable)"
PLANS = ("tfsmp", "contiguous", "equal layers")


def settings(quick: bool) -> dict[str, Any]:
    runs = [{"model": "TransformerEncoder", "batch": 128, "microbatches": 4}]
    if quick:
        return {"models": ["ResNet50", "MobileNetV2", "TransformerEncoder"], "stages": [2, 4],
                "runs": runs, "steps": 2, "rounds": 2}
    return {"models": ["ResNet50", "MobileNetV2", "DenseNet121", "TransformerEncoder"],
            "stages": [2, 4, 8],
            "runs": [*runs, {"model": "ResNet50@32", "batch": 64, "microbatches": 4}],
            "steps": 3, "rounds": 7}


def run(quick: bool) -> dict[str, Any]:
    args = settings(quick)
    result = launch(2, "bench_partition", "worker", args, timeout=900)
    result["settings"] = args
    return result


def equal_count_assignment(groups: list[list[str]], num_stages: int) -> dict[str, int]:
    """Stage of each layer when the topological order of ``groups`` (layers that must stay
    together, inputs already removed) is cut into ``num_stages`` runs of about equal layer count.

    Example::

        equal_count_assignment([["a"], ["b"], ["c", "d"]], 2)   # {"a": 0, "b": 0, "c": 1, "d": 1}
    """
    total = sum(len(g) for g in groups)
    out: dict[str, int] = {}
    done, previous = 0, 0
    for i, group in enumerate(groups):
        stage = min(num_stages - 1, done * num_stages // total, previous + 1)
        stage = max(stage, num_stages - (len(groups) - i))  # leave a group for each later stage
        for name in group:
            out[name] = stage
        done, previous = done + len(group), stage
    return out


def plans_of(graph: Any, num_stages: int) -> dict[str, Any]:
    """The three plans of `PLANS` for one traced graph."""
    from tfsmp.partitioning.plan import StagePlan
    from tfsmp.partitioning.planner import plan_graph

    groups = [[n for n in g if not graph.nodes[n].is_input] for g in graph.groups()]
    equal = equal_count_assignment([g for g in groups if g], num_stages)
    return {
        "tfsmp": plan_graph(graph, num_stages, optimize="speed"),
        "contiguous": plan_graph(graph, num_stages, optimize="speed", method="contiguous"),
        "equal layers": StagePlan.from_assignment(graph, equal, num_stages, planner="equal-count"),
    }


def score(plan: Any, graph: Any) -> dict[str, float]:
    """Max/mean stage compute and boundary bytes per sample of a plan."""
    from tfsmp.partitioning.report import stage_shares

    shares = stage_shares(plan, graph, optimize="speed")
    cut = sum(b.bytes_per_sample * len(b.consumers) for b in plan.boundaries)
    return {"max_over_mean": max(shares) * len(shares), "cut_bytes": float(cut),
            "planner": plan.planner}


def worker(args: dict[str, Any]) -> dict[str, Any]:
    from benchmarks import tfhelp

    tfhelp.setup_threads()
    rank = tfhelp.world().Get_rank()
    quality = _quality(args) if rank == 0 else []
    tfhelp.sleepy_barrier()
    runs = [_timed_run(args, spec) for spec in args["runs"]]
    return {"quality": quality, "runs": runs}


def _build(name: str) -> Any:
    from benchmarks import models

    if name == "ResNet50@32":
        return models.resnet50_small()
    return models.PLAN_MODELS[name]()


def _quality(args: dict[str, Any]) -> list[dict[str, Any]]:
    import keras

    from tfsmp.graph.planning import trace_graph

    rows = []
    for name in args["models"]:
        graph = trace_graph(_build(name))
        keras.backend.clear_session()
        for p in args["stages"]:
            plans = plans_of(graph, p)
            rows.append({"model": name, "stages": p, "layers": len(graph) - len(graph.inputs),
                         **{k: score(v, graph) for k, v in plans.items()}})
    return rows


def _data(name: str, rows: int) -> Any:
    from benchmarks import models

    return models.transformer_data(rows) if name == "TransformerEncoder" else models.cnn_data(rows)


def _timed_run(args: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """Trains the model once per plan (2 ranks), alternating plans in rounds."""
    from benchmarks import tfhelp
    from tfsmp.graph.planning import trace_graph
    from tfsmp.timeline.events import Tracer

    world = tfhelp.world()
    name, batch, steps = spec["model"], spec["batch"], args["steps"]
    path = world.bcast(tempfile.mkstemp(prefix="tfsmp_plan_", suffix=".json")[1]
                       if world.Get_rank() == 0 else None, root=0)
    smp = tfhelp.reinit({"partitions": 2, "microbatches": spec["microbatches"],
                         "optimize": "speed", "partition_file": path})
    scores: dict[str, Any] = {}
    graph = trace_graph(_build(name)) if world.Get_rank() == 0 else None
    plans = plans_of(graph, 2) if graph is not None else None
    x, y = _data(name, batch * (steps + 1))
    trace_root = world.bcast(tempfile.mkdtemp(prefix="tfsmp_plans_") if world.Get_rank() == 0
                             else None, root=0)
    trained = {}
    for i, key in enumerate(PLANS):
        if plans is not None:
            with open(path, "w") as f:
                f.write(plans[key].to_json())
            scores[key] = score(plans[key], graph)
        world.Barrier()
        model = smp.DistributedModel(lambda: _build(name))
        model.compile(optimizer="adam", loss="mse")
        tfhelp.fit_step_times(model, x, y, batch, 1)  # builds the engine: reads the plan file
        model._engine._tracer = Tracer(os.path.join(trace_root, str(i)), world.Get_rank())
        trained[key] = model
    times: dict[str, list[float]] = {key: [] for key in PLANS}
    for _ in range(args["rounds"]):
        for key in PLANS:
            tfhelp.sleepy_barrier()
            times[key].append(min(tfhelp.fit_step_times(trained[key], x, y, batch, steps)))
    for model in trained.values():
        model._engine._tracer.flush()
    tfhelp.sleepy_barrier()
    if world.Get_rank() == 0:
        os.remove(path)
        for i, key in enumerate(PLANS):
            scores[key]["measured_max_over_mean"] = measured_balance(os.path.join(trace_root, str(i)))
        shutil.rmtree(trace_root, ignore_errors=True)
    base = times["tfsmp"]
    return {"model": name, "batch": batch, "microbatches": spec["microbatches"],
            "scores": scores, "step": {k: median(v) for k, v in times.items()},
            "relative": {k: ratio_summary([t / b for t, b in zip(v, base)])
                         for k, v in times.items()}}


def measured_balance(trace_dir: str) -> float:
    """Max/mean over stages of one microbatch's measured forward + backward time (the last
    stage's forward span holds its fused forward and backward)."""
    from tfsmp.timeline import render as tr
    from tfsmp.timeline.events import load_events

    forward, backward = tr.stage_times(tr.training_steps(load_events(trace_dir)))
    per_stage = [f + b for f, b in zip(forward, backward)]
    return max(per_stage) * len(per_stage) / sum(per_stage)


def summarize(result: dict[str, Any]) -> list[str]:
    """Markdown tables of the result."""
    lines = ["Stage compute from the planner's FLOP model (optimize=speed); max/mean 1.00 is "
             "perfect balance; KB = boundary bytes per sample.", "",
             "| model | layers | stages | tfsmp max/mean | contiguous max/mean | equal-layers max/mean | tfsmp KB | contiguous KB | equal-layers KB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["quality"]:
        t, c, e = r["tfsmp"], r["contiguous"], r["equal layers"]
        lines.append(f"| {r['model']} | {r['layers']} | {r['stages']} | {t['max_over_mean']:.3f} "
                     f"({t['planner']}) | {c['max_over_mean']:.3f} | {e['max_over_mean']:.3f} | "
                     f"{t['cut_bytes'] / 1024:.0f} | {c['cut_bytes'] / 1024:.0f} | "
                     f"{e['cut_bytes'] / 1024:.0f} |")
    s = result["settings"]
    lines += ["", f"Measured (2 ranks × 1 thread, Adam, {s['rounds']} rounds × {s['steps']} steps "
              f"per plan, plans alternating):", "",
              "| model | batch / m | plan | max/mean (FLOP model) | max/mean (measured F+B) | step (s) | step / tfsmp step [q1, q3] |",
              "|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        for key in PLANS:
            q = r["relative"][key]
            sc = r["scores"].get(key, {})
            mm = sc.get("max_over_mean", float("nan"))
            measured = sc.get("measured_max_over_mean", float("nan"))
            lines.append(f"| {r['model']} | {r['batch']} / {r['microbatches']} | {key} | {mm:.3f} | "
                         f"{measured:.3f} | {r['step'][key]:.3f} | "
                         f"{q['median']:.3f} [{q['q1']:.3f}, {q['q3']:.3f}] |")
    return lines


def verdict(result: dict[str, Any]) -> str:
    worse = [f"{r['model']}/{r['stages']}" for r in result["quality"]
             if r["tfsmp"]["max_over_mean"] > r["contiguous"]["max_over_mean"] + 1e-6]
    if worse:
        return f"no goal set; tfsmp's plan is less balanced than the contiguous DP on {', '.join(worse)}"
    return "no goal set; tfsmp's plan is as balanced as the optimal contiguous split or better everywhere"
