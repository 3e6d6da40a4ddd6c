"""Benchmark 6, bubble: measured idle share per rank vs the schedule simulator's prediction.

Two ranks train the benchmark-2 model with the timeline tracer on (`trace_dir`). From the
trace ([Note: measured idle] in `tfsmp.timeline.render`): per step, the window from the
first action of any rank to the last forward/backward of any rank, and per rank the share of that
window not spent in forward/backward (receive waits plus everything else). The prediction is
`tfsmp.schedule.simulate` of the same schedule, fed the measured median forward and backward time
of one microbatch per stage (so it sees the real imbalance, but free messages and no dispatch
cost). Plain Keras steps (1 process, 1 thread) run on rank 0 between the traced rounds, which
turns the same trace into a breakdown of the speed-up:

    speed-up / ideal = (schedule efficiency / ideal efficiency) × (window / step) / work inflation

with schedule efficiency = Σ busy / (p · window), ideal efficiency = m / (m + p − 1), window /
step = share of the measured `fit` step spent inside the pipeline window (the rest: optimizer
step, data, logs), and work inflation = Σ busy / Keras step (how much more compute time the
stages spend than one process does for the same batch).
"""

from __future__ import annotations

import gc
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import REPO_ROOT, launch, median

__all__ = ["breakdown", "run", "summarize", "verdict", "worker"]

NAME = "bubble"
TITLE = "Bubble (measured idle per rank vs simulator, 2 ranks)"
GOAL = 0.03  # |measured − predicted| idle share, per rank


def settings(quick: bool) -> dict[str, Any]:
    configs = [{"pipeline": "interleaved", "m": 8, "v": 1}, {"pipeline": "zb-h1", "m": 8, "v": 1},
               {"pipeline": "simple", "m": 8, "v": 1}]
    if not quick:
        configs += [{"pipeline": "interleaved", "m": 4, "v": 1},
                    {"pipeline": "interleaved", "m": 16, "v": 1},
                    {"pipeline": "interleaved", "m": 8, "v": 2}]
    return {"width": 1024, "depth": 8, "batch": 2048, "optimizer": "adam", "optimize": "speed",
            "configs": configs, "rounds": 4 if quick else 8, "eta_rounds": 2 if quick else 4,
            "pictures": str(REPO_ROOT / "docs"), "chrome": str(REPO_ROOT / "benchmarks" / "timeline_p2_m8.json")}


def run(quick: bool) -> dict[str, Any]:
    args = settings(quick)
    result = launch(2, "bench_bubble", "worker", args, timeout=900)
    result["settings"] = args
    return result


def breakdown(p: int, m: int, keras_step: float, fit_step: float, window: float,
              busy_total: float) -> dict[str, float]:
    """The factors of speed-up / ideal named in the module docstring."""
    ideal_eff = m / (m + p - 1)
    sched_eff = busy_total / (p * window)
    inflation = busy_total / keras_step
    in_window = window / fit_step
    return {"speedup": keras_step / fit_step, "ideal": p * ideal_eff,
            "fraction_of_ideal": keras_step / fit_step / (p * ideal_eff),
            "schedule": sched_eff / ideal_eff, "in_window": in_window, "inflation": inflation}


def worker(args: dict[str, Any]) -> dict[str, Any]:
    from benchmarks import tfhelp
    from benchmarks.common import ratio_summary

    tfhelp.setup_threads()
    rank = tfhelp.world().Get_rank()
    width, depth, batch = args["width"], args["depth"], args["batch"]
    x, y = tfhelp.make_data(batch, width)
    baseline = tfhelp.dense_stack(width, depth)  # every rank: both run it for η
    baseline.compile(optimizer=args["optimizer"], loss="mse", jit_compile=False)
    tfhelp.batch_step_time(baseline, x, y)
    eta = [tfhelp.concurrency_efficiency(baseline, x, y, args["eta_rounds"])]
    mu = {m: microbatch_cost(baseline, x, y, m) if rank == 0 else None
          for m in sorted({c["m"] for c in args["configs"]})}
    tfhelp.sleepy_barrier()
    rows = []
    for config in args["configs"]:
        rows.append(_config(args, config, baseline, x, y, rank))
        if rank == 0:
            rows[-1]["microbatch_cost"] = mu[config["m"]]
        gc.collect()
    eta.append(tfhelp.concurrency_efficiency(baseline, x, y, args["eta_rounds"]))
    return {"rows": rows, "eta": ratio_summary([e for e in eta if e is not None])}


