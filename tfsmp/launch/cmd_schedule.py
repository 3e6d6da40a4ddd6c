"""`tfsmp schedule`: generate, validate and simulate a pipeline schedule; print and draw it.

Example::

    tfsmp schedule --partitions 4 --microbatches 8 --pipeline interleaved --virtual-stages 2
    tfsmp schedule -p 4 -m 8 --pipeline simple --out docs/schedules/simple_p4_m8.png
    tfsmp schedule -p 4 -m 8 --json
    tfsmp schedule --pipeline zb-h1 -p 4 -m 8          # zero bubble: F, B and W actions
    tfsmp schedule --pipeline zb-v -p 4 -m 8           # ZB-V: 2 chunks per rank in a V

Stages are balanced: one microbatch's forward takes 1 time unit per rank (1/v per virtual
stage) and its whole backward ``--backward-ratio`` units, of which the zero-bubble pipelines'
W takes ``--weight-ratio`` (default half). Prints the staircase, the makespan, the bubble
(idle) fraction beside the formula, and the peak activation sets held per rank; with
``--json``, one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["formula_bubble", "formula_bubble_zb_h1", "register", "run"]

_PICTURE_SUFFIXES = (".png", ".svg", ".pdf")


def formula_bubble(num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """``(p-1)/(v·m + p-1)``: the idle share of the step for balanced stages, free messages and
    ``m`` a multiple of ``p`` when ``v > 1`` (see docs/schedules.md)."""
    p, m, v = num_ranks, num_microbatches, virtual_stages
    return (p - 1) / (v * m + p - 1)


def formula_bubble_zb_h1(num_ranks: int, num_microbatches: int, backward_ratio: float = 2.0,
                         weight_ratio: float = 1.0) -> float:
    """ZB-H1's idle share for m >= p (Qi et al. 2023): each rank idles ``(p-1)(F + B - W)``
    beside ``m(F + B + W)`` of work, in forward units (B = backward_ratio - weight_ratio)."""
    p, m = num_ranks, num_microbatches
    idle = (p - 1) * max(0.0, 1.0 + backward_ratio - 2.0 * weight_ratio)
    return idle / (m * (1.0 + backward_ratio) + idle)


def register(subparsers: Any) -> None:
    """Adds the `schedule` sub-command."""
    from tfsmp.schedule.placement import PIPELINES

    p = subparsers.add_parser(
        "schedule", help="draw a pipeline schedule and predict its bubble and activation memory",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--partitions", "-p", type=int, required=True, help="pipeline ranks (stages)")
    p.add_argument("--microbatches", "-m", type=int, required=True, help="microbatches per step")
    p.add_argument("--pipeline", choices=PIPELINES, default="interleaved",
                   help="simple = GPipe, interleaved = 1F1B (default), zb-h1 = zero bubble at "
                        "1F1B's memory, zb-v = ZB-V (2 chunks per rank)")
    p.add_argument("--virtual-stages", "-v", type=int, default=None,
                   help="model chunks per rank (Megatron interleaving; default 1, 2 for zb-v)")
    p.add_argument("--active-microbatches", type=int, default=None,
                   help="cap on microbatches in flight per rank")
    p.add_argument("--backward-ratio", type=float, default=2.0,
                   help="whole backward time / forward time (default 2)")
    p.add_argument("--weight-ratio", type=float, default=None,
                   help="zb-*: W (weight gradient) time / forward time, part of the backward "
                        "(default: half the backward ratio)")
    p.add_argument("--comm-time", type=float, default=0.0,
                   help="time of one cross-rank message, in forward units per rank (default 0)")
    p.add_argument("--lowered", action="store_true",
                   help="also print the lowered schedule (sends, receives, REDUCE, STEP)")
    p.add_argument("--out", metavar="FILE", default=None,
                   help="draw the timeline to FILE (.png, .svg or .pdf; needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Runs `tfsmp schedule`; returns the exit code (2 on a bad argument)."""
    from tfsmp.errors import ScheduleError
    from tfsmp.launch.viz import viz_missing

    missing = viz_missing("tfsmp schedule", [args.out])
    if missing:
        print(missing, file=sys.stderr)
        return 2
    try:
        summary, text = _build(args)
    except ScheduleError as e:
        print(f"tfsmp schedule: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2) if args.json else text)
    return 0


def _build(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from tfsmp.errors import ScheduleError
    from tfsmp.schedule import (
        Placement,
        format_schedule,
        generate,
        lower,
        peak_in_flight,
        render_staircase,
        render_timeline,
        simulate,
    )

    p, m = args.partitions, args.microbatches
    v = args.virtual_stages if args.virtual_stages is not None else (
        2 if args.pipeline == "zb-v" else 1)
    if args.out and Path(args.out).suffix.lower() not in _PICTURE_SUFFIXES:
        raise ScheduleError(
            f"--out must end in {', '.join(_PICTURE_SUFFIXES)}. Received: --out={args.out}")
    zero_bubble = args.pipeline.startswith("zb-")
    weight = args.weight_ratio if args.weight_ratio is not None else args.backward_ratio / 2
    compute = generate(args.pipeline, p, m, v, args.active_microbatches)
    placement = Placement.for_pipeline(args.pipeline, p, v)
    lowered = lower(compute, None, p, placement=placement)
    result = simulate(compute, forward_time=1.0 / v, backward_time=args.backward_ratio / v,
                      weight_time=weight / v, comm_time=args.comm_time, placement=placement)
    formula, formula_text = _formula(args.pipeline, p, m, v, args.backward_ratio, weight)
    out = None
    if args.out:
        title = (f"{args.pipeline}, p={p}, m={m}, v={v}: bubble {result.bubble_fraction:.3f}, "
                 f"peak activations {result.peak_activations}")
        out = str(render_timeline(result, args.out, title=title))
    summary: dict[str, Any] = {
        "pipeline": args.pipeline, "partitions": p, "microbatches": m, "virtual_stages": v,
        "active_microbatches": args.active_microbatches,
        "forward_time": 1.0, "backward_time": args.backward_ratio,
        "weight_time": weight if zero_bubble else None, "comm_time": args.comm_time,
        **result.to_dict(),
        "formula_bubble_fraction": formula,
        "peak_in_flight": peak_in_flight(compute),
        "out": out,
    }
    split = f" (B {args.backward_ratio - weight:g} + W {weight:g})" if zero_bubble else ""
    lines = [
        f"{args.pipeline} pipeline: p={p} ranks, m={m} microbatches, v={v} "
        f"({p * v} stages); per rank a forward takes 1, a backward {args.backward_ratio:g}"
        f"{split}",
        render_staircase(result),
        f"makespan: {result.makespan:g} (ideal {m * (1 + args.backward_ratio):g})",
        f"bubble fraction: {result.bubble_fraction:.4f} ({formula_text})",
        f"peak activations per rank: {result.peak_activations} (stage-microbatch activation "
        f"sets held{' until W' if zero_bubble else ''}; microbatches in flight "
        f"{summary['peak_in_flight']})",
    ]
    if args.lowered:
        lines += ["lowered schedule:", format_schedule(lowered)]
    if out:
        lines.append(f"wrote {out}")
    return summary, "\n".join(lines)


def _formula(pipeline: str, p: int, m: int, v: int, backward: float,
             weight: float) -> tuple[float | None, str]:
    """The closed-form bubble beside the simulated one, and how to print it."""
    if pipeline == "zb-v":
        return None, "no closed form; shrinks toward 0 as m grows"
    if pipeline == "zb-h1":
        value = formula_bubble_zb_h1(p, m, backward, weight)
        return value, (f"formula (p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W)) = {value:.4f}"
                       f"{'' if m >= p else '; exact only when m >= p'}")
    value = formula_bubble(p, m, v)
    return value, (f"formula (p-1)/(v*m+p-1) = {value:.4f}"
                   f"{'' if v == 1 or m % p == 0 else '; exact only when m % p == 0'}")
