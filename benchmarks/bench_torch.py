"""Benchmark 11, the peer: tfsmp's schedules against PyTorch's `torch.distributed.pipelining`.

The same workload on both sides: Dense/Linear(1024)×8 (ReLU between), MSE, SGD (lr 0.01),
global batch 2048 in m = 8 microbatches, 2 stages on 2 ranks × 1 thread (torch: gloo; the
interleaved and zero-bubble schedules hold 2 stages of 2 layers per rank). One MPI job runs
both: every rank imports TensorFlow and torch, and per round each arm runs one training step
(schedule + optimizer step) in turn, rank by rank in lockstep: the tfsmp configuration under
test, then every torch schedule, then (rank 0 alone) plain Keras and plain torch in one process
× 1 thread ([Note: measuring on a shared machine] in common.py). Each side steps on its own
framework's tensors, made once before the rounds (torch's `from_numpy`, TensorFlow's
`tf.constant`); until 2026-12-05 the Keras and tfsmp arms were handed the NumPy arrays, so
each of their steps also converted 16 MB that torch's did not. The figures are per-round
ratios: torch's step time over tfsmp's (> 1: tfsmp is faster), against torch's 1F1B and
against the fastest torch schedule of that round; and each side's speed-up over its own
single-process step, as a fraction of the ideal p·m/(m+p−1).

tfsmp's configurations run with and without XLA (`xla`, what `compile(jit_compile=True)` asks
for): on some CPUs TensorFlow's own matrix-product kernel runs a microbatch's rows at half its
speed over a whole batch, and XLA's does not ([Note: XLA's products] below). An XLA
configuration's speed-up is over plain Keras compiled with `jit_compile=True`, measured in the
same rounds, so that each side's ideal is its own single process.

A step's time is the slowest rank's ([Note: the slowest rank's step] in tfhelp.py).

Needs torch (``pip install -e .[bench-torch]``: the CPU wheel); without it the benchmark
records one line saying so and measures nothing.
"""

from __future__ import annotations

import gc
import importlib.util
import os
from typing import Any

from benchmarks.common import launch, median, ratio_summary

__all__ = ["run", "summarize", "verdict", "worker"]

NAME = "torch"
TITLE = "Peer: tfsmp vs torch.distributed.pipelining (2 ranks × 1 thread, same workload)"
GOAL = 1.10  # torch's step / tfsmp's step: best against best, and 1F1B against 1F1B
SKIP = "torch is not installed (pip install -e .[bench-torch]): the peer benchmark measured nothing"

# tfsmp configurations: label -> (pipeline, virtual stages, with a taped twin, XLA, blas). A twin is
# the same schedule with the backward of before issue 30 ([Note: stashing] in
# tfsmp/runtime/stage.py; TFSMP_TAPED_BACKWARD=1 while it is built), a second model stepped in
# the same rounds: before and after, side by side.
# `blas`: the stage programs' products run tfsmp's OpenBLAS kernel (blas='openblas',
# [Note: OpenBLAS products] in tfsmp/runtime/kernels); its speed-up is over plain Keras with
# TensorFlow's own kernel, which Keras cannot change, so it can exceed the ideal.
TFSMP = {"1F1B": ("interleaved", 1, True, False, False),
         "GPipe": ("simple", 1, False, False, False),
         "zb-h1": ("zb-h1", 1, True, False, False),
         "interleaved v=2": ("interleaved", 2, False, False, False),
         "zb-v": ("zb-v", 2, False, False, False),
         "1F1B xla": ("interleaved", 1, False, True, False),
         "zb-h1 xla": ("zb-h1", 1, False, True, False),
         "interleaved v=2 xla": ("interleaved", 2, False, True, False),
         "1F1B blas": ("interleaved", 1, False, False, True),
         "GPipe blas": ("simple", 1, False, False, True),
         "zb-h1 blas": ("zb-h1", 1, False, False, True),
         "interleaved v=2 blas": ("interleaved", 2, False, False, True),
         "zb-v blas": ("zb-v", 2, False, False, True)}

