"""Simulator: the bubble formulas hold exactly for balanced stages; costs move the makespan."""

from __future__ import annotations

import pytest

from tfsmp.errors import ScheduleError
from tfsmp.schedule import (
    Action,
    Op,
    StageLinks,
    generate,
    lower,
    parse_schedule,
    simulate,
)


def _bubble(p: int, m: int, v: int = 1) -> float:
    return (p - 1) / (v * m + p - 1)


@pytest.mark.parametrize("pipeline", ["simple", "interleaved"])
@pytest.mark.parametrize("backward_ratio", [1.0, 2.0, 3.0])
def test_balanced_bubble_is_p_minus_1_over_m_plus_p_minus_1(pipeline: str,
                                                           backward_ratio: float) -> None:
    for p in range(1, 9):
        for m in range(1, 33):
            result = simulate(generate(pipeline, p, m), forward_time=1.0,
                              backward_time=backward_ratio)
            assert result.bubble_fraction == pytest.approx(_bubble(p, m), abs=1e-9)
            assert result.rank_bubble_fraction == pytest.approx([_bubble(p, m)] * p, abs=1e-9)
            assert result.makespan == pytest.approx((m + p - 1) * (1 + backward_ratio))


@pytest.mark.parametrize("pipeline", ["simple", "interleaved"])
@pytest.mark.parametrize("backward_ratio", [1.0, 2.0])
def test_virtual_stages_divide_the_bubble_time_by_v(pipeline: str, backward_ratio: float) -> None:
    # Same model, split into v chunks per rank: each chunk takes 1/v of the rank's time.
    # Bubble time (p-1)(T_F+T_B)/v, so the idle share is (p-1)/(v·m + p-1) and
    # bubble/ideal = (p-1)/(v·m), Megatron's (1/v)(p-1)/m. Exact when p divides m.
    for p in range(1, 9):
        for v in range(2, 5):
            for m in range(p, 33, p):
                result = simulate(generate(pipeline, p, m, v), forward_time=1.0 / v,
                                  backward_time=backward_ratio / v)
                assert result.bubble_fraction == pytest.approx(_bubble(p, m, v), abs=1e-9)
                ideal = m * (1 + backward_ratio)
                assert (result.makespan - ideal) / ideal == pytest.approx((p - 1) / (v * m))


def test_when_p_does_not_divide_m_virtual_stages_still_never_idle_more_than_v1() -> None:
    for p in (3, 4, 8):
        for v in (2, 3):
            for m in range(1, 20):
                if m % p == 0:
                    continue
                result = simulate(generate("interleaved", p, m, v), forward_time=1 / v,
                                  backward_time=2 / v)
                assert _bubble(p, m, v) - 1e-9 <= result.bubble_fraction <= _bubble(p, m) + 1e-9


def test_peak_activations_are_m_for_simple_and_at_most_p_minus_r_for_interleaved() -> None:
    assert simulate(generate("simple", 4, 8)).peak_activations == [8, 8, 8, 8]
    assert simulate(generate("interleaved", 4, 8)).peak_activations == [4, 3, 2, 1]
    assert simulate(generate("interleaved", 4, 2)).peak_activations == [2, 2, 2, 1]


def test_result_fields_for_a_small_schedule() -> None:
    result = simulate(generate("interleaved", 2, 2), forward_time=1.0, backward_time=2.0)
    assert result.makespan == 9.0
    assert result.busy == [6.0, 6.0]
    assert result.bubble_fraction == pytest.approx(1 / 3)
    compute = [(e.rank, str(e.action), e.start, e.end) for e in result.timeline
               if e.action.is_compute]
    assert compute == [(0, "0F0", 0.0, 1.0), (0, "0F1", 1.0, 2.0), (0, "0B0", 4.0, 6.0),
                       (0, "0B1", 7.0, 9.0), (1, "1F0", 1.0, 2.0), (1, "1B0", 2.0, 4.0),
                       (1, "1F1", 4.0, 5.0), (1, "1B1", 5.0, 7.0)]
    assert set(result.to_dict()) >= {"makespan", "bubble_fraction", "peak_activations"}


def test_communication_time_delays_receives_but_not_local_hand_off() -> None:
    free = simulate(generate("interleaved", 2, 1), forward_time=1.0, backward_time=1.0)
    slow = simulate(generate("interleaved", 2, 1), forward_time=1.0, backward_time=1.0,
                    comm_time=0.5)
    assert slow.makespan == free.makespan + 2 * 0.5
    per_message = simulate(generate("interleaved", 2, 1), forward_time=1.0, backward_time=1.0,
                           comm_time=lambda a: 0.25 if a.op is Op.SEND_F else 0.0)
    assert per_message.makespan == free.makespan + 0.25
    local = simulate(generate("interleaved", 1, 1, virtual_stages=2), comm_time=5.0)
    assert local.makespan == 2 * (1.0 + 2.0)


def test_the_slowest_stage_sets_the_beat() -> None:
    result = simulate(generate("interleaved", 3, 8), forward_time=[1.0, 2.0, 1.0],
                      backward_time=[2.0, 4.0, 2.0])
    # Stage 1 works 8 × 6; before it, stage 0's first forward (1); after it, stage 0's last
    # backward (2); inside, one unit waiting for its first gradient (stage 2 needs 1 + 2 after
    # 1F0, while 1F1 only fills 2 of them).
    assert result.makespan == pytest.approx(48.0 + 1.0 + 2.0 + 1.0)
    assert result.rank_bubble_fraction[1] < result.rank_bubble_fraction[0]


def test_reductions_overlap_compute_and_step_waits_for_them() -> None:
    lowered = lower(generate("interleaved", 1, 2, virtual_stages=2), None, 1)
    result = simulate(lowered, forward_time=1.0, backward_time=1.0, reduce_time=3.0,
                      step_time=0.5)
    reduces = [e for e in result.timeline if e.action.op is Op.REDUCE]
    assert [(str(e.action), e.start, e.end) for e in reduces] == [("1REDUCE", 7.0, 10.0),
                                                                  ("0REDUCE", 10.0, 13.0)]
    assert result.makespan == 13.5 and result.busy == [8.0]


def test_skip_links_add_waits_for_the_skipped_tensor() -> None:
    links = StageLinks(3, {0: [1, 2], 1: [2]})
    compute = generate("simple", 3, 1)
    slow_skip = simulate(compute, links=links, forward_time=1.0, backward_time=1.0,
                         comm_time=lambda a: 10.0 if {a.stage, a.peer} == {0, 2} else 0.0)
    # 0F0, the skip message, 2F0, 2B0, the skip gradient, 0B0.
    assert slow_skip.makespan == 1 + 10 + 1 + 1 + 10 + 1


def test_invalid_inputs_raise() -> None:
    with pytest.raises(ScheduleError, match=r"forward_time needs one value per stage\. Received: 2 values for 3"):
        simulate(generate("simple", 3, 1), forward_time=[1.0, 1.0])
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(parse_schedule("0: 0F0 0B0 0F1 0B1\n1: 1F0 1F1 1B0 1B1"))
    assert Action(0, Op.STEP) in lower(generate("simple", 1, 1), None, 1)[0]
