"""`tfsmp timeline`: the measured timeline of a traced run as a Gantt chart and a Chrome trace.

Example::

    TFSMP_TRACE=/tmp/trace tfsmp run -np 2 train.py      # or trace_dir= in the config
    tfsmp timeline /tmp/trace --out t.png                # t.png + t.json (open in Perfetto)
    tfsmp timeline /tmp/trace --steps 3 --compare interleaved

Prints, per training step, the step window and each rank's busy, receive-wait and idle share
(see [Note: measured idle] in `tfsmp.timeline.render`); ``--compare PIPELINE`` adds the
schedule simulator's prediction for the measured per-stage times. The picture shows the last
``--steps`` training steps; the Chrome trace (``--chrome``, default: ``--out`` with a ``.json``
suffix) holds every event, idle gaps included, one thread per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["register", "run"]

_PICTURE_SUFFIXES = (".png", ".svg", ".pdf")


def register(subparsers: Any) -> None:
    """Adds the `timeline` sub-command."""
    p = subparsers.add_parser(
        "timeline", help="draw the measured per-rank timeline of a traced run (TFSMP_TRACE)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", help="the trace directory (rank<R>.jsonl files)")
    p.add_argument("--out", metavar="FILE", default=None,
                   help="draw the Gantt chart to FILE (.png, .svg or .pdf; needs matplotlib)")
    p.add_argument("--chrome", metavar="FILE", default=None,
                   help="Chrome-trace JSON to write (default: --out with a .json suffix)")
    p.add_argument("--steps", type=int, default=1, help="training steps to draw (the last N)")
    p.add_argument("--skip", type=int, default=1,
                   help="leading steps left out of the summary (warm-up; default 1)")
    p.add_argument("--compare", metavar="PIPELINE", choices=("interleaved", "simple"),
                   default=None, help="also print the simulator's idle prediction for PIPELINE")
    p.add_argument("--virtual-stages", type=int, default=1,
                   help="virtual stages per rank of the traced run (with --compare)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Runs `tfsmp timeline`; returns the exit code (2 on a bad argument or trace)."""
    try:
        summary, text = _build(args)
    except ValueError as e:
        print(f"tfsmp timeline: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2) if args.json else text)
    return 0


def _check(args: argparse.Namespace) -> None:
    if not os.path.isdir(args.directory):
        raise ValueError(f"the trace directory must exist. Received: {args.directory}. Run the "
                         f"job with TFSMP_TRACE=DIR (or trace_dir in the config) first.")
    if args.out and Path(args.out).suffix.lower() not in _PICTURE_SUFFIXES:
        raise ValueError(f"--out must end in {', '.join(_PICTURE_SUFFIXES)}. "
                         f"Received: --out={args.out}")
    from tfsmp.launch.viz import viz_missing

    missing = viz_missing("tfsmp timeline", [args.out])
    if missing:
        raise ValueError(missing.split(": error: ", 1)[1])
    if args.steps < 1 or args.skip < 0:
        raise ValueError(f"--steps must be >= 1 and --skip >= 0. Received: --steps={args.steps}, "
                         f"--skip={args.skip}")


def _build(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from tfsmp.timeline import render as tr
    from tfsmp.timeline.events import load_events

    _check(args)
    events = load_events(args.directory)
    if not events:
        raise ValueError(f"the trace directory holds no events. Received: {args.directory}. "
                         f"Traces are written when the job exits; did it finish?")
    spans = tr.spans_of(events)
    steps = tr.training_steps(spans)
    summary: dict[str, Any] = {"directory": args.directory, "events": len(spans),
                               "ranks": sorted({s.rank for s in spans}), "steps": len(steps)}
    lines = [f"{len(spans)} events from ranks {summary['ranks']}, {len(steps)} training steps"]
    kept = steps[args.skip:] or steps
    summary["per_step"] = [_step_summary(tr.step_stats(s)) for s in kept]
    lines += [_step_line(i + len(steps) - len(kept), row) for i, row in enumerate(summary["per_step"])]
    if args.compare and kept:
        cmp = tr.compare_with_simulator(kept, args.compare, args.virtual_stages)
        summary["compare"] = cmp
        lines.append(_compare_line(cmp))
    lines += _outputs(args, spans, steps, summary)
    return summary, "\n".join(lines)


def _step_summary(st: Any) -> dict[str, Any]:
    ranks = sorted(st.busy)
    return {"window": st.window, "idle": [st.idle_fraction(r) for r in ranks],
            "receive_wait": [st.receive_fraction(r) for r in ranks],
            "bubble_fraction": st.bubble_fraction}


def _step_line(index: int, row: dict[str, Any]) -> str:
    parts = "  ".join(f"r{r}: idle {i:.3f} (wait {w:.3f})"
                      for r, (i, w) in enumerate(zip(row["idle"], row["receive_wait"])))
    return f"step {index}: window {1e3 * row['window']:.1f} ms  {parts}"


def _compare_line(cmp: dict[str, Any]) -> str:
    measured = " / ".join(f"{v:.3f}" for v in cmp["measured"])
    predicted = " / ".join(f"{v:.3f}" for v in cmp["predicted"])
    return (f"{cmp['pipeline']}, m={cmp['microbatches']}: idle per rank measured {measured}, "
            f"simulated {predicted} (measured stage times, free messages)")


def _outputs(args: argparse.Namespace, spans: Any, steps: Any, summary: dict[str, Any]
             ) -> list[str]:
    from tfsmp.timeline import render as tr

    lines = []
    chrome = args.chrome or (str(Path(args.out).with_suffix(".json")) if args.out else None)
    if args.out:
        if not steps:
            raise ValueError("drawing needs at least one complete training step. Received: none "
                             "in the trace (inference only, or the job stopped mid-step).")
        summary["out"] = str(tr.render_gantt(steps[-args.steps:], args.out))
        lines.append(f"wrote {summary['out']}")
    if chrome:
        summary["chrome"] = str(tr.write_chrome_trace(spans, chrome))
        lines.append(f"wrote {summary['chrome']} (open in https://ui.perfetto.dev)")
    return lines