# [Note: XLA's products] On the AMD EPYC host of 2026-12-06 (1 thread), TensorFlow's MatMul
# kernel ran `x @ W` (1024 x 1024) over 256 rows at 39-44 GFLOP/s and over 512 rows at 56-73,
# and `dy @ W^T` over 256 rows at 25-31; the same products compiled by XLA ran at 78-84 at both
# sizes, as torch's do (one `tf.matmul` in a `tf.function`, with and without
# `jit_compile=True`, each variant called 5 times per round for 15 rounds, the variants
# interleaved in one process, the median per variant). A 256-row microbatch (m = 8 of 2048 rows)
# is this benchmark's workload, so without XLA it measures TensorFlow's small-product kernel,
# and tfsmp's 1F1B took 1.28 s a step against 0.80 s with XLA in the same rounds.


def settings(quick: bool) -> dict[str, Any]:
    return {"width": 1024, "depth": 8, "batch": 2048, "m": 8, "lr": 0.01, "optimize": "speed",
            "tfsmp": list(TFSMP), "torch": ["GPipe", "1F1B", "Interleaved1F1B",
                                             "InterleavedZeroBubble", "ZBVZeroBubble"],
            "rounds": 5 if quick else 9, "steps": 2}


def run(quick: bool) -> dict[str, Any]:
    args = settings(quick)
    if importlib.util.find_spec("torch") is None:
        print(SKIP)
        return {"skipped": SKIP, "settings": args}
    result = launch(2, "bench_torch", "worker", args, timeout=2700)
    result["settings"] = args
    return result


def worker(args: dict[str, Any]) -> dict[str, Any]:
    from benchmarks import tfhelp, torchhelp

    threads = tfhelp.setup_threads()
    torchhelp.setup(threads)
    rank = tfhelp.world().Get_rank()
    width, depth, batch, m, lr = args["width"], args["depth"], args["batch"], args["m"], args["lr"]
    import tensorflow as tf

    x_np, y_np = tfhelp.make_data(batch, width)
    tx, ty = torchhelp.tensors(x_np, y_np)
    x, y = tf.constant(x_np), tf.constant(y_np)  # made once, as torch's are
    keras_plain = tfhelp.dense_stack(width, depth)
    keras_plain.compile(optimizer=_sgd(lr), loss="mse", jit_compile=False)
    keras_xla = tfhelp.dense_stack(width, depth)  # the plain side of tfsmp's XLA arms
    keras_xla.compile(optimizer=_sgd(lr), loss="mse", jit_compile=True)
    torch_plain = torchhelp.PlainArm.build(width, depth, lr)
    arms = {name: torchhelp.pipeline_arm(name, width, depth, m, lr) for name in args["torch"]}
    for _ in range(2):  # shapes, buffers, traces
        for arm in arms.values():
            tfhelp.sleepy_barrier()
            arm.step_time(tx, ty)
        if rank == 0:
            tfhelp.batch_step_time(keras_plain, x, y)
            tfhelp.batch_step_time(keras_xla, x, y)
            torch_plain.step_time(tx, ty)
    rows = []
    for label in args["tfsmp"]:
        plain = keras_xla if TFSMP[label][3] else keras_plain
        rows.append(_measure(args, label, arms, plain, torch_plain, x, y, tx, ty, rank))
        gc.collect()
    torchhelp.shutdown()
    return {"rows": rows} if rank == 0 else {}


def _sgd(lr: float) -> Any:
    import keras

    return keras.optimizers.SGD(learning_rate=lr)


