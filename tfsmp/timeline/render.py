"""Measured timelines: per-step idle analysis, Gantt pictures and Chrome traces from tracer events.

Example::

    events = load_events("/tmp/trace")                 # written by TFSMP_TRACE=/tmp/trace
    steps = training_steps(events)                     # one {rank: [Span, ...]} per optimizer step
    stats = step_stats(steps[-1])                      # window, busy, receive wait, idle per rank
    render_gantt(steps[-2:], "t.png")                  # needs matplotlib (imported here only)
    write_chrome_trace(events, "t.json")               # open in https://ui.perfetto.dev

Pure Python: imports neither TensorFlow nor MPI, so it runs wherever the trace files are.

[Note: measured idle] The executor records one span per action: ``F``/``B`` (compute),
``SEND_*`` (posting a non-blocking send), ``RECV_*`` (waiting for a pre-posted receive to
complete: its whole duration is waiting), ``REDUCE`` and ``STEP``. A training step of rank r is
its spans up to and including its ``STEP``. The step's window runs from the earliest start of any
rank's first span to the latest end of any compute span, which is what the schedule simulator
calls the makespan when the optimizer step and reductions take no time. A rank's idle share is
``1 - busy / window`` with busy = its F and B time; idle splits into receive waits (the pipeline
bubble proper) and the rest (sends, Python dispatch between actions, a late start).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "KIND_LABELS",
    "Span",
    "StepStats",
    "chrome_trace",
    "compare_with_simulator",
    "idle_spans",
    "render_gantt",
    "spans_of",
    "stage_times",
    "step_stats",
    "training_steps",
    "write_chrome_trace",
]

COMPUTE = ("F", "B", "W")  # W: zero-bubble weight gradients ([Note: weight actions])
RECEIVES = ("RECV_F", "RECV_B")
KIND_LABELS = {
    "F": "forward", "B": "backward", "W": "weight gradient", "SEND_F": "send", "SEND_B": "send",
    "RECV_F": "receive (waiting)", "RECV_B": "receive (waiting)", "REDUCE": "reduction",
    "STEP": "optimizer", "idle": "idle",
}
_FUSED = "forward+backward (last stage, fused)"
_COLOURS = {
    "forward": "#8ecae6", "backward": "#219ebc", _FUSED: "#5fa8d3", "weight gradient": "#126782",
    "send": "#ffb703",
    "receive (waiting)": "#e76f51", "reduction": "#8338ec", "optimizer": "#2a9d8f",
    "idle": "#eeeeee",
}
_MIN_IDLE = 1e-4  # gaps shorter than 0.1 ms are timer noise, not idle time worth drawing

Step = Mapping[int, Sequence["Span"]]


@dataclass(frozen=True)
class Span:
    """One recorded action (or derived idle gap) of one rank; times in seconds."""

    rank: int
    name: str
    kind: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def stage(self) -> int | None:
        """The stage of an action span (``"1F3"`` -> 1), None for idle."""
        digits = ""
        for ch in self.name:
            if not ch.isdigit():
                break
            digits += ch
        return int(digits) if digits else None


@dataclass(frozen=True)
class StepStats:
    """One training step as measured: see [Note: measured idle]."""

    start: float
    end: float
    busy: dict[int, float]
    receive_wait: dict[int, float]

    @property
    def window(self) -> float:
        return self.end - self.start

    def idle_fraction(self, rank: int) -> float:
        return 1.0 - self.busy[rank] / self.window if self.window > 0 else 0.0

    def receive_fraction(self, rank: int) -> float:
        return self.receive_wait[rank] / self.window if self.window > 0 else 0.0

    @property
    def bubble_fraction(self) -> float:
        """Idle share over all ranks: ``1 - Σ busy / (p · window)``."""
        p = len(self.busy)
        return 1.0 - sum(self.busy.values()) / (p * self.window) if self.window > 0 else 0.0


def spans_of(events: Iterable[Mapping[str, Any]]) -> list[Span]:
    """Tracer event dicts (`tfsmp.timeline.events.load_events`) as spans, by start time.

    Raises:
        ValueError: an event lacks one of rank, name, kind, start, end.
    """
    out = []
    for e in events:
        try:
            out.append(Span(int(e["rank"]), str(e["name"]), str(e["kind"]), float(e["start"]),
                            float(e["end"])))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(
                f"A trace event needs rank, name, kind, start and end. Received: {dict(e)!r}. "
                f"Point `tfsmp timeline` at a directory written by TFSMP_TRACE / trace_dir.") from err
    return sorted(out, key=lambda s: s.start)


def training_steps(events: Iterable[Mapping[str, Any]] | Iterable[Span]) -> list[dict[int, list[Span]]]:
    """Splits every rank's spans into optimizer steps (each ends with the rank's ``STEP``).

    Spans after a rank's last ``STEP`` (inference, an unfinished step) are dropped; step k of
    every rank forms the k-th entry, as far as every rank has that many steps.
    """
    spans = [e if isinstance(e, Span) else spans_of([e])[0] for e in events]
    per_rank: dict[int, list[list[Span]]] = {}
    current: dict[int, list[Span]] = {}
    for s in sorted(spans, key=lambda s: s.start):
        current.setdefault(s.rank, []).append(s)
        if s.kind == "STEP":
            per_rank.setdefault(s.rank, []).append(current.pop(s.rank))
    if not per_rank:
        return []
    count = min(len(v) for v in per_rank.values())
    ranks = sorted(set(per_rank) | set(current))
    if any(r not in per_rank for r in ranks):
        return []
    return [{r: per_rank[r][k] for r in ranks} for k in range(count)]


def step_stats(step: Step) -> StepStats:
    """Window, busy and receive-wait time per rank of one step ([Note: measured idle])."""
    start = min(spans[0].start for spans in step.values() if spans)
    compute_ends = [s.end for spans in step.values() for s in spans if s.kind in COMPUTE]
    end = max(compute_ends) if compute_ends else max(s.end for v in step.values() for s in v)
    busy = {r: sum(s.duration for s in spans if s.kind in COMPUTE) for r, spans in step.items()}
    recv = {r: sum(s.duration for s in spans if s.kind in RECEIVES and s.end <= end)
            for r, spans in step.items()}
    return StepStats(start, end, busy, recv)


def stage_times(steps: Sequence[Step], statistic: str = "median"
                ) -> tuple[list[float], list[float]]:
    """Forward and backward seconds of one microbatch per stage over ``steps``: the median, or
    with ``statistic="mean"`` the mean (which keeps each stage's total busy time, what an idle
    prediction needs when durations vary).

    The last stage's forward span holds its fused forward, loss and backward (its B is a
    hand-over of gradients already computed), as in the runtime.

    Raises:
        ValueError: no compute spans in ``steps``, or an unknown ``statistic``.
    """
    if statistic not in ("median", "mean"):
        raise ValueError(f"statistic must be 'median' or 'mean'. Received: statistic={statistic!r}")
    pick = statistics.median if statistic == "median" else statistics.fmean
    times: dict[tuple[int, str], list[float]] = {}
    for step in steps:
        for spans in step.values():
            for s in spans:
                if s.kind in COMPUTE and s.stage is not None:
                    times.setdefault((s.stage, s.kind), []).append(s.duration)
    if not times:
        raise ValueError("stage_times needs steps with F/B spans. Received: none. Trace a "
                         "training run (fit or train_on_batch), not only predict.")
    stages = 1 + max(stage for stage, _ in times)
    forward = [pick(times.get((s, "F"), [0.0])) for s in range(stages)]
    backward = [pick(times.get((s, "B"), [0.0])) for s in range(stages)]
    return forward, backward


def idle_spans(spans: Sequence[Span], start: float, end: float) -> list[Span]:
    """The gaps of one rank's spans inside ``[start, end]``, as ``idle`` spans."""
    out: list[Span] = []
    cursor = start
    rank = spans[0].rank if spans else 0
    for s in sorted(spans, key=lambda s: s.start):
        if s.start - cursor > _MIN_IDLE:
            out.append(Span(rank, "idle", "idle", cursor, s.start))
        cursor = max(cursor, s.end)
    if end - cursor > _MIN_IDLE:
        out.append(Span(rank, "idle", "idle", cursor, end))
    return out