def microbatch_cost(model: Any, x: Any, y: Any, m: int, rounds: int = 3) -> float:
    """μ: one process's forward + backward time for the batch cut into ``m`` microbatches over
    its time for the whole batch at once (compiled gradient function, no optimizer; fastest of
    ``rounds`` alternating tries). What smaller matrix products cost, pipeline or not."""
    import tensorflow as tf

    loss_fn = tf.keras.losses.MeanSquaredError()

    @tf.function(reduce_retracing=True)  # type: ignore[untyped-decorator]
    def grads(xb: tf.Tensor, yb: tf.Tensor) -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        return tape.gradient(loss, model.trainable_variables)  # type: ignore[no-any-return]

    parts = [(tf.constant(xs), tf.constant(ys)) for xs, ys in zip(np.split(x, m), np.split(y, m))]
    whole = (tf.constant(x), tf.constant(y))
    grads(*whole), grads(*parts[0])
    split_times, whole_times = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        for part in parts:
            grads(*part)
        split_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        grads(*whole)
        whole_times.append(time.perf_counter() - start)
    return min(split_times) / min(whole_times)


def _config(args: dict[str, Any], config: dict[str, Any], baseline: Any, x: Any, y: Any,
            rank: int) -> dict[str, Any]:
    from benchmarks import tfhelp

    trace_dir = tfhelp.world().bcast(tempfile.mkdtemp(prefix="tfsmp_bubble_") if rank == 0
                                     else None, root=0)
    smp = tfhelp.reinit({"partitions": 2, "microbatches": config["m"], "pipeline": config["pipeline"],
                         "virtual_stages": config["v"], "optimize": args["optimize"],
                         "trace_dir": trace_dir})
    model = smp.DistributedModel(lambda: tfhelp.dense_stack(args["width"], args["depth"]))
    model.compile(optimizer=args["optimizer"], loss="mse")
    for _ in range(2):  # warm-up steps (build, trace, compile): traced, left out below
        tfhelp.batch_step_time(model, x, y)
    keras_steps: list[float] = []
    fit_steps: list[float] = []
    for _ in range(args["rounds"]):
        if rank == 0:
            keras_steps.append(tfhelp.batch_step_time(baseline, x, y))
        tfhelp.sleepy_barrier()
        fit_steps.append(tfhelp.batch_step_time(model, x, y))
        tfhelp.sleepy_barrier()
    fit_steps = tfhelp.slowest_rank(fit_steps)  # [Note: the slowest rank's step] in tfhelp.py
    model._engine._tracer.flush()
    tfhelp.sleepy_barrier()
    if rank != 0:
        return {}
    try:
        return _analyse(args, config, trace_dir, keras_steps, fit_steps, model._engine.plan)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


def _analyse(args: dict[str, Any], config: dict[str, Any], trace_dir: str,
             keras_steps: list[float], fit_steps: list[float], plan: Any) -> dict[str, Any]:
    from tfsmp.timeline import render as tr
    from tfsmp.timeline.events import load_events

    events = load_events(trace_dir)
    steps = tr.training_steps(events)[2:]  # the first two are warm-up steps
    cmp = tr.compare_with_simulator(steps, config["pipeline"], config["v"], links=plan)
    busy = median([sum(tr.step_stats(s).busy.values()) for s in steps])
    result = {**config, "steps_analysed": len(steps), **cmp,
              "keras_step": median(keras_steps), "fit_step": median(fit_steps),
              "breakdown": breakdown(2, config["m"], median(keras_steps), median(fit_steps),
                                     cmp["window"], busy)}
    if config["m"] == 8 and config["v"] == 1 and config["pipeline"] in ("interleaved", "zb-h1"):
        result["pictures"] = _pictures(args, steps, cmp, events, plan, config["pipeline"])
    return result


