"""Benchmark 2, pipeline speed-up: 2 ranks × 1 thread vs plain Keras in one process × 1 thread.

The model is ``depth`` equal Dense(width) layers (balanced halves), the batch is fixed and split
into m microbatches; for each pipeline and m the figure is speed-up / ideal, where speed-up is
the plain-Keras step time over the pipelined step time (median over rounds of one
`train_on_batch` step each, alternating; see [Note: measuring on a shared machine]) and the ideal
is p·m/(m+p−1). η, measured in the same job, says how much of two cores the machine gave two
concurrent single-thread processes; "of ideal × η" is the speed-up over what those cores allow.

Zero-bubble ``zb-h1`` splits each backward into B and W and fills 1F1B's bubble with W, so it can
beat 1F1B's ideal: its own ideal (F = B = W) is ``3m / (3m + p − 1)`` of p, against 1F1B's
``m / (m + p − 1)``. The second table divides zb-h1's speed-up by 1F1B's (``interleaved``) at
the same m, round by round (both against the same plain-Keras steps of their round).
"""

from __future__ import annotations

import gc
from typing import Any

from benchmarks.common import launch, median, ratio_summary

__all__ = ["ideal_speedup", "run", "summarize", "verdict", "worker"]

NAME = "speedup"
TITLE = "Pipeline speed-up (2 ranks × 1 thread vs plain Keras × 1 thread)"
GOAL = 0.88  # 1F1B's speed-up / ideal, at m = 8
ZB_GOAL = 1.05  # zb-h1 speed-up / 1F1B speed-up, at m = 4 and m = 8


def ideal_speedup(p: int, m: int) -> float:
    """``p·m/(m+p−1)``: p balanced stages, free messages, fill-drain bubble of p−1 slots."""
    return p * m / (m + p - 1)


def settings(quick: bool) -> dict[str, Any]:
    return {"width": 1024, "depth": 8, "batch": 2048, "ms": [1, 2, 4, 8, 16],
            "pipelines": ["interleaved", "zb-h1", "simple"], "optimizer": "adam",
            "optimize": "speed", "rounds": 5 if quick else 11, "eta_rounds": 3 if quick else 6}


def run(quick: bool) -> dict[str, Any]:
    args = settings(quick)
    result = launch(2, "bench_speedup", "worker", args, timeout=900)
    result["settings"] = args
    return result


def worker(args: dict[str, Any]) -> dict[str, Any]:
    from benchmarks import tfhelp

    tfhelp.setup_threads()
    rank = tfhelp.world().Get_rank()
    width, depth, batch = args["width"], args["depth"], args["batch"]
    x, y = tfhelp.make_data(batch, width)
    baseline = tfhelp.dense_stack(width, depth)  # every rank: both run it for η
    baseline.compile(optimizer=args["optimizer"], loss="mse", jit_compile=False)
    tfhelp.batch_step_time(baseline, x, y)
    half = args["eta_rounds"] // 2 + args["eta_rounds"] % 2
    eta = [tfhelp.concurrency_efficiency(baseline, x, y, half)]
    rows = []
    for pipeline in args["pipelines"]:
        for m in args["ms"]:
            rows.append(_measure(args, pipeline, m, baseline, x, y, rank))
            gc.collect()
    eta.append(tfhelp.concurrency_efficiency(baseline, x, y, args["eta_rounds"] - half))
    return {"rows": rows, "eta": ratio_summary([e for e in eta if e is not None])}


def _measure(args: dict[str, Any], pipeline: str, m: int, baseline: Any, x: Any, y: Any,
             rank: int) -> dict[str, Any]:
    from benchmarks import tfhelp

    smp = tfhelp.reinit({"partitions": 2, "microbatches": m, "pipeline": pipeline,
                         "optimize": args["optimize"]})
    model = smp.DistributedModel(lambda: tfhelp.dense_stack(args["width"], args["depth"]))
    model.compile(optimizer=args["optimizer"], loss="mse")
    for _ in range(2):  # build, trace and compile
        tfhelp.batch_step_time(model, x, y)
    base: list[float] = []
    pipe: list[float] = []
    for _ in range(args["rounds"]):
        tfhelp.sleepy_barrier()
        pipe.append(tfhelp.batch_step_time(model, x, y))
        tfhelp.sleepy_barrier()
        if rank == 0:
            base.append(tfhelp.batch_step_time(baseline, x, y))
    pipe = tfhelp.slowest_rank(pipe)  # [Note: the slowest rank's step] in tfhelp.py
    if rank != 0:
        return {}
    ratios = [b / p for b, p in zip(base, pipe)]
    return {"pipeline": pipeline, "m": m, "microbatch": args["batch"] // m, "ratios": ratios,
            "baseline_step": median(base), "pipeline_step": median(pipe),
            "speedup": ratio_summary(ratios), "ideal": ideal_speedup(2, m),
            "fraction_of_ideal": median(ratios) / ideal_speedup(2, m)}


