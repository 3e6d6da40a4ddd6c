"""Zero-bubble schedules: the W action, stage placement, ZB-H1 and ZB-V, and W in every pass.

Covers the action text ``1W3``; `Placement` (interleaved and ZB-V's V) and its bad input;
generated zb-h1/zb-v schedules validating compute-only and lowered for p <= 4, m <= 3p; their
simulated bubble and peak memory against 1F1B at F = B = W; the runtime's fused last stage;
the validator's W rules; W in lowering, the simulator, the pictures, the CLI and the
measured-against-simulated comparison.
"""

from __future__ import annotations

import json
import re

import pytest

from tfsmp.errors import ScheduleError
from tfsmp.launch.cli import main
from tfsmp.schedule import (
    Action,
    Op,
    Placement,
    Schedule,
    TimelineEntry,
    format_schedule,
    fuse_last_stage,
    generate,
    lower,
    parse_schedule,
    peak_activations,
    peak_in_flight,
    rank_of_stage,
    render_ascii,
    render_staircase,
    simulate,
    stages_of_rank,
    validate,
)
from tfsmp.schedule.actions import COMPUTE_OPS
from tfsmp.schedule.registry import names

ZB = (("zb-h1", 1), ("zb-v", 2))


# every registered pipeline, as a message lists them (tfsmp/schedule/registry.py)
_PIPELINES = re.escape(str(list(names())))


def _zb(pipeline: str, p: int, m: int, cap: int | None = None) -> tuple[Schedule, Placement]:
    v = 2 if pipeline == "zb-v" else 1
    return generate(pipeline, p, m, v, cap), Placement.for_pipeline(pipeline, p, v)


def _without_w(schedule: Schedule) -> Schedule:
    """The schedule as 1F1B's accounting sees it: activations held until B."""
    return {r: [a for a in acts if a.op is not Op.WEIGHT] for r, acts in schedule.items()}


# -- the W action ----------------------------------------------------------------------------


def test_weight_action_text_round_trips() -> None:
    a = Action.parse("1W3")
    assert a == Action(1, Op.WEIGHT, 3) and str(a) == "1W3"
    assert Op.WEIGHT in COMPUTE_OPS and a.is_compute and not a.is_comm
    text = "0: 0F0 0B0 0W0\n1: 1F0 1B0 1W0"
    assert format_schedule(parse_schedule(text)) == text