def _pictures(args: dict[str, Any], steps: list[Any], cmp: dict[str, Any], events: Any,
              plan: Any, pipeline: str) -> list[str]:
    from tfsmp.schedule import fuse_last_stage, generate, render_timeline, simulate
    from tfsmp.timeline import render as tr

    out = Path(args["pictures"])
    suffix = "" if pipeline == "interleaved" else "_" + pipeline.replace("-", "")
    name = "interleaved (1F1B)" if pipeline == "interleaved" else pipeline
    measured = tr.render_gantt(
        steps[-1:], out / f"timeline_measured{suffix}.png",
        title=f"measured: 2 ranks, {name}, m = 8, one step; idle "
              f"{cmp['measured'][0]:.3f} / {cmp['measured'][1]:.3f} (rank 0 / 1)")
    given = cmp["simulated"]  # the comparison's own inputs, the drain's W's included
    sim = simulate(fuse_last_stage(generate(pipeline, 2, 8)), forward_time=given["forward"],
                   backward_time=given["backward"], weight_time=cmp["weight"], links=plan,
                   drain={int(s): mbs for s, mbs in given["drain"].items()})
    simulated = render_timeline(
        sim, out / f"timeline_simulated{suffix}.png",
        title=f"simulated with the measured stage times: idle "
              f"{sim.rank_bubble_fraction[0]:.3f} / {sim.rank_bubble_fraction[1]:.3f} (rank 0 / 1)")
    chrome_path = args["chrome"] if not suffix else args["chrome"].replace(".json", f"{suffix}.json")
    chrome = tr.write_chrome_trace([s for step in steps[-2:] for spans in step.values()
                                    for s in spans], chrome_path)
    return [str(measured), str(simulated), str(chrome)]


def summarize(result: dict[str, Any]) -> list[str]:
    """Markdown tables of the result."""
    s = result["settings"]
    lines = [f"Model Dense({s['width']})×{s['depth']}, batch {s['batch']}, optimize={s['optimize']}, "
             f"{s['optimizer']}, 2 ranks × 1 thread, tracer on; {s['rounds']} traced "
             f"`train_on_batch` steps per config, alternating with plain-Keras steps; idle = "
             f"share of the step window outside F/B/W (zb-h1: B = input gradients, W = weight "
             f"gradients; the last stage's F column is its fused forward+loss+B).", "",
             "| pipeline | m | v | F / B (/ W) per stage (ms) | measured idle r0 / r1 | of which receive wait | predicted idle r0 / r1 | largest gap (points) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ws = r.get("weight") or [0.0] * len(r["forward"])
        fb = ", ".join(f"{1e3 * f:.0f}/{1e3 * b:.0f}" + (f"/{1e3 * w:.0f}" if any(ws) else "")
                       for f, b, w in zip(r["forward"], r["backward"], ws))
        delta = max(abs(a - b) for a, b in zip(r["measured"], r["predicted"]))
        lines.append(f"| {r['pipeline']} | {r['m']} | {r['v']} | {fb} | "
                     f"{r['measured'][0]:.3f} / {r['measured'][1]:.3f} | "
                     f"{r['receive_wait'][0]:.3f} / {r['receive_wait'][1]:.3f} | "
                     f"{r['predicted'][0]:.3f} / {r['predicted'][1]:.3f} | {100 * delta:.1f} |")
    eta = result["eta"]
    lines += ["", "Speed-up breakdown (speed-up / ideal = schedule × in-window ÷ inflation). "
              f"Cores available in this job: η = {eta['median']:.2f} (two concurrent 1-thread "
              f"Keras processes vs one alone; work inflation from sharing cores alone would be "
              f"about 1/η = {1 / eta['median']:.2f}).", "",
              "| pipeline | m | v | Keras step (s) | pipeline step (s) | speed-up | of ideal | schedule eff. / ideal | window / step | work inflation | of which microbatch size μ |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        b = r["breakdown"]
        lines.append(f"| {r['pipeline']} | {r['m']} | {r['v']} | {r['keras_step']:.3f} | "
                     f"{r['fit_step']:.3f} | {b['speedup']:.2f} | {b['fraction_of_ideal']:.2f} | "
                     f"{b['schedule']:.3f} | {b['in_window']:.3f} | {b['inflation']:.3f} | "
                     f"{r.get('microbatch_cost', float('nan')):.3f} |")
    return lines


def verdict(result: dict[str, Any]) -> str:
    worst = max(abs(a - b) for r in result["rows"] for a, b in zip(r["measured"], r["predicted"]))
    if worst <= GOAL:
        return f"met: largest |measured − predicted| {100 * worst:.1f} points ≤ {100 * GOAL:.0f}"
    return f"missed by {100 * (worst - GOAL):.1f} points (largest gap {100 * worst:.1f} points)"