def chrome_trace(events: Iterable[Mapping[str, Any]] | Iterable[Span]) -> dict[str, Any]:
    """A Chrome trace (the JSON ``traceEvents`` format Perfetto and chrome://tracing open):
    one thread per rank, one complete event per span, derived idle gaps included."""
    spans = [e if isinstance(e, Span) else spans_of([e])[0] for e in events]
    if not spans:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    t0 = min(s.start for s in spans)
    ranks = sorted({s.rank for s in spans})
    out: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "tfsmp pipeline"}}]
    out += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
            for r in ranks]
    gaps = []
    for r in ranks:
        mine = [s for s in spans if s.rank == r]
        for step in _segments(mine):
            gaps += idle_spans(step, step[0].start, step[-1].end)
    for s in sorted([*spans, *gaps], key=lambda s: (s.rank, s.start)):
        out.append({"name": s.name, "cat": KIND_LABELS.get(s.kind, s.kind), "ph": "X", "pid": 0,
                    "tid": s.rank, "ts": round((s.start - t0) * 1e6, 3),
                    "dur": round(s.duration * 1e6, 3)})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def _segments(spans: Sequence[Span]) -> list[list[Span]]:
    """One rank's spans cut after each STEP (idle between steps is not pipeline idle)."""
    out: list[list[Span]] = [[]]
    for s in spans:
        out[-1].append(s)
        if s.kind == "STEP":
            out.append([])
    return [seg for seg in out if seg]