def _measure(args: dict[str, Any], label: str, arms: dict[str, Any], keras_plain: Any,
             torch_plain: Any, x: Any, y: Any, tx: Any, ty: Any, rank: int) -> dict[str, Any]:
    from benchmarks import tfhelp

    pipeline, v, twin, xla, blas = TFSMP[label]
    smp = tfhelp.reinit({"partitions": 2, "microbatches": args["m"], "pipeline": pipeline,
                         "virtual_stages": v, "optimize": args["optimize"], "xla": xla,
                         "blas": "openblas" if blas else "tensorflow"})
    model = _model(smp, args, x, y, taped=False)
    taped = _model(smp, args, x, y, taped=True) if twin else None
    steps = args["steps"]

    def fastest(step: Any) -> float:  # [Note: measuring on a shared machine]
        tfhelp.sleepy_barrier()
        return min(tfhelp.slowest_rank([step() for _ in range(steps)]))

    mine: list[float] = []
    before: list[float] = []
    theirs: dict[str, list[float]] = {name: [] for name in arms}
    plain: dict[str, list[float]] = {"keras": [], "torch": []}
    for r in range(args["rounds"]):
        pair = [(model, mine)] + ([(taped, before)] if taped is not None else [])
        for m, times in pair if r % 2 == 0 else pair[::-1]:  # alternate which goes first
            times.append(fastest(lambda m=m: tfhelp.batch_step_time(m, x, y)))
        for name, arm in arms.items():
            theirs[name].append(fastest(lambda arm=arm: arm.step_time(tx, ty)))
        tfhelp.sleepy_barrier()
        if rank == 0:
            plain["keras"].append(min(tfhelp.batch_step_time(keras_plain, x, y)
                                      for _ in range(steps)))
            plain["torch"].append(min(torch_plain.step_time(tx, ty) for _ in range(steps)))
    tfhelp.sleepy_barrier()
    return {"tfsmp": label, "pipeline": pipeline, "v": v, "xla": xla, "blas": blas,
            "tfsmp_steps": mine,
            "taped_steps": before, "torch_steps": theirs, "plain_steps": plain}


def _model(smp: Any, args: dict[str, Any], x: Any, y: Any, taped: bool) -> Any:
    """A DistributedModel of the stack, built and traced; ``taped``: with the taped backward."""
    from benchmarks import tfhelp

    if taped:
        os.environ["TFSMP_TAPED_BACKWARD"] = "1"
    try:
        model = smp.DistributedModel(lambda: tfhelp.dense_stack(args["width"], args["depth"]))
        model.compile(optimizer=_sgd(args["lr"]), loss="mse")
        for _ in range(2):  # build, trace and compile
            tfhelp.batch_step_time(model, x, y)
    finally:
        os.environ.pop("TFSMP_TAPED_BACKWARD", None)
    return model


def ideal_speedup(p: int, m: int) -> float:
    return p * m / (m + p - 1)


def per_round(row: dict[str, Any]) -> dict[str, Any]:
    """The row's per-round ratios: torch's 1F1B and best step over tfsmp's, and each side's
    speed-up over its own single-process step."""
    mine, theirs, plain = row["tfsmp_steps"], row["torch_steps"], row["plain_steps"]
    best = [min(steps[r] for steps in theirs.values()) for r in range(len(mine))]
    return {"vs_1f1b": [t / s for t, s in zip(theirs["1F1B"], mine)],
            "compiled_gain": [b / s for b, s in zip(row.get("taped_steps", []), mine)],
            "vs_best": [b / s for b, s in zip(best, mine)],
            "speedup": [k / s for k, s in zip(plain["keras"], mine)],
            "torch_speedup": {name: [p / t for p, t in zip(plain["torch"], steps)]
                              for name, steps in theirs.items()}}


def analyse(result: dict[str, Any]) -> dict[str, Any]:
    """Per tfsmp configuration its ratio summaries; torch's schedules pooled over all rounds;
    and the two headline figures (best against best, 1F1B against 1F1B)."""
    st = result["settings"]
    ideal = ideal_speedup(2, st["m"])
    rows, pooled = [], {name: [] for name in st["torch"]}
    pooled_steps: dict[str, list[float]] = {name: [] for name in st["torch"]}
    for row in result["rows"]:
        pr = per_round(row)
        for name, values in pr["torch_speedup"].items():
            pooled[name] += values
            pooled_steps[name] += row["torch_steps"][name]
        rows.append({"tfsmp": row["tfsmp"], "step": median(row["tfsmp_steps"]),
                     "vs_1f1b": ratio_summary(pr["vs_1f1b"]), "vs_best": ratio_summary(pr["vs_best"]),
                     "speedup": ratio_summary(pr["speedup"]),
                     "of_ideal": median(pr["speedup"]) / ideal,
                     "compiled_gain": ratio_summary(pr["compiled_gain"])})
    torch_rows = [{"torch": name, "step": median(pooled_steps[name]),
                   "speedup": ratio_summary(vals), "of_ideal": median(vals) / ideal}
                  for name, vals in pooled.items()]
    best = max(rows, key=lambda r: r["vs_best"]["median"])
    # tfsmp's 1F1B: the fastest of its arms (TensorFlow's kernel, XLA, OpenBLAS)
    f1b = max((r for r in rows if r["tfsmp"] in ("1F1B", "1F1B xla", "1F1B blas")),
              key=lambda r: r["vs_1f1b"]["median"])
    return {"rows": rows, "torch_rows": torch_rows, "best": best, "f1b": f1b, "ideal": ideal}


