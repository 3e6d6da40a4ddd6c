"""`tfsmp schedule`: generate, validate and simulate a pipeline schedule; print and draw it.

Example::

    tfsmp schedule --partitions 4 --microbatches 8 --pipeline interleaved --virtual-stages 2
    tfsmp schedule -p 4 -m 8 --pipeline simple --out docs/schedules/simple_p4_m8.png
    tfsmp schedule -p 4 -m 8 --json

Stages are balanced: one microbatch's forward takes 1 time unit per rank (1/v per virtual
stage) and its backward ``--backward-ratio`` units. Prints the staircase, the makespan, the
bubble (idle) fraction beside the formula, and the peak activation sets held per rank; with
``--json``, one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["formula_bubble", "register", "run"]

_PICTURE_SUFFIXES = (".png", ".svg", ".pdf")


def formula_bubble(num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """``(p-1)/(v·m + p-1)``: the idle share of the step for balanced stages, free messages and
    ``m`` a multiple of ``p`` when ``v > 1`` (see docs/schedules.md)."""
    p, m, v = num_ranks, num_microbatches, virtual_stages
    return (p - 1) / (v * m + p - 1)


def register(subparsers: Any) -> None:
    """Adds the `schedule` sub-command."""
    p = subparsers.add_parser(
        "schedule", help="draw a pipeline schedule and predict its bubble and activation memory",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--partitions", "-p", type=int, required=True, help="pipeline ranks (stages)")
    p.add_argument("--microbatches", "-m", type=int, required=True, help="microbatches per step")
    p.add_argument("--pipeline", choices=("simple", "interleaved"), default="interleaved",
                   help="SMP's schedule: simple = GPipe, interleaved = 1F1B (default)")
    p.add_argument("--virtual-stages", "-v", type=int, default=1,
                   help="model chunks per rank (Megatron interleaving; default 1)")
    p.add_argument("--active-microbatches", type=int, default=None,
                   help="cap on microbatches in flight per rank")
    p.add_argument("--backward-ratio", type=float, default=2.0,
                   help="backward time / forward time (default 2)")
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
        format_schedule,
        generate,
        lower,
        peak_in_flight,
        render_staircase,
        render_timeline,
        simulate,
    )

    p, m, v = args.partitions, args.microbatches, args.virtual_stages
    if args.out and Path(args.out).suffix.lower() not in _PICTURE_SUFFIXES:
        raise ScheduleError(
            f"--out must end in {', '.join(_PICTURE_SUFFIXES)}. Received: --out={args.out}")
    compute = generate(args.pipeline, p, m, v, args.active_microbatches)
    lowered = lower(compute, None, p)
    result = simulate(compute, forward_time=1.0 / v, backward_time=args.backward_ratio / v,
                      comm_time=args.comm_time)
    formula = formula_bubble(p, m, v)
    out = None
    if args.out:
        title = (f"{args.pipeline}, p={p}, m={m}, v={v}: bubble {result.bubble_fraction:.3f}, "
                 f"peak activations {result.peak_activations}")
        out = str(render_timeline(result, args.out, title=title))
    summary: dict[str, Any] = {
        "pipeline": args.pipeline, "partitions": p, "microbatches": m, "virtual_stages": v,
        "active_microbatches": args.active_microbatches,
        "forward_time": 1.0, "backward_time": args.backward_ratio, "comm_time": args.comm_time,
        **result.to_dict(),
        "formula_bubble_fraction": formula,
        "peak_in_flight": peak_in_flight(compute),
        "out": out,
    }
    lines = [
        f"{args.pipeline} pipeline: p={p} ranks, m={m} microbatches, v={v} "
        f"({p * v} stages); per rank a forward takes 1, a backward {args.backward_ratio:g}",
        render_staircase(result),
        f"makespan: {result.makespan:g} (ideal {m * (1 + args.backward_ratio):g})",
        f"bubble fraction: {result.bubble_fraction:.4f} (formula (p-1)/(v*m+p-1) = {formula:.4f}"
        f"{'' if v == 1 or m % p == 0 else '; exact only when m % p == 0'})",
        f"peak activations per rank: {result.peak_activations} (stage-microbatch activation "
        f"sets held; microbatches in flight {summary['peak_in_flight']})",
    ]
    if args.lowered:
        lines += ["lowered schedule:", format_schedule(lowered)]
    if out:
        lines.append(f"wrote {out}")
    return summary, "\n".join(lines)