def summarize(result: dict[str, Any]) -> list[str]:
    """Markdown table of the result."""
    st, eta = result["settings"], result["eta"]
    lines = [f"Model Dense({st['width']})×{st['depth']}, global batch {st['batch']}, "
             f"optimize={st['optimize']}, {st['optimizer']}; pipeline: 2 ranks × 1 thread; Keras: "
             f"1 process × 1 thread, jit_compile=False; `train_on_batch` steps alternating, "
             f"{st['rounds']} rounds. Cores available: two concurrent 1-thread Keras processes ran at "
             f"η = {eta['median']:.2f} [{eta['q1']:.2f}, {eta['q3']:.2f}] of one alone "
             f"({eta['n']} rounds; 1.00 = two free cores).", "",
             "| pipeline | m | microbatch | Keras step (s) | pipeline step (s) | speed-up [q1, q3] | ideal | of ideal | of ideal × η |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        s = r["speedup"]
        lines.append(f"| {r['pipeline']} | {r['m']} | {r['microbatch']} | {r['baseline_step']:.3f} | "
                     f"{r['pipeline_step']:.3f} | {s['median']:.2f} [{s['q1']:.2f}, {s['q3']:.2f}] | "
                     f"{r['ideal']:.2f} | {r['fraction_of_ideal']:.2f} | "
                     f"{r['fraction_of_ideal'] / eta['median']:.2f} |")
    gains = zero_bubble_gains(result)
    if gains:
        lines += ["", "| m | zb-h1 speed-up / 1F1B speed-up [q1, q3] | ratio of medians | "
                      "ideal (F = B = W) |", "|---|---|---|---|"]
        for g in gains:
            m, s = g["m"], g["gain"]
            ideal = (3 * m / (3 * m + 1)) / (m / (m + 1))
            lines.append(f"| {m} | {s['median']:.3f} [{s['q1']:.3f}, {s['q3']:.3f}] | "
                         f"{g['of_median']:.3f} | {ideal:.3f} |")
    return lines


def zero_bubble_gains(result: dict[str, Any]) -> list[dict[str, Any]]:
    """zb-h1's speed-up over 1F1B's per m: per-round ratios paired by round index."""
    rows = {(r["pipeline"], r["m"]): r for r in result["rows"]}
    out = []
    for (pipeline, m), zb in sorted(rows.items(), key=lambda kv: kv[0][1]):
        base = rows.get(("interleaved", m))
        if pipeline != "zb-h1" or base is None:
            continue
        paired = [a / b for a, b in zip(zb["ratios"], base["ratios"])]
        out.append({"m": m, "gain": ratio_summary(paired),
                    "of_median": zb["speedup"]["median"] / base["speedup"]["median"]})
    return out


def verdict(result: dict[str, Any]) -> str:
    f1b = [r for r in result["rows"] if r["m"] == 8 and r["pipeline"] == "interleaved"]
    worst = min(r["fraction_of_ideal"] for r in f1b)
    parts = ["1F1B at m = 8: " + (f"met ({worst:.2f} of ideal ≥ {GOAL})" if worst >= GOAL else
                                   f"missed by {GOAL - worst:.2f} ({worst:.2f} of ideal < {GOAL})")]
    for g in zero_bubble_gains(result):
        if g["m"] in (4, 8):
            gain = g["gain"]["median"]
            parts.append(f"zb-h1 / 1F1B at m = {g['m']}: " + (
                f"met ({gain:.3f} ≥ {ZB_GOAL})" if gain >= ZB_GOAL else
                f"missed by {ZB_GOAL - gain:.3f} ({gain:.3f} < {ZB_GOAL})"))
    return "; ".join(parts)
