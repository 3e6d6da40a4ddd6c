"""The per-stage plan report (`format_report`) and a picture of the plan (`draw_plan`).

Pure; matplotlib is imported only by `draw_plan`.

Example::

    print(format_report(plan, graph, batch_size=32))
    draw_plan(plan, graph, "plan.svg")
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tfsmp.errors import ConfigError
from tfsmp.graph.ir import LayerGraph
from tfsmp.partitioning.contiguous import split_sequence
from tfsmp.partitioning.memory import RankMemory
from tfsmp.partitioning.plan import StagePlan
from tfsmp.partitioning.planner import IMBALANCE_TARGET, vertex_weights
from tfsmp.partitioning.ties import copy_memory

__all__ = ["IMBALANCE_TARGET", "draw_plan", "explain_imbalance", "format_memory", "format_report",
           "stage_shares"]

_MAX_BOXES = 250  # above this many layers `draw_plan` draws a stage strip instead of boxes
_IMAGE_SUFFIXES = (".png", ".svg", ".pdf")
_BAND = 36  # columns per band of a drawn graph


def stage_shares(plan: StagePlan, graph: LayerGraph, *, optimize: str = "speed",
                 memory_weight: float | None = None, optimizer: str | None = None,
                 batch_size: int = 1) -> list[float]:
    """Each stage's share of the planner's layer weights (`vertex_weights`); they sum to 1."""
    w = vertex_weights(graph, optimize, memory_weight, optimizer, batch_size)
    shares = [0.0] * plan.num_stages
    for name, s in plan.stage_of.items():
        shares[s] += w.get(name, 0.0)
    return shares


def explain_imbalance(plan: StagePlan, graph: LayerGraph, *, optimize: str = "speed",
                      memory_weight: float | None = None, optimizer: str | None = None,
                      batch_size: int = 1) -> str | None:
    """Why max/mean stage cost exceeds `IMBALANCE_TARGET`, or None when it does not.

    Layer granularity is the usual reason: a group of layers that must share a stage (one layer,
    or layers tied by shared variables or repeated calls) outweighs the mean stage, or no cut of
    the layer order into contiguous runs comes closer. Otherwise the planner (or the user, for a
    manual plan) traded balance for fewer boundary bytes.
    """
    n = plan.num_stages
    shares = stage_shares(plan, graph, optimize=optimize, memory_weight=memory_weight,
                          optimizer=optimizer, batch_size=batch_size)
    ratio = max(shares) * n
    if ratio <= IMBALANCE_TARGET:
        return None
    w = vertex_weights(graph, optimize, memory_weight, optimizer, batch_size)
    groups = [[m for m in g if m in w] for g in graph.groups()]
    groups = [g for g in groups if g]
    weights = [sum(w[m] for m in g) for g in groups]
    heaviest = max(range(len(groups)), key=lambda i: weights[i])
    starts = split_sequence(weights, [0.0] * (len(weights) + 1), n)
    ends = [*starts[1:], len(weights)]
    contiguous = max(sum(weights[a:b]) for a, b in zip(starts, ends)) * n
    parts = []
    if weights[heaviest] * n > IMBALANCE_TARGET:
        names = ", ".join(groups[heaviest][:4]) + (", ..." if len(groups[heaviest]) > 4 else "")
        parts.append(
            f"layer granularity: [{names}] must stay on one stage and carries "
            f"{weights[heaviest]:.1%} of the cost, more than 1/{n} = {1 / n:.1%}, so no "
            f"{n}-stage plan has max/mean below {weights[heaviest] * n:.3f}")
    elif contiguous > IMBALANCE_TARGET:
        parts.append(
            f"layer granularity: no split of the layer order into {n} contiguous runs has "
            f"max/mean below {contiguous:.3f} (consecutive layers are too coarse to cut evenly)")
    if ratio > contiguous * (1 + 1e-6):
        who = "this manual plan" if plan.planner == "manual" else "the planner"
        parts.append(
            f"{who} accepted {ratio:.3f} where {contiguous:.3f} is possible, to send fewer "
            f"boundary bytes (method='contiguous' with flops_per_byte=0 balances cost alone)")
    return f"imbalance {ratio:.3f} > {IMBALANCE_TARGET:.2f}: " + "; ".join(parts) + "."


def _tie_lines(plan: StagePlan) -> list[str]:
    """One line per set of tied variables: its copies, or the one stage that keeps it."""
    out = []
    for t in plan.ties:
        names = ", ".join(t.variables[:3]) + (", ..." if len(t.variables) > 3 else "")
        if t.copies > 1:
            out.append(f"tied: [{names}] ({_bytes(t.param_bytes)}) has {t.copies} copies, on "
                       f"stages {list(t.stages)}; their gradients are summed every step "
                       f"({_bytes(t.trainable_param_bytes)} each way per stage)")
        else:
            out.append(f"tied: [{names}] ({_bytes(t.param_bytes)}) is kept on stage "
                       f"{t.stages[0]}: one copy, used by {', '.join(t.nodes)}")
    return out


def format_report(plan: StagePlan, graph: LayerGraph, *, optimize: str = "speed",
                  memory_weight: float | None = None, optimizer: str | None = None,
                  batch_size: int = 1) -> str:
    """A per-stage table for ``batch_size`` samples: layers, parameters, FLOPs (forward +
    backward), activation memory, memory (parameters + optimizer state + activations), bytes
    sent, and the stage's share of the planner's cost; then max/mean imbalances and, above
    `IMBALANCE_TARGET`, the reason."""
    shares = stage_shares(plan, graph, optimize=optimize, memory_weight=memory_weight,
                          optimizer=optimizer, batch_size=batch_size)
    memory = [sum(graph.memory_of(n, optimizer, batch_size) for n in plan.layers(s))
              + sum(copy_memory(t, optimizer) for t in plan.ties
                    if s in t.stages and s != t.owner_stage)
              for s in range(plan.num_stages)]
    rows = [["stage", "layers", "parameters", "FLOPs", "activations", "memory", "bytes sent",
             "cost"]]
    for s in range(plan.num_stages):
        nodes = [graph.nodes[n] for n in plan.layers(s)]
        rows.append([
            str(s), str(len(nodes)), _count(sum(n.param_count for n in nodes)),
            _count(batch_size * sum(n.flops_forward + n.flops_backward for n in nodes)),
            _bytes(batch_size * sum(n.activation_bytes for n in nodes)), _bytes(memory[s]),
            _bytes(batch_size * plan.stages[s].send_bytes), f"{shares[s]:.1%}"])
    sent = batch_size * sum(b.bytes_per_sample * len(b.consumers) for b in plan.boundaries)
    lines = [
        f"Plan of '{graph.name}': {plan.num_stages} stages, planner={plan.planner}, "
        f"optimize={optimize}, batch size {batch_size}",
        *_table(rows),
        f"imbalance (max/mean): cost {max(shares) * plan.num_stages:.3f}, "
        f"compute {plan.imbalance():.3f}, memory {_ratio(memory):.3f}",
        f"boundaries: {len(plan.boundaries)} tensors, {_bytes(sent)} sent per step "
        f"(forward; gradients return the same amount)",
        *_tie_lines(plan),
    ]
    reason = explain_imbalance(plan, graph, optimize=optimize, memory_weight=memory_weight,
                               optimizer=optimizer, batch_size=batch_size)
    if reason:
        lines.append(reason)
    lines.extend(f"note: {n}" for n in plan.notes)
    return "\n".join(lines)


def format_memory(ranks: Sequence[RankMemory], cap: float | None = None,
                  suggestions: Sequence[str] = ()) -> str:
    """Each rank's predicted peak memory by part ([Note: memory model] in memory.py) and,
    with ``cap``, whether it fits and, if not, what would (``suggestions``)."""
    rows = [["rank", "stages", "weights", "optimizer", "accumulators", "activations",
             "buffers", "baseline", "peak"]]
    for r in ranks:
        p = r.parts()
        rows.append([str(r.rank), ",".join(map(str, r.stages)), _bytes(p["weights"]),
                     _bytes(p["optimizer"]), _bytes(p["accumulators"]),
                     _bytes(p["activations"]), _bytes(p["buffers"]), _bytes(p["baseline"]),
                     _bytes(r.total)])
    lines = ["Predicted peak memory per rank (a memory cgroup's maximum usage):", *_table(rows)]
    if cap is None:
        return "\n".join(lines)
    over = [r for r in ranks if r.total > cap]
    if not over:
        worst = max(ranks, key=lambda r: r.total)
        lines.append(f"fits: every rank within {_bytes(cap)} per rank (largest: rank "
                     f"{worst.rank}, {_bytes(worst.total)}, {worst.total / cap:.0%} of the cap)")
        return "\n".join(lines)
    names = ", ".join(f"rank {r.rank} ({_bytes(r.total)})" for r in over)
    lines.append(f"does not fit {_bytes(cap)} per rank: {names}")
    if suggestions:
        lines.append("would fit: " + "; or ".join(suggestions))
    else:
        lines.append("nothing tried fits (more partitions, optimize 'memory', more "
                     "microbatches): a larger cap, or a smaller batch")
    return "\n".join(lines)


def _ratio(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]


def _count(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def _bytes(x: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} B"


# -- drawing -------------------------------------------------------------------------------------


def draw_plan(plan: StagePlan, graph: LayerGraph, path: str | Path, *,
              max_boxes: int = _MAX_BOXES) -> Path:
    """Draws the layer graph coloured by stage (PNG, SVG or PDF by suffix).

    Layers are boxes in columns by depth; a graph of more than ``max_boxes`` layers becomes a
    strip of layers in topological order, widths proportional to compute.

    Raises:
        ConfigError: for an unsupported file suffix.
    """
    out = Path(path)
    if out.suffix.lower() not in _IMAGE_SUFFIXES:
        raise ConfigError(
            f"draw_plan writes {', '.join(_IMAGE_SUFFIXES)} files. Received: path={str(out)!r}.")
    from matplotlib.figure import Figure

    if len(graph) > max_boxes:
        fig = _strip_figure(Figure, plan, graph)
    else:
        fig = _graph_figure(Figure, plan, graph)
    fig.savefig(out, bbox_inches="tight")
    return out


def _colors(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _depths(graph: LayerGraph) -> dict[str, int]:
    """Column of each layer: longest path from the inputs over the group graph."""
    groups = graph.groups()
    where = {n: i for i, g in enumerate(groups) for n in g}
    depth = [0] * len(groups)
    for i, g in enumerate(groups):
        for n in g:
            for p in graph.predecessors(n):
                if where[p] != i:
                    depth[i] = max(depth[i], depth[where[p]] + 1)
    return {n: depth[where[n]] for n in graph.nodes}


def _graph_figure(figure: Any, plan: StagePlan, graph: LayerGraph) -> Any:
    pos, bands, width, height = _layout(graph)
    fig = figure(figsize=(2 + 1.1 * width, 1.5 + 0.6 * height))
    ax = fig.subplots()
    for (a, b) in graph.edges():
        if bands[a] == bands[b]:  # an edge wrapping to another band would cross the picture
            _edge(ax, pos[a], pos[b])
    colors = _colors(plan.num_stages)
    labels = len(graph) <= 80
    for n, (x, y) in pos.items():
        s = plan.stage_of.get(n)
        ax.add_patch(_box(x, y, "0.85" if s is None else colors[s]))
        if labels:
            ax.text(x, y, n, ha="center", va="center", fontsize=6, zorder=3)
    ax.set_xlim(-0.6, width - 0.4)
    ax.set_ylim(-height + 0.4, 0.6)
    ax.set_axis_off()
    _legend(ax, plan, colors)
    ax.set_title(f"{graph.name}: {plan.num_stages} stages ({plan.planner}), "
                 f"imbalance {plan.imbalance():.2f}")
    return fig


def _layout(graph: LayerGraph, band: int = _BAND
            ) -> tuple[dict[str, tuple[float, float]], dict[str, int], int, int]:
    """Box centres and bands: column = depth, row = order within the depth. Deep graphs (ResNets
    are long chains) wrap every ``band`` columns into a new band below, like lines of text.

    Returns:
        (centre per layer, band per layer, columns, rows).
    """
    depth = _depths(graph)
    order = graph.topological_order()
    rows: dict[int, int] = {}
    for n in order:
        rows[depth[n]] = rows.get(depth[n], 0) + 1
    tall = max(rows.values(), default=1) + 1
    seen: dict[int, int] = {}
    pos: dict[str, tuple[float, float]] = {}
    for n in order:
        d = depth[n]
        pos[n] = (float(d % band), -float((d // band) * tall + seen.get(d, 0)))
        seen[d] = seen.get(d, 0) + 1
    cols = max(depth.values(), default=0) + 1
    bands = {n: depth[n] // band for n in order}
    return pos, bands, min(cols, band), ((cols - 1) // band + 1) * tall - 1


def _edge(ax: Any, start: tuple[float, float], end: tuple[float, float]) -> None:
    # Edges that skip columns along one row would hide behind the boxes: bend them.
    bend = 0.0 if abs(end[0] - start[0]) <= 1 else 0.25
    ax.annotate("", xy=end, xytext=start, zorder=1, arrowprops={
        "arrowstyle": "-|>", "color": "0.5", "linewidth": 0.6, "shrinkA": 8, "shrinkB": 8,
        "connectionstyle": f"arc3,rad={bend}"})


def _box(x: float, y: float, color: Any) -> Any:
    from matplotlib.patches import FancyBboxPatch

    return FancyBboxPatch((x - 0.42, y - 0.3), 0.84, 0.6, boxstyle="round,pad=0.02",
                          facecolor=color, edgecolor="0.3", linewidth=0.5, zorder=2)


def _legend(ax: Any, plan: StagePlan, colors: Sequence[Any]) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=colors[s], label=f"stage {s} ({plan.stages[s].layers} layers)")
               for s in range(plan.num_stages)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)


def _strip_figure(figure: Any, plan: StagePlan, graph: LayerGraph) -> Any:
    from matplotlib.patches import Rectangle

    order = [n for n in graph.topological_order() if n in plan.stage_of]
    total = sum(graph.nodes[n].compute for n in order)
    widths = [graph.nodes[n].compute / total if total > 0 else 1 / len(order) for n in order]
    colors = _colors(plan.num_stages)
    fig = figure(figsize=(14.0, 2.6))
    ax = fig.subplots()
    x, start = 0.0, dict[int, float]()
    for n, w in zip(order, widths):
        s = plan.stage_of[n]
        start.setdefault(s, x)
        ax.add_patch(Rectangle((x, 0), w, 1, facecolor=colors[s], edgecolor="none"))
        x += w
    for s, x0 in start.items():
        ax.text(x0, 1.05, f"{s}", fontsize=7, ha="left", va="bottom")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.3)
    ax.set_yticks([])
    ax.set_xlabel(f"{len(order)} layers in topological order, width = share of compute")
    _legend(ax, plan, colors)
    ax.set_title(f"{graph.name}: {plan.num_stages} stages ({plan.planner}), "
                 f"imbalance {plan.imbalance():.2f}")
    return fig
