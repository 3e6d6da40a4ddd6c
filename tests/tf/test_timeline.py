"""The measured timeline: tracer events -> steps, idle analysis, simulator comparison, Gantt
picture, Chrome trace, and `tfsmp timeline`; plus a real traced `fit` in a world of one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tfsmp.launch.cli import main as cli_main
from tfsmp.schedule import Op, fuse_last_stage, generate, simulate
from tfsmp.timeline import render as tr
from tfsmp.timeline.events import Tracer, load_events

pytestmark = pytest.mark.tf


def ev(rank: int, name: str, kind: str, start: float, end: float) -> dict[str, object]:
    return {"rank": rank, "name": name, "kind": kind, "start": start, "end": end}


# Two ranks, m = 2, times in seconds: rank 1 waits 1 s for the first activation.
TWO_RANKS = [
    ev(0, "0F0", "F", 0.0, 1.0), ev(0, "0SEND_F0>1", "SEND_F", 1.0, 1.0),
    ev(0, "0F1", "F", 1.0, 2.0), ev(0, "0SEND_F1>1", "SEND_F", 2.0, 2.0),
    ev(0, "0RECV_B0<1", "RECV_B", 2.0, 3.0), ev(0, "0B0", "B", 3.0, 5.0),
    ev(0, "0RECV_B1<1", "RECV_B", 5.0, 5.0), ev(0, "0B1", "B", 5.0, 7.0),
    ev(0, "0STEP", "STEP", 7.0, 7.5),
    ev(1, "1RECV_F0<0", "RECV_F", 0.0, 1.0), ev(1, "1F0", "F", 1.0, 3.0),
    ev(1, "1B0", "B", 3.0, 3.0), ev(1, "1SEND_B0>0", "SEND_B", 3.0, 3.0),
    ev(1, "1RECV_F1<0", "RECV_F", 3.0, 3.0), ev(1, "1F1", "F", 3.0, 5.0),
    ev(1, "1B1", "B", 5.0, 5.0), ev(1, "1SEND_B1>0", "SEND_B", 5.0, 5.0),
    ev(1, "1STEP", "STEP", 5.0, 7.5),
]


def shifted(events: list[dict[str, object]], by: float) -> list[dict[str, object]]:
    return [{**e, "start": float(e["start"]) + by, "end": float(e["end"]) + by}  # type: ignore[arg-type]
            for e in events]


def test_training_steps_split_each_rank_at_its_step_action() -> None:
    events = TWO_RANKS + shifted(TWO_RANKS, 10.0) + [ev(0, "0F0", "F", 30.0, 31.0)]
    steps = tr.training_steps(events)
    assert len(steps) == 2  # the trailing forward without STEP is not a training step
    assert steps[1][1][0].name == "1RECV_F0<0"
    assert steps[1][0][0].start == 10.0
    assert tr.training_steps([ev(0, "0F0", "F", 0.0, 1.0)]) == []


def test_step_stats_window_busy_receive_wait_and_idle() -> None:
    st = tr.step_stats(tr.training_steps(TWO_RANKS)[0])
    assert (st.start, st.end, st.window) == (0.0, 7.0, 7.0)  # last compute end, not STEP
    assert st.busy == {0: 6.0, 1: 4.0}
    assert st.receive_wait == {0: 1.0, 1: 1.0}
    assert st.idle_fraction(0) == pytest.approx(1 / 7)
    assert st.idle_fraction(1) == pytest.approx(3 / 7)
    assert st.receive_fraction(1) == pytest.approx(1 / 7)
    assert st.bubble_fraction == pytest.approx(1 - 10 / 14)


def test_stage_times_are_medians_per_stage_and_kind() -> None:
    forward, backward = tr.stage_times(tr.training_steps(TWO_RANKS))
    assert forward == [1.0, 2.0] and backward == [2.0, 0.0]
    slow = [{**e, "end": float(e["end"]) + 1.0} if e["name"] == "0F0" else e for e in TWO_RANKS]
    uneven = tr.training_steps(TWO_RANKS + shifted(TWO_RANKS, 10.0) + shifted(slow, 20.0))
    assert tr.stage_times(uneven)[0][0] == 1.0  # stage 0 forwards: 1, 1, 1, 1, 2, 1
    assert tr.stage_times(uneven, "mean")[0][0] == pytest.approx(7 / 6)
    with pytest.raises(ValueError, match="needs steps with F/B spans"):
        tr.stage_times([])
    with pytest.raises(ValueError, match="statistic must be 'median' or 'mean'"):
        tr.stage_times([], "max")


def test_idle_spans_are_the_gaps_inside_the_window() -> None:
    spans = tr.spans_of([ev(0, "0F0", "F", 1.0, 2.0), ev(0, "0B0", "B", 3.0, 4.0)])
    gaps = tr.idle_spans(spans, 0.0, 5.0)
    assert [(g.start, g.end, g.kind) for g in gaps] == [(0.0, 1.0, "idle"), (2.0, 3.0, "idle"),
                                                        (4.0, 5.0, "idle")]


def test_spans_of_rejects_foreign_events() -> None:
    with pytest.raises(ValueError, match="A trace event needs rank, name, kind, start and end"):
        tr.spans_of([{"name": "x"}])


def test_chrome_trace_has_one_thread_per_rank_and_microsecond_events() -> None:
    trace = tr.chrome_trace(TWO_RANKS)
    events = trace["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"rank 0", "rank 1"}
    f0 = next(e for e in events if e.get("name") == "1F0")
    assert (f0["ph"], f0["tid"], f0["ts"], f0["dur"], f0["cat"]) == ("X", 1, 1e6, 2e6, "forward")
    assert not [e for e in events if e.get("cat") == "idle"]  # no gaps in TWO_RANKS
    json.dumps(trace)  # serializable
    gap = tr.chrome_trace([ev(0, "0F0", "F", 0.0, 1.0), ev(0, "0B0", "B", 2.0, 3.0),
                           ev(0, "0STEP", "STEP", 3.0, 3.5), ev(0, "0F0", "F", 9.0, 10.0)])
    idle = [(e["ts"], e["dur"]) for e in gap["traceEvents"] if e.get("cat") == "idle"]
    assert idle == [(1e6, 1e6)]  # the time between steps is not idle pipeline time


def simulated_events(pipeline: str, p: int, m: int) -> list[dict[str, object]]:
    """The simulator's own timeline written as tracer events (what a perfect runtime records:
    the runtime executes `fuse_last_stage` of the generated schedule)."""
    result = simulate(fuse_last_stage(generate(pipeline, p, m)), forward_time=[1.0, 1.5],
                      backward_time=[2.0, 0.5])
    out = []
    for e in result.timeline:
        kind = e.action.op.value
        out.append(ev(e.rank, str(e.action), kind, e.start, e.end))
    return out


@pytest.mark.parametrize("pipeline", ["interleaved", "simple"])
def test_a_runtime_that_behaves_like_the_simulator_measures_its_prediction(pipeline: str) -> None:
    events = simulated_events(pipeline, 2, 4)
    steps = tr.training_steps(events + shifted(events, 100.0))
    cmp = tr.compare_with_simulator(steps, pipeline)
    assert cmp["microbatches"] == 4 and cmp["ranks"] == 2
    assert cmp["forward"] == [1.0, 1.5] and cmp["backward"] == [2.0, 0.5]
    assert cmp["measured"] == pytest.approx(cmp["predicted"])
    assert cmp["measured_bubble"] == pytest.approx(cmp["predicted_bubble"])
    with pytest.raises(ValueError, match="needs at least one training step"):
        tr.compare_with_simulator([])


def test_render_gantt_writes_a_picture(tmp_path: Path) -> None:
    out = tr.render_gantt(tr.training_steps(TWO_RANKS), tmp_path / "t.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="needs at least one training step"):
        tr.render_gantt([], tmp_path / "u.png")


def write_trace(directory: Path, events: list[dict[str, object]]) -> None:
    for rank in (0, 1):
        tracer = Tracer(str(directory), rank)
        for e in events:
            if e["rank"] == rank:
                tracer.mark(str(e["name"]), str(e["kind"]), float(e["start"]), float(e["end"]))  # type: ignore[arg-type]
        tracer.flush()


def test_tfsmp_timeline_draws_writes_chrome_trace_and_compares(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    events = simulated_events("interleaved", 2, 4)
    write_trace(tmp_path / "trace", events + shifted(events, 100.0))
    code = cli_main(["timeline", str(tmp_path / "trace"), "--out", str(tmp_path / "t.png"),
                     "--compare", "interleaved", "--steps", "2"])
    text = capsys.readouterr().out
    assert code == 0
    assert "2 training steps" in text and "simulated" in text
    assert (tmp_path / "t.png").exists()
    chrome = json.loads((tmp_path / "t.json").read_text())
    assert any(e.get("name") == "1F3" for e in chrome["traceEvents"])
    code = cli_main(["timeline", str(tmp_path / "trace"), "--json", "--skip", "0"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["steps"] == 2 and len(summary["per_step"]) == 2


@pytest.mark.parametrize(("argv", "message"), [
    (["missing-dir"], "the trace directory must exist"),
    (["{dir}", "--out", "t.txt"], "--out must end in .png, .svg, .pdf"),
    (["{empty}"], "the trace directory holds no events"),
])
def test_tfsmp_timeline_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               argv: list[str], message: str) -> None:
    write_trace(tmp_path / "trace", TWO_RANKS)
    (tmp_path / "empty").mkdir()
    argv = [a.format(dir=tmp_path / "trace", empty=tmp_path / "empty") for a in argv]
    assert cli_main(["timeline", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_traced_fit_records_every_action_and_untraced_runs_hold_no_tracer(tmp_path: Path) -> None:
    import numpy as np

    import tfsmp as smp
    from benchmarks.tfhelp import dense_stack

    if smp.is_initialized():
        smp.shutdown()
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    try:
        smp.init({"partitions": 1, "microbatches": 2, "trace_dir": str(tmp_path / "trace")})
        model = smp.DistributedModel(lambda: dense_stack(8, 2, name="traced"))
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x, x, batch_size=16, epochs=1, verbose=0)
        model._engine._tracer.flush()
        smp.shutdown()
        smp.init({"partitions": 1, "microbatches": 2})
        plain = smp.DistributedModel(lambda: dense_stack(8, 2, name="plain"))
        plain.compile(optimizer="sgd", loss="mse")
        plain.fit(x, x, batch_size=16, epochs=1, verbose=0)
        assert plain._engine._tracer is None  # tracing off: the executor gets no tracer at all
    finally:
        smp.shutdown()
    events = load_events(str(tmp_path / "trace"))
    kinds = [e["kind"] for e in events]
    assert kinds.count("F") == 4 and kinds.count("B") == 4 and kinds.count("STEP") == 2
    steps = tr.training_steps(events)
    assert len(steps) == 2 and tr.step_stats(steps[1]).busy[0] > 0
    assert [a for a in kinds if a not in {op.value for op in Op}] == []