def summarize(result: dict[str, Any]) -> list[str]:
    """Markdown tables of the result (one line when torch was missing)."""
    if "skipped" in result:
        return [result["skipped"]]
    st, a = result["settings"], analyse(result)
    lines = [f"Dense/Linear({st['width']})×{st['depth']}, MSE, SGD lr {st['lr']}, batch "
             f"{st['batch']}, m = {st['m']}, 2 ranks × 1 thread (torch: gloo, "
             f"torch.distributed.pipelining; tfsmp: optimize={st['optimize']}); one training "
             f"step per arm per round (the fastest of {st.get('steps', 1)}), {st['rounds']} rounds per tfsmp configuration, every torch "
             "schedule in every round; plain Keras and plain torch (1 process × 1 thread) on "
             "rank 0 in the same rounds (the XLA arms' speed-up is over plain Keras with "
             "jit_compile=True). Ratios > 1: tfsmp is faster. The machine is shared "
             "and noisy: [q1, q3] are the quartiles over rounds.", "",
             "| tfsmp | step (s) | torch 1F1B / tfsmp [q1, q3] | fastest torch / tfsmp [q1, q3] | speed-up over Keras [q1, q3] | of ideal | taped backward / compiled [q1, q3] |",
             "|---|---|---|---|---|---|---|"]
    for r in a["rows"]:
        f, b, s, g = r["vs_1f1b"], r["vs_best"], r["speedup"], r["compiled_gain"]
        gain = (f"{g['median']:.2f} [{g['q1']:.2f}, {g['q3']:.2f}]" if g["n"] else "—")
        lines.append(f"| {r['tfsmp']} | {r['step']:.3f} | {f['median']:.2f} [{f['q1']:.2f}, "
                     f"{f['q3']:.2f}] | {b['median']:.2f} [{b['q1']:.2f}, {b['q3']:.2f}] | "
                     f"{s['median']:.2f} [{s['q1']:.2f}, {s['q3']:.2f}] | {r['of_ideal']:.2f} | "
                     f"{gain} |")
    lines += ["", "| torch schedule | step (s) | speed-up over plain torch [q1, q3] | of ideal |",
              "|---|---|---|---|"]
    for r in a["torch_rows"]:
        s = r["speedup"]
        lines.append(f"| {r['torch']} | {r['step']:.3f} | {s['median']:.2f} [{s['q1']:.2f}, "
                     f"{s['q3']:.2f}] | {r['of_ideal']:.2f} |")
    return lines


def verdict(result: dict[str, Any]) -> str:
    if "skipped" in result:
        return "skipped: " + result["skipped"]
    a = analyse(result)
    parts = []
    for what, row, key in (("best tfsmp (" + a["best"]["tfsmp"] + ") / best torch", a["best"],
                            "vs_best"), ("tfsmp " + a["f1b"]["tfsmp"] + " / torch 1F1B", a["f1b"],
                                         "vs_1f1b")):
        got = row[key]["median"]
        parts.append(f"{what}: " + (f"met ({got:.2f} ≥ {GOAL})" if got >= GOAL else
                                     f"missed by {GOAL - got:.2f} ({got:.2f} < {GOAL})"))
    return "; ".join(parts)
