"""Lowering: receives before and sends after each compute action, skip links, REDUCE and STEP."""

from __future__ import annotations

import pytest

from tests.pure import graphs
from tfsmp.errors import ScheduleError
from tfsmp.partitioning.plan import StagePlan
from tfsmp.schedule import (
    Action,
    Op,
    StageLinks,
    format_schedule,
    generate,
    lower,
    parse_schedule,
    simulate,
    validate,
)


def test_chain_lowering_wraps_each_compute_action_in_its_messages() -> None:
    lowered = lower(generate("interleaved", 2, 2), None, 2)
    assert format_schedule(lowered) == (
        "0: 0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1 0REDUCE 0STEP\n"
        "1: 1RECV_F0<0 1F0 1B0 1SEND_B0>0 1RECV_F1<0 1F1 1B1 1SEND_B1>0 1REDUCE 1STEP")


def test_skip_links_send_straight_to_every_consumer_in_ascending_order() -> None:
    links = StageLinks(3, {0: [2, 1], 1: [2]})
    lowered = lower(parse_schedule("0: 0F0 0B0\n1: 1F0 1B0\n2: 2F0 2B0"), links, 3,
                    data_parallel=False)
    assert format_schedule(lowered) == (
        "0: 0F0 0SEND_F0>1 0SEND_F0>2 0RECV_B0<1 0RECV_B0<2 0B0 0STEP\n"
        "1: 1RECV_F0<0 1F0 1SEND_F0>2 1RECV_B0<2 1B0 1SEND_B0>0 1STEP\n"
        "2: 2RECV_F0<0 2RECV_F0<1 2F0 2B0 2SEND_B0>0 2SEND_B0>1 2STEP")
    validate(lowered, links=links)


def test_a_stage_plan_with_a_skip_connection_lowers_like_its_links() -> None:
    # l0 (stage 0) feeds l1 and, through the skip, `out` on stage 3.
    stage_of = {"l0": 0, "l1": 0, "l2": 1, "l3": 1, "l4": 2, "l5": 3, "out": 3}
    plan = StagePlan.from_assignment(graphs.skip(6), stage_of, 4)
    assert plan.peers_forward(0) == [1, 3] and plan.peers_backward(3) == [0, 2]
    compute = generate("interleaved", 4, 4)
    lowered = lower(compute, plan, 4)
    assert lowered == lower(compute, StageLinks(4, {0: [1, 3], 1: [2], 2: [3]}), 4)
    validate(lowered, links=plan)
    assert lowered[3][:4] == [Action(3, Op.RECV_F, 0, 0), Action(3, Op.RECV_F, 0, 2),
                              Action(3, Op.FORWARD, 0), Action(3, Op.BACKWARD, 0)]


def test_stages_on_one_rank_keep_their_send_and_receive_for_local_hand_off() -> None:
    lowered = lower(generate("interleaved", 1, 1, virtual_stages=2), None, 1)
    assert format_schedule(lowered) == (
        "0: 0F0 0SEND_F0>1 1RECV_F0<0 1F0 1B0 1SEND_B0>0 1REDUCE 0RECV_B0<1 0B0 0REDUCE 0STEP")
    validate(lowered)


def test_reduce_follows_each_stages_last_backward_and_step_ends_each_rank() -> None:
    lowered = lower(generate("interleaved", 2, 4, virtual_stages=2), None, 2)
    for rank, actions in lowered.items():
        assert actions[-1] == Action(rank, Op.STEP)
        for stage in {a.stage for a in actions if a.is_compute}:
            last_b = max(k for k, a in enumerate(actions) if a.op is Op.BACKWARD and a.stage == stage)
            (reduce_at,) = [k for k, a in enumerate(actions) if a.op is Op.REDUCE and a.stage == stage]
            assert reduce_at > last_b
            assert all(a.is_comm for a in actions[last_b + 1:reduce_at])


def test_reduce_buckets_and_no_data_parallelism() -> None:
    lowered = lower(generate("simple", 2, 1), None, 2, reduce_buckets=3)
    assert [str(a) for a in lowered[0][-4:]] == ["0REDUCE0", "0REDUCE1", "0REDUCE2", "0STEP"]
    validate(lowered)
    plain = lower(generate("simple", 2, 1), None, 2, data_parallel=False)
    assert not any(a.op is Op.REDUCE for acts in plain.values() for a in acts)
    with pytest.raises(ScheduleError, match=r"reduce_buckets must be a positive integer\. Received"):
        lower(generate("simple", 2, 1), None, 2, reduce_buckets=0)


def test_bucketed_reductions_share_the_stages_reduce_time() -> None:
    compute = generate("simple", 1, 1)
    one = simulate(lower(compute, None, 1), reduce_time=4.0)
    three = simulate(lower(compute, None, 1, reduce_buckets=4), reduce_time=4.0)
    assert one.makespan == three.makespan == 1.0 + 2.0 + 4.0


def test_lowering_rejects_lowered_input_wrong_ranks_and_mismatched_plans() -> None:
    lowered = lower(generate("simple", 2, 1), None, 2)
    with pytest.raises(ScheduleError, match=r"lower\(\) takes compute actions \(F/B/W\) only"):
        lower(lowered, None, 2)
    with pytest.raises(ScheduleError, match=r"Stage s runs on rank s % 2\. Received: 1F0 at rank 0"):
        lower(parse_schedule("0: 1F0 1B0\n1: 0F0 0B0"), None, 2)
    with pytest.raises(ScheduleError, match=r"same number of stages\. Received: plan\.num_stages=3"):
        lower(generate("simple", 2, 1), StageLinks.chain(3), 2)
    with pytest.raises(ScheduleError, match=r"has ranks 0\.\.2\. Received: ranks \[0, 1\]"):
        lower(generate("simple", 2, 1), None, 3)


def test_stage_links_reject_backward_links() -> None:
    with pytest.raises(ScheduleError, match=r"from a stage to a later stage in \[0, 3\)\. Received: 2 -> 1"):
        StageLinks(3, {2: [1]})
