"""Pictures of schedules: the step grid (errors, golden files), the staircase, the timeline image.

Example::

    print(render_ascii(schedule))                        # rows = steps, one column per rank
    result = simulate(schedule, forward_time=1.0, backward_time=2.0)
    print(render_staircase(result))                      # rows = ranks, columns = time
    render_timeline(result, "docs/schedules/interleaved_p4_m8.png")

`render_timeline` imports matplotlib inside the function, so this module stays import-clean.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tfsmp.schedule.actions import Action, Op, Schedule

if TYPE_CHECKING:
    from tfsmp.schedule.simulate import SimResult, TimelineEntry

__all__ = ["render_ascii", "render_staircase", "render_timeline"]

ERROR_MARK = "<-- ERROR HERE"


def render_ascii(schedule: Schedule, *, compute_only: bool = False,
                 marks: Mapping[tuple[int, int], str] | None = None,
                 context: int | None = None) -> str:
    """The rank × step grid: one row per step, one column per rank, in program order.

    Args:
        schedule: ``{rank: [Action, ...]}``.
        compute_only: show only F/B actions (steps renumbered).
        marks: ``{(rank, step): note}``; each marked cell is starred and its row ends with
            ``<-- ERROR HERE`` and the notes.
        context: with marks, show only the steps within ``context`` of a marked step.

    Returns:
        The grid as text, without a trailing newline.
    """
    marks = dict(marks or {})
    columns = _columns(schedule, compute_only, marks)
    ranks = sorted(columns)
    steps = max((len(c) for c in columns.values()), default=0)
    width = max([len(f"rank {r}") for r in ranks]
                + [len(cell) for c in columns.values() for cell, _ in c] + [1])
    rows = [(" step | " + " | ".join(f"rank {r}".ljust(width) for r in ranks)).rstrip()]
    marked = {i for c in columns.values() for i, (_, note) in enumerate(c) if note is not None}
    shown = _shown_steps(steps, marked, context)
    previous = -1
    for step in shown:
        if step != previous + 1:
            rows.append("  ... |")
        previous = step
        cells, notes = [], []
        for r in ranks:
            cell, note = columns[r][step] if step < len(columns[r]) else ("", None)
            cells.append(cell.ljust(width))
            if note is not None:
                notes.append(f"rank {r}: {note}" if note else f"rank {r}")
        line = f"{step:5d} | " + " | ".join(cells)
        rows.append(line.rstrip() + (f"  {ERROR_MARK} ({'; '.join(notes)})" if notes else ""))
    if shown and shown[-1] != steps - 1:
        rows.append("  ... |")
    return "\n".join(rows)


def _columns(schedule: Schedule, compute_only: bool, marks: Mapping[tuple[int, int], str]
             ) -> dict[int, list[tuple[str, str | None]]]:
    """Per rank, (cell text, mark note or None) for each shown step."""
    columns: dict[int, list[tuple[str, str | None]]] = {}
    for rank, actions in schedule.items():
        cells = []
        for step, a in enumerate(actions):
            if compute_only and not a.is_compute:
                continue
            note = marks.get((rank, step))
            cells.append((f"*{a}*" if note is not None else str(a), note))
        columns[rank] = cells
    return columns


def _shown_steps(steps: int, marked: set[int], context: int | None) -> list[int]:
    if context is None or not marked:
        return list(range(steps))
    keep = {s for m in marked for s in range(m - context, m + context + 1) if 0 <= s < steps}
    return sorted(keep)


def render_staircase(result: SimResult, *, compute_only: bool = True) -> str:
    """The simulated timeline as text: one row per rank, one column per time unit, ``.`` = idle.

    The time unit is the shortest compute action; an action longer than one unit continues
    with ``-`` cells. Cells show ``F3``/``B3``/``W3`` (microbatch 3), prefixed with the stage
    when a rank runs several stages (``4F3``). Under a placement other than the interleaved
    one (ZB-V's), each row names its rank's stages: ``rank 0 (stages 0, 7): ...``.
    """
    compute = [e for e in result.timeline if e.action.is_compute or not compute_only]
    durations = [e.end - e.start for e in compute if e.end > e.start]
    unit = min(durations, default=1.0)
    stages_per_rank = max((len({e.action.stage for e in compute if e.rank == r})
                           for r in range(result.num_ranks)), default=1)
    labels = {id(e): _label(e.action, stages_per_rank > 1) for e in compute}
    width = max((len(t) for t in labels.values()), default=2)
    slots = round(result.makespan / unit) if unit > 0 else 0
    heads = _row_heads(result)
    rows = []
    for rank in range(result.num_ranks):
        cells = ["."] * slots
        for e in compute:
            if e.rank != rank or e.end <= e.start:
                continue
            first, last = round(e.start / unit), round(e.end / unit)
            for k in range(first, min(last, slots)):
                cells[k] = labels[id(e)] if k == first else "-"
        rows.append(heads[rank] + " ".join(c.ljust(width) for c in cells).rstrip())
    return "\n".join(rows)


def _row_heads(result: SimResult) -> list[str]:
    """``"rank 0: "``, or with a non-interleaved placement ``"rank 0 (stages 0, 7): "``."""
    where = result.placement
    if where is None or where.kind == "interleaved":
        return [f"rank {r}: " for r in range(result.num_ranks)]
    heads = [f"rank {r} (stages {', '.join(map(str, where.stages(r)))}): "
             for r in range(result.num_ranks)]
    width = max(len(h) for h in heads)
    return [h.ljust(width) for h in heads]


def _label(action: Action, with_stage: bool) -> str:
    text = f"{action.op.value}{action.microbatch}"
    return f"{action.stage}{text}" if with_stage else text


def render_timeline(result: SimResult, path: str | Path, *, title: str | None = None) -> Path:
    """Draws the simulated timeline to a PNG or SVG file (chosen by the suffix).

    One row per rank; forward boxes in a light and backward boxes in a dark, hatched shade of a
    colour per microbatch, weight-gradient (W) boxes in a middle shade hatched the other way;
    white gaps are idle time. Rows name their stages under ZB-V's placement. Needs matplotlib.

    Returns:
        The path written.
    """
    # The object API needs no pyplot backend, so drawing never disturbs a user's session.
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    path = Path(path)
    compute = [e for e in result.timeline if e.action.is_compute and e.end > e.start]
    num_mb = 1 + max((e.action.microbatch or 0 for e in compute), default=0)
    cmap = colormaps["tab10" if num_mb <= 10 else "tab20"]
    unit = min((e.end - e.start for e in compute), default=1.0)
    slots = result.makespan / unit if unit > 0 else 1.0
    fig = Figure(figsize=(min(20.0, max(8.0, 0.3 * slots + 2.5)), 0.6 * result.num_ranks + 1.2))
    ax = fig.subplots()
    multi_stage = len({e.action.stage for e in compute}) > result.num_ranks
    for rank in range(result.num_ranks):  # idle shows as the grey band between boxes
        ax.barh(rank, result.makespan, left=0, height=0.8, color="0.92", edgecolor="none")
    for e in compute:
        _draw_box(ax, e, cmap, multi_stage)
    ax.set_xlim(0, result.makespan)
    ax.set_ylim(result.num_ranks - 0.5, -0.5)
    ax.set_yticks(range(result.num_ranks), [h.strip().rstrip(":") for h in _row_heads(result)])
    ax.set_xlabel("time")
    ax.set_title(title or f"bubble fraction {result.bubble_fraction:.3f}, "
                          f"peak activations {result.peak_activations}")
    handles = [Patch(facecolor="0.8", edgecolor="black", label="forward"),
               Patch(facecolor="0.4", edgecolor="black", hatch="//", label="backward")]
    if any(e.action.op is Op.WEIGHT for e in compute):
        handles.append(Patch(facecolor="0.6", edgecolor="black", hatch="\\\\",
                             label="weight gradient (W)"))
    handles.append(Patch(facecolor="0.92", edgecolor="none", label="idle"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _draw_box(ax: Any, e: TimelineEntry, cmap: Any, multi_stage: bool) -> None:
    a = e.action
    colour = cmap(a.microbatch % cmap.N)
    backward = a.op is Op.BACKWARD
    weight = a.op is Op.WEIGHT
    if backward:
        face = tuple(0.55 * c for c in colour[:3])
    elif weight:
        face = tuple(0.15 + 0.7 * c for c in colour[:3])
    else:
        face = tuple(0.35 + 0.65 * c for c in colour[:3])
    hatch = "//" if backward else "\\\\" if weight else None
    ax.barh(e.rank, e.end - e.start, left=e.start, height=0.8, color=face, edgecolor="black",
            linewidth=0.6, hatch=hatch)
    label = _label(a, multi_stage)
    ax.text((e.start + e.end) / 2, e.rank, label, ha="center", va="center",
            fontsize=6.5 if multi_stage else 8,
            color="white" if backward else "black", clip_on=True)