@pytest.mark.parametrize(("text", "match"), [
    ("1W", r"A WEIGHT action needs a microbatch >= 0\. Received: stage=1"),
    ("1W3<2", r"Only send and receive actions have a peer, not WEIGHT"),
    ("1WEIGHT3", r"An action reads like '1F3', '1B3', '1W3'"),
])
def test_weight_action_needs_a_microbatch_and_no_peer(text: str, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        Action.parse(text)


# -- placement -------------------------------------------------------------------------------


def test_interleaved_placement_is_the_old_rule() -> None:
    where = Placement(4, 12)
    assert [where.rank(s) for s in range(12)] == [rank_of_stage(s, 4) for s in range(12)]
    assert [where.stages(r) for r in range(4)] == [stages_of_rank(r, 4, 12) for r in range(4)]
    assert where.last_rank == 3
    assert Placement.for_pipeline("interleaved", 4, 3) == where
    assert Placement.for_pipeline("zb-h1", 4) == Placement.for_pipeline("simple", 4) == Placement(4, 4)


def test_v_placement_goes_down_the_ranks_and_back() -> None:
    where = Placement.for_pipeline("zb-v", 4, 2)
    assert where == Placement(4, 8, "v")
    assert [where.rank(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [where.stages(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert where.last_rank == 0
    assert Placement(1, 2, "v").stages(0) == [0, 1]


@pytest.mark.parametrize(("make", "match"), [
    (lambda: Placement(0, 4), r"A Placement needs a positive integer num_ranks\. Received: num_ranks=0"),
    (lambda: Placement(2, 0), r"positive integer num_stages\. Received: num_stages=0"),
    (lambda: Placement(2, 4, "x"), r"Placement kind must be one of \['interleaved', 'v'\]\. Received: kind='x'"),
    (lambda: Placement(2, 6, "v"), r"num_stages = 2 x num_ranks\. Received: num_ranks=2, num_stages=6\. Partition into 4"),
    (lambda: Placement(2, 4).rank(4), r"A stage of this placement lies in \[0, 4\)\. Received: stage=4"),
    (lambda: Placement(2, 4).stages(-1), r"A rank of this placement lies in \[0, 2\)\. Received: rank=-1"),
    (lambda: Placement.for_pipeline("zb-v", 4), r"pipeline='zb-v' needs virtual_stages=2 .*Received: virtual_stages=1\. Set virtual_stages=2"),
    (lambda: Placement.for_pipeline("zb-h1", 4, 2), r"pipeline='zb-h1' needs virtual_stages=1"),
    (lambda: Placement.for_pipeline("1f1b", 4), rf"pipeline must be one of {_PIPELINES}\. Received: pipeline='1f1b'"),
    (lambda: Placement.for_pipeline("zb-v", 0, 2), r"num_ranks must be a positive integer\. Received: num_ranks=0"),
])
def test_bad_placements_are_schedule_errors(make: object, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        make()  # type: ignore[operator]


def test_generate_checks_the_chunk_count_of_zero_bubble_pipelines() -> None:
    with pytest.raises(ScheduleError, match=r"pipeline='zb-v' needs virtual_stages=2"):
        generate("zb-v", 2, 4)
    with pytest.raises(ScheduleError, match=r"pipeline='zb-h1' needs virtual_stages=1"):
        generate("zb-h1", 2, 4, virtual_stages=2)


# -- generated schedules -----------------------------------------------------------------------


@pytest.mark.parametrize(("pipeline", "v"), ZB)
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_generated_zero_bubble_schedules_lower_and_validate(pipeline: str, v: int, p: int) -> None:
    for m in range(1, 3 * p + 1):
        compute, where = _zb(pipeline, p, m)
        for rank, actions in compute.items():
            assert {a.stage for a in actions} == set(where.stages(rank))
            for op in (Op.FORWARD, Op.BACKWARD, Op.WEIGHT):  # each once per stage and microbatch
                got = sorted((a.stage, a.microbatch) for a in actions if a.op is op)
                assert got == [(s, i) for s in where.stages(rank) for i in range(m)]
        validate(compute, placement=where)
        lowered = lower(compute, None, p, placement=where)
        validate(lowered, placement=where)
        assert parse_schedule(format_schedule(lowered)) == lowered


@pytest.mark.parametrize(("pipeline", "v"), ZB)
def test_last_stage_backward_comes_right_after_its_forward(pipeline: str, v: int) -> None:
    for p in (1, 2, 3, 4):
        for m in (1, p, 2 * p + 1):
            compute, where = _zb(pipeline, p, m)
            last = where.num_stages - 1
            actions = compute[where.last_rank]
            for k, a in enumerate(actions):
                if a.stage == last and a.op is Op.FORWARD:
                    assert actions[k + 1] == Action(last, Op.BACKWARD, a.microbatch), (p, m, k)
            assert fuse_last_stage(compute) == compute  # W actions stay where they are


def test_fuse_last_stage_leaves_weight_actions_in_place() -> None:
    schedule = parse_schedule("0: 0F0 0F1 0B0 0W0 0B1 0W1\n1: 1F0 1F1 1B0 1W0 1B1 1W1")
    # Only the last stage's Bs move, each to right after its F; the Ws keep their order.
    assert format_schedule(fuse_last_stage(schedule)) == (
        "0: 0F0 0F1 0B0 0W0 0B1 0W1\n1: 1F0 1B0 1F1 1B1 1W0 1W1")


def test_zb_h1_is_1f1b_with_each_w_delayed_by_the_rank() -> None:
    assert format_schedule(generate("zb-h1", 3, 4)) == (
        "0: 0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3\n"
        "1: 1F0 1F1 1B0 1F2 1B1 1W0 1F3 1B2 1W1 1B3 1W2 1W3\n"
        "2: 2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3")
    for p in range(1, 6):
        for m in range(1, 13):
            assert _without_w(generate("zb-h1", p, m)) == generate("interleaved", p, m)


# -- bubble and memory -------------------------------------------------------------------------


def _bubble(pipeline: str, p: int, m: int) -> float:
    """Simulated bubble with F = B = W per rank (1F1B's backward is B + W = 2)."""
    if pipeline == "interleaved":
        return simulate(generate(pipeline, p, m), backward_time=2.0).bubble_fraction
    compute, where = _zb(pipeline, p, m)
    v = where.chunks_per_rank
    return simulate(compute, forward_time=1.0 / v, backward_time=2.0 / v, weight_time=1.0 / v,
                    placement=where).bubble_fraction


def test_zb_h1_cuts_1f1b_idle_time_to_a_third() -> None:
    p, m = 4, 8
    one_f_one_b, zb_h1 = _bubble("interleaved", p, m), _bubble("zb-h1", p, m)
    assert one_f_one_b == pytest.approx(3 / 11)
    # Idle per rank: (p-1)(F+B-W) = 3 units against 1F1B's (p-1)(F+B+W) = 9, over 3m = 24 of
    # work; as a fraction of the longer 1F1B step that is 0.407 of 1F1B's, the least any
    # schedule with 1F1B's peak memory reaches ([Note: ZB-H1]).
    assert zb_h1 == pytest.approx(3 / 27)
    assert zb_h1 <= 0.41 * one_f_one_b
    assert _bubble("zb-h1", 2, 8) == pytest.approx(1 / 25)  # step 25 units against 1F1B's 27


def test_zb_v_bubble_is_below_zb_h1() -> None:
    for p, m in ((4, 8), (2, 8), (3, 9), (4, 16)):
        assert _bubble("zb-v", p, m) < _bubble("zb-h1", p, m), (p, m)
    assert _bubble("zb-v", 4, 8) < 0.08
    assert _bubble("zb-v", 4, 24) < 0.03


def test_zb_h1_holds_1f1b_peak_memory() -> None:
    for p in range(1, 6):
        for m in range(1, 3 * p + 1):
            zb, ref = generate("zb-h1", p, m), generate("interleaved", p, m)
            # Until B, exactly 1F1B's per rank; until W, at most 1F1B's peak (its rank 0).
            assert peak_in_flight(_without_w(zb)) == peak_in_flight(ref) == [
                min(p - r, m) for r in range(p)]
            assert max(peak_in_flight(zb)) == max(peak_in_flight(ref)) == min(p, m)
            assert peak_activations(zb) == [min(p, m)] * p


def test_zb_v_holds_at_most_2p_half_chunks_per_rank() -> None:
    for p in range(1, 5):
        for m in range(1, 3 * p + 1):
            compute, where = _zb("zb-v", p, m)
            assert max(peak_activations(compute)) <= 2 * p
            result = simulate(compute, forward_time=0.5, backward_time=1.0, weight_time=0.5,
                              placement=where)
            assert result.peak_activations == peak_activations(compute)


@pytest.mark.parametrize(("pipeline", "v"), ZB)
def test_active_microbatches_caps_microbatches_until_their_w(pipeline: str, v: int) -> None:
    for p, m in ((4, 8), (3, 7), (2, 5)):
        for cap in range(1, m + 1):
            compute, where = _zb(pipeline, p, m, cap)
            assert max(peak_in_flight(compute)) <= cap, (p, m, cap)
            validate(lower(compute, None, p, placement=where), placement=where)


def test_peaks_count_a_microbatch_until_its_w() -> None:
    schedule = parse_schedule("0: 0F0 0B0 0F1 0B1 0W0 0W1")
    assert peak_activations(schedule) == [2] and peak_in_flight(schedule) == [2]
    assert peak_activations(_without_w(schedule)) == [1]
    with pytest.raises(ScheduleError, match=r"holds at most max_activations=1 .* holds 2 at step 2"):
        validate(schedule, max_activations=1)


# -- validator ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "match"), [
    ("0: 0F0 0W0 0B0", r"A stage runs a microbatch's W after its B\. Received: 0W0 at step 1 on "
                       r"rank 0, before its B at step 2"),
    ("0: 0F0 0F1 0B0 0W0 0B1", r"A stage with W actions runs the W of every microbatch 0\.\.1 "
                               r"\(its B computes only input gradients\)\. Received: no 0W1 on rank 0"),
    ("0: 0F0 0B0 0W0 0W0", r"Each stage runs each microbatch's weight once\. Received: 0W0 at "
                           r"rank 0, steps 2 and 3"),
    ("0: 0F0 0B0 0REDUCE 0W0 0STEP", r"A stage with W actions reduces its gradients after its "
                                     r"last W\. Received: 0REDUCE at step 2 of rank 0"),
])
def test_validator_rejects_misplaced_and_missing_weights(text: str, match: str) -> None:
    with pytest.raises(ScheduleError, match=match) as info:
        validate(parse_schedule(text))
    assert "<-- ERROR HERE" in str(info.value)


def test_validator_checks_the_v_placement() -> None:
    compute, where = _zb("zb-v", 2, 2)
    validate(compute, placement=where)
    with pytest.raises(ScheduleError, match=r"Stage s runs on rank s % 2\. Received: 3F0 on rank 0"):
        validate(compute)  # interleaved by default: stage 3 would be rank 1's
    swapped = {0: compute[1], 1: compute[0]}
    with pytest.raises(ScheduleError, match=r"In the V placement stage s runs on rank s for s < 2 "
                                            r"and on rank 3 - s after\. Received: 1F0 on rank 0 "
                                            r"\(step 0\); move it to rank 1"):
        validate(swapped, placement=where)
    with pytest.raises(ScheduleError, match=r"The placement must be for the schedule's ranks\. "
                                            r"Received: placement num_ranks=4"):
        validate(compute, placement=Placement(4, 8, "v"))


def test_validator_dry_run_stays_exact_with_weights() -> None:
    # W waits only for its own B, earlier on its rank; F and B keep their cross-rank waits.
    validate(parse_schedule("0: 0F0 0F1 0B0 0W0 0B1 0W1\n1: 1F0 1B0 1W0 1F1 1B1 1W1"))
    with pytest.raises(ScheduleError, match=r"The schedule deadlocks .*rank 0 waits at step 1 in "
                                            r"0B0 for 1B0; rank 1 waits at step 1 in 1F1 for 0F1"):
        validate(parse_schedule("0: 0F0 0B0 0W0 0F1 0B1 0W1\n1: 1F0 1F1 1B0 1W0 1B1 1W1"))


# -- lowering ----------------------------------------------------------------------------------


def test_lowering_gives_w_no_messages_and_reduces_after_the_last_w() -> None:
    compute = parse_schedule("0: 0F0 0F1 0B0 0B1 0W0 0W1\n1: 1F0 1B0 1F1 1B1 1W0 1W1")
    assert format_schedule(lower(compute, None, 2)) == (
        "0: 0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1 0W0 0W1 0REDUCE 0STEP\n"
        "1: 1RECV_F0<0 1F0 1B0 1SEND_B0>0 1RECV_F1<0 1F1 1B1 1SEND_B1>0 1W0 1W1 1REDUCE 1STEP")
    bucketed = lower(compute, None, 2, reduce_buckets=2)
    assert [str(a) for a in bucketed[1][-4:]] == ["1W1", "1REDUCE0", "1REDUCE1", "1STEP"]


def test_lowering_follows_the_placement() -> None:
    compute, where = _zb("zb-v", 2, 1)
    lowered = lower(compute, None, 2, placement=where)
    assert format_schedule(lowered) == (
        "0: 0F0 0SEND_F0>1 3RECV_F0<2 3F0 3B0 3SEND_B0>2 3W0 3REDUCE 0RECV_B0<1 0B0 0W0 0REDUCE "
        "0STEP\n"
        "1: 1RECV_F0<0 1F0 1SEND_F0>2 2RECV_F0<1 2F0 2SEND_F0>3 2RECV_B0<3 2B0 2SEND_B0>1 "
        "1RECV_B0<2 1B0 1SEND_B0>0 2W0 2REDUCE 1W0 1REDUCE 1STEP")
    with pytest.raises(ScheduleError, match=r"Stage s runs on rank s % 2\. Received: 3F0 at rank "
                                            r"0, step 1\. Pass the schedule's placement"):
        lower(compute, None, 2)
    with pytest.raises(ScheduleError, match=r"The placement must be for the schedule's ranks and "
                                            r"stages\. Received: placement num_ranks=2, "
                                            r"num_stages=6"):
        lower(compute, None, 2, placement=Placement(2, 6))


# -- simulator ---------------------------------------------------------------------------------


def test_simulator_splits_the_backward_into_b_and_w() -> None:
    compute = parse_schedule("0: 0F0 0B0 0W0")
    result = simulate(compute, forward_time=1.0, backward_time=3.0, weight_time=1.0)
    spans = {str(e.action): (e.start, e.end) for e in result.timeline}
    assert spans["0B0"] == (1.0, 3.0) and spans["0W0"] == (3.0, 4.0)
    assert result.makespan == 4.0 and result.busy == [4.0]
    # A stage without W actions runs its whole backward in B; weight_time does not apply.
    plain = simulate(parse_schedule("0: 0F0 0B0"), backward_time=3.0, weight_time=1.0)
    assert plain.makespan == 4.0
    with pytest.raises(ScheduleError, match=r"0 <= weight_time <= backward_time\. Received: "
                                            r"stage 0: weight_time=4\.0, backward_time=3\.0"):
        simulate(compute, backward_time=3.0, weight_time=4.0)


def test_simulator_sends_between_v_neighbours_on_one_rank_for_free() -> None:
    compute, where = _zb("zb-v", 2, 1)
    result = simulate(compute, forward_time=1.0, backward_time=2.0, weight_time=1.0,
                      comm_time=10.0, placement=where)
    start = {str(e.action): e.start for e in result.timeline}
    assert start["2F0"] == start["1F0"] + 1.0          # stage 1 -> 2 stays on rank 1
    assert start["3F0"] == start["2F0"] + 1.0 + 10.0   # stage 2 -> 3 crosses to rank 0
    assert result.placement == where


# -- pictures and CLI --------------------------------------------------------------------------


def test_pictures_show_w_cells_and_the_v_placement() -> None:
    compute, where = _zb("zb-v", 2, 2)
    result = simulate(compute, forward_time=0.5, backward_time=1.0, weight_time=0.5,
                      placement=where)
    rows = render_staircase(result).splitlines()
    assert rows[0].startswith("rank 0 (stages 0, 3): 0F0 0F1 .   3F0 3B0 ")
    assert rows[1].startswith("rank 1 (stages 1, 2): .   1F0 2F0 ")
    assert "3W0" in rows[0] and "2W0" in rows[1]
    h1 = simulate(generate("zb-h1", 2, 2), backward_time=2.0, weight_time=1.0)
    assert render_staircase(h1).splitlines() == [
        "rank 0: F0 F1 .  B0 W0 B1 W1",
        "rank 1: .  F0 B0 F1 B1 W0 W1"]
    assert "0W0" in render_ascii(compute)


def test_timeline_image_draws_w_boxes(tmp_path: object) -> None:
    pytest.importorskip("matplotlib")
    from pathlib import Path

    from tfsmp.schedule import render_timeline

    compute, where = _zb("zb-v", 2, 4)
    result = simulate(compute, forward_time=0.5, backward_time=1.0, weight_time=0.5,
                      placement=where)
    out = render_timeline(result, Path(str(tmp_path)) / "zbv.svg")
    svg = out.read_text()
    assert "weight gradient (W)" in svg and "rank 0 (stages 0, 3)" in svg


def test_cli_prints_the_zb_h1_bubble(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "--pipeline", "zb-h1", "-p", "4", "-m", "8"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1] == (
        "rank 0: F0 F1 F2 F3 .  .  .  B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7")
    assert "bubble fraction: 0.1111 (formula (p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W)) = 0.1111)" in out
    assert "a backward 2 (B 1 + W 1)" in out


def test_cli_runs_zb_v_with_two_chunks_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "--pipeline", "zb-v", "-p", "2", "-m", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["virtual_stages"] == 2 and data["weight_time"] == 1.0
    assert data["formula_bubble_fraction"] is None
    assert data["bubble_fraction"] == pytest.approx(_bubble("zb-v", 2, 4))
    assert main(["schedule", "--pipeline", "zb-v", "-p", "2", "-m", "4", "-v", "3"]) == 2
    assert "pipeline='zb-v' needs virtual_stages=2" in capsys.readouterr().err


# -- measured against simulated ------------------------------------------------------------------


@pytest.mark.parametrize(("pipeline", "v"), [*ZB, ("interleaved", 1)])
def test_comparison_with_the_simulator_passes_w_and_placement(pipeline: str, v: int) -> None:
    """Spans that are the simulator's own timeline must be predicted exactly."""
    from tfsmp.timeline.render import Span, compare_with_simulator

    p, m = 2, 4
    where = Placement.for_pipeline(pipeline, p, v)
    sim = simulate(fuse_last_stage(generate(pipeline, p, m, v)), forward_time=1.0 / v,
                   backward_time=3.0 / v, weight_time=1.0 / v, placement=where)
    step = {r: [Span(e.rank, str(e.action), e.action.op.value, e.start, e.end)
                for e in sim.timeline if e.rank == r and e.action.is_compute] for r in range(p)}
    report = compare_with_simulator([step], pipeline, v)
    assert report["predicted_bubble"] == pytest.approx(sim.bubble_fraction)
    assert report["measured_bubble"] == pytest.approx(sim.bubble_fraction)
    assert report["predicted"] == pytest.approx(report["measured"])


@pytest.mark.parametrize("fused", [False, True])
def test_comparison_with_the_simulator_models_the_drain_split(fused: bool) -> None:
    """A 1F1B trace whose last stage split its last two backwards and ran their W's later
    ([Note: drain split] in tfsmp/runtime/executor.py) is predicted exactly, whether the W of
    an unsplit backward sat in the stage's backward spans or (the runtime's fused last stage)
    in its forward spans; before, every backward of that stage was simulated with a W."""
    from tfsmp.timeline.render import Span, compare_with_simulator

    p, m = 2, 6
    drain = {1: {4, 5}}
    sim = simulate(fuse_last_stage(generate("interleaved", p, m)), forward_time=[1.0, 1.5],
                   backward_time=[2.0, 2.5], weight_time=[0.0, 1.0], drain=drain)
    assert {str(e.action) for e in sim.timeline if e.action.op is Op.WEIGHT} == {"1W4", "1W5"}

    def span(e: TimelineEntry) -> Span:
        start, end = e.start, e.end
        a = e.action
        if fused and a.stage == 1 and a.op is Op.FORWARD:  # F + B in one span, B a hand-over
            end += 2.5 - (1.0 if a.microbatch in drain[1] else 0.0)
        if fused and a.stage == 1 and a.op is Op.BACKWARD:
            start = end = e.end
        return Span(e.rank, str(a), a.op.value, start, end)

    step = {r: [span(e) for e in sim.timeline if e.rank == r and e.action.is_compute]
            for r in range(p)}
    report = compare_with_simulator([step], "interleaved", 1)
    assert report["simulated"]["drain"] == {"1": [4, 5]}
    assert report["predicted"] == pytest.approx(report["measured"])
    assert report["predicted_bubble"] == pytest.approx(sim.bubble_fraction)


def test_drained_ws_fill_a_wait_and_keep_every_rank_busy_as_long() -> None:
    """Drained W's run while their rank would wait, before the STEP at the latest: the
    makespan shrinks, each rank's busy time does not change, and a split stage refuses."""
    compute = fuse_last_stage(generate("simple", 2, 8))
    times = {"forward_time": [0.023, 0.042], "backward_time": [0.040, 0.022],
             "weight_time": [0.0, 0.022]}
    plain = simulate(compute, **times)
    drained = simulate(compute, **times, drain={1: {6, 7}})
    assert drained.busy == pytest.approx(plain.busy)
    assert drained.makespan < plain.makespan - 0.02
    rank1 = [str(e.action) for e in drained.timeline if e.rank == 1]
    assert rank1[rank1.index("1SEND_B7>0") + 1:] == ["1W6", "1W7", "1STEP"]
    with pytest.raises(ScheduleError, match="drain names stages without W actions"):
        simulate(generate("zb-h1", 2, 4), backward_time=2.0, weight_time=1.0, drain={1: {3}})