def write_chrome_trace(events: Iterable[Mapping[str, Any]] | Iterable[Span], path: str | Path
                       ) -> Path:
    """Writes `chrome_trace` to ``path``; returns it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(events)))
    return path


def render_gantt(steps: Sequence[Step], path: str | Path, *, title: str | None = None) -> Path:
    """Draws the measured timeline of ``steps`` (one row per rank) to a PNG/SVG/PDF file.

    Boxes are coloured by kind (forward, backward, send, receive wait, reduction, optimizer);
    idle gaps inside a step are grey. Times are milliseconds from the first span. Needs
    matplotlib (imported here).

    Raises:
        ValueError: ``steps`` is empty.
    """
    if not steps:
        raise ValueError("render_gantt needs at least one training step. Received: no steps. "
                         "Trace a run that completes an optimizer step.")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    ranks = sorted({r for step in steps for r in step})
    t0 = min(s.start for step in steps for spans in step.values() for s in spans)
    t1 = max(s.end for step in steps for spans in step.values() for s in spans)
    fig, ax = plt.subplots(figsize=(12, 0.7 * len(ranks) + 1.6))
    multi_stage = any(len({s.stage for s in spans if s.kind in COMPUTE}) > 1
                      for step in steps for spans in step.values())
    last = max((s.stage or 0 for step in steps for v in step.values() for s in v), default=0)
    for step in steps:
        for r, spans in step.items():
            for s in [*idle_spans(spans, spans[0].start, spans[-1].end), *spans]:
                _draw_span(ax, s, t0, ranks.index(r), multi_stage, fused=s.stage == last)
    ax.set_xlim(0, (t1 - t0) * 1e3)
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_xlabel("milliseconds")
    stats = [step_stats(step) for step in steps]
    bubble = statistics.median(s.bubble_fraction for s in stats)
    ax.set_title(title or f"measured: {len(steps)} step(s), idle fraction {bubble:.3f}")
    kinds = ["forward", "backward", _FUSED, "send", "receive (waiting)", "reduction", "optimizer",
             "idle"]
    if any(s.kind == "W" for step in steps for v in step.values() for s in v):
        kinds.insert(2, "weight gradient")
    ax.legend(handles=[Patch(facecolor=_COLOURS[k], edgecolor="black", label=k) for k in kinds],
              loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw_span(ax: Any, s: Span, t0: float, row: int, multi_stage: bool, fused: bool) -> None:
    # The runtime runs the last stage's forward, loss and backward as one compiled call.
    label = _FUSED if fused and s.kind == "F" else KIND_LABELS.get(s.kind, s.kind)
    thin = s.kind not in (*COMPUTE, "STEP", "REDUCE", "idle")
    ax.barh(row, s.duration * 1e3, left=(s.start - t0) * 1e3, height=0.35 if thin else 0.8,
            color=_COLOURS.get(label, "#999999"), edgecolor="black" if s.kind != "idle" else "none",
            linewidth=0.4)
    if s.kind in COMPUTE:
        text = s.name if multi_stage else s.name.lstrip("0123456789")
        ax.text((s.start - t0 + s.duration / 2) * 1e3, row, text,
                ha="center", va="center", fontsize=6.5, clip_on=True)


def compare_with_simulator(steps: Sequence[Step], pipeline: str = "interleaved",
                           virtual_stages: int = 1, links: Any = None) -> dict[str, Any]:
    """Measured idle share per rank (median over ``steps``) beside the schedule simulator's
    prediction for the same schedule and the measured per-stage forward/backward times (means,
    so that every stage's simulated busy time equals its measured one). The schedule simulated is
    the one the runtime executes: `fuse_last_stage` of the generated one.

    Args:
        steps: training steps from `training_steps` (leave out warm-up steps).
        pipeline: the schedule the run used, a registered pipeline (tfsmp/schedule/registry.py;
            simulated with its W time and placement, as `RunPlan` describes the run).
        virtual_stages: model chunks per rank of the run.
        links: the run's `StagePlan` (or `StageLinks`); None means a chain of stages.

    Returns:
        ``{"ranks", "microbatches", "forward", "backward", "weight", "measured", "receive_wait",
        "predicted", "measured_bubble", "predicted_bubble", "simulated"}`` (``"simulated"``:
        the simulator's inputs, where a stage split its drain's backwards, [Note: drain split]
        in tfsmp/runtime/executor.py); fractions are of the step window.

    Raises:
        ValueError: ``steps`` is empty.
    """
    from tfsmp.schedule import simulate
    from tfsmp.schedule.run_plan import RunPlan

    if not steps:
        raise ValueError("compare_with_simulator needs at least one training step. Received: none.")
    ranks = sorted(steps[0])
    forward, backward = stage_times(steps, "mean")
    weight = _weight_times(steps, len(forward))
    m = sum(1 for s in steps[0][ranks[0]] if s.kind == "F" and s.stage == ranks[0])
    run = RunPlan.of(pipeline, len(ranks), m, virtual_stages=virtual_stages)
    drain = _drained(steps, run.split_stages)
    # The simulator's backward_time is the whole backward: B and W where a stage has Ws.
    sim_forward, whole = list(forward), [b + w for b, w in zip(backward, weight)]
    for s, mbs in drain.items():  # [Note: drain split]: W spans of a stage without W actions
        share = len(mbs) / m * weight[s]  # a drained microbatch's W per microbatch of the step
        if _w_in_forward(steps, s, mbs):  # the fused last stage's forward span held the W
            sim_forward[s] -= weight[s] - share
            whole[s] = backward[s] + weight[s]
        else:
            whole[s] = backward[s] + share
    sim = simulate(run.compute, forward_time=sim_forward, backward_time=whole,
                   weight_time=weight, links=links, placement=run.placement, drain=drain)
    stats = [step_stats(step) for step in steps]
    return {
        "ranks": len(ranks), "microbatches": m, "pipeline": pipeline,
        "forward": forward, "backward": backward, "weight": weight,
        "measured": [statistics.median(st.idle_fraction(r) for st in stats) for r in ranks],
        "receive_wait": [statistics.median(st.receive_fraction(r) for st in stats) for r in ranks],
        "predicted": list(sim.rank_bubble_fraction),
        "measured_bubble": statistics.median(st.bubble_fraction for st in stats),
        "predicted_bubble": sim.bubble_fraction,
        "window": statistics.median(st.window for st in stats),
        "predicted_makespan": sim.makespan,
        # what the simulator was given: per stage the forward and whole backward (B + W), and
        # the drained microbatches ([Note: drain split])
        "simulated": {"forward": sim_forward, "backward": whole,
                      "drain": {str(s): sorted(mbs) for s, mbs in drain.items()}},
    }


def _drained(steps: Sequence[Step], split: Collection[int]) -> dict[int, frozenset[int]]:
    """Per stage without W actions (not in ``split``) that ran W's, their microbatches: the
    backwards the runtime split at the step's end ([Note: drain split] in
    tfsmp/runtime/executor.py), as the trace shows them (``"1W6"``)."""
    out: dict[int, set[int]] = {}
    for a, _ in _compute_actions(steps, ("W",)):
        if a.stage not in split and a.microbatch is not None:
            out.setdefault(a.stage, set()).add(a.microbatch)
    return {s: frozenset(mbs) for s, mbs in out.items()}


def _w_in_forward(steps: Sequence[Step], stage: int, drained: Collection[int]) -> bool:
    """Whether ``stage``'s undrained W was part of its forward spans (the runtime's fused last
    stage: forward, loss and backward in one call) rather than its backward spans: where a
    drained microbatch's span is shorter than an undrained one's."""
    spans: dict[tuple[str, bool], list[float]] = {}
    for a, s in _compute_actions(steps, ("F", "B")):
        if a.stage == stage:
            spans.setdefault((s.kind, a.microbatch in drained), []).append(s.duration)

    def gap(kind: str) -> float:
        whole, split = spans.get((kind, False)), spans.get((kind, True))
        return statistics.fmean(whole) - statistics.fmean(split) if whole and split else 0.0

    return gap("F") > gap("B")


def _compute_actions(steps: Sequence[Step], kinds: tuple[str, ...]
                     ) -> Iterator[tuple[Any, Span]]:
    """Each span of ``kinds`` (compute kinds: ``"F"``, ``"B"``, ``"W"``) with its action,
    `Action.parse` of its name (``"1W6"``)."""
    from tfsmp.schedule.actions import Action

    for step in steps:
        for rank_spans in step.values():
            for s in rank_spans:
                if s.kind in kinds:
                    yield Action.parse(s.name), s


def _weight_times(steps: Sequence[Step], stages: int) -> list[float]:
    """Mean seconds of one W per stage over ``steps``; 0 for a stage without W spans."""
    times: dict[int, list[float]] = {}
    for step in steps:
        for spans in step.values():
            for s in spans:
                if s.kind == "W" and s.stage is not None:
                    times.setdefault(s.stage, []).append(s.duration)
    return [statistics.fmean(times[s]) if s in times else 0.0 for s in range(stages)]
