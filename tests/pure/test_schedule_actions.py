"""Action IR: text forms that parse back, schedule text, placement and message tags."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tfsmp.errors import ScheduleError
from tfsmp.schedule.actions import (
    Action,
    Op,
    format_schedule,
    message_key,
    message_tag,
    parse_schedule,
    rank_of_stage,
    stages_of_rank,
    tag_upper_bound,
)


@pytest.mark.parametrize(("text", "action"), [
    ("1F3", Action(1, Op.FORWARD, 3)),
    ("1B3", Action(1, Op.BACKWARD, 3)),
    ("1SEND_F3>2", Action(1, Op.SEND_F, 3, 2)),
    ("2RECV_F3<1", Action(2, Op.RECV_F, 3, 1)),
    ("2SEND_B3>1", Action(2, Op.SEND_B, 3, 1)),
    ("1RECV_B3<2", Action(1, Op.RECV_B, 3, 2)),
    ("1REDUCE", Action(1, Op.REDUCE)),
    ("1REDUCE2", Action(1, Op.REDUCE, 2)),
    ("1STEP", Action(1, Op.STEP)),
    ("12F31", Action(12, Op.FORWARD, 31)),
])
def test_text_form_matches_the_documented_spelling_and_parses_back(text: str, action: Action) -> None:
    assert str(action) == text
    assert Action.parse(text) == action


_ops_with_fields = st.one_of(
    st.builds(lambda s, o, i: Action(s, o, i), st.integers(0, 99),
              st.sampled_from([Op.FORWARD, Op.BACKWARD]), st.integers(0, 999)),
    st.builds(lambda s, o, i, d: Action(s, o, i, s + d), st.integers(0, 99),
              st.sampled_from([Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B]), st.integers(0, 999),
              st.integers(1, 9)),
    st.builds(lambda s, b: Action(s, Op.REDUCE, b), st.integers(0, 99),
              st.none() | st.integers(0, 9)),
    st.builds(lambda s: Action(s, Op.STEP), st.integers(0, 99)),
)


@given(_ops_with_fields)
def test_every_action_round_trips_through_its_text(action: Action) -> None:
    assert Action.parse(str(action)) == action


@pytest.mark.parametrize("text", ["", "F3", "1X3", "1F", "1SEND_F3", "1SEND_F3<2", "1RECV_F3>0",
                                  "1F3>2", "1STEP4", "-1F3", "1F3 1B3"])
def test_bad_text_is_a_schedule_error(text: str) -> None:
    with pytest.raises(ScheduleError, match=r"An action reads like|needs|Only send|has no micro|point"):
        Action.parse(text)


def test_fields_that_do_not_fit_the_op_are_rejected_at_construction() -> None:
    with pytest.raises(ScheduleError, match=r"A FORWARD action needs a microbatch >= 0\. Received"):
        Action(0, Op.FORWARD)
    with pytest.raises(ScheduleError, match="needs a peer stage >= 0 other than its own stage"):
        Action(1, Op.SEND_F, 0, 1)
    with pytest.raises(ScheduleError, match="Only send and receive actions have a peer"):
        Action(1, Op.FORWARD, 0, 2)


def test_actions_sort_by_stage_then_op() -> None:
    actions = [Action(1, Op.BACKWARD, 0), Action(0, Op.STEP), Action(1, Op.FORWARD, 2),
               Action(0, Op.REDUCE)]
    assert [str(a) for a in sorted(actions)] == ["0REDUCE", "0STEP", "1F2", "1B0"]


def test_schedule_text_has_one_line_per_rank_and_parses_back() -> None:
    schedule = {0: [Action(0, Op.FORWARD, 0), Action(0, Op.SEND_F, 0, 1)],
                1: [Action(1, Op.RECV_F, 0, 0)], 2: []}
    text = format_schedule(schedule)
    assert text == "0: 0F0 0SEND_F0>1\n1: 1RECV_F0<0\n2:"
    assert parse_schedule("# comment\n\n" + text) == schedule


def test_parse_schedule_rejects_bad_lines_and_repeated_ranks() -> None:
    with pytest.raises(ScheduleError, match=r"reads '<rank>: <action> <action> \.\.\.'\. Received: line 1"):
        parse_schedule("zero: 0F0")
    with pytest.raises(ScheduleError, match=r"Each rank has one line\. Received: rank 0 twice"):
        parse_schedule("0: 0F0\n0: 0B0")


def test_stage_placement_is_megatrons_round_robin() -> None:
    assert [rank_of_stage(s, 4) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert stages_of_rank(1, 4, 12) == [1, 5, 9]
    with pytest.raises(ScheduleError, match="num_ranks >= 1"):
        rank_of_stage(0, 0)


def test_message_tags_are_unique_and_below_the_bound() -> None:
    boundaries, stages, mbs = 3, 5, 4
    tags = [message_tag(b, d, i, back, stages, mbs)
            for b, d, i, back in itertools.product(range(boundaries), range(stages), range(mbs),
                                                   (False, True))]
    assert len(set(tags)) == len(tags)
    assert min(tags) == 0 and max(tags) == tag_upper_bound(boundaries, stages, mbs) - 1
    assert message_tag(2, 3, 1, True, stages, mbs) == ((2 * 5 + 3) * 4 + 1) * 2 + 1


def test_message_tag_rejects_out_of_range_arguments() -> None:
    with pytest.raises(ScheduleError, match=r"0 <= microbatch < num_microbatches\. Received"):
        message_tag(0, 1, 4, False, 2, 4)


def test_a_send_and_its_receive_name_the_same_message() -> None:
    assert message_key(Action(1, Op.SEND_F, 3, 2)) == message_key(Action(2, Op.RECV_F, 3, 1))
    assert message_key(Action(2, Op.SEND_B, 3, 1)) == message_key(Action(1, Op.RECV_B, 3, 2))
    assert message_key(Action(1, Op.SEND_F, 3, 2)) != message_key(Action(1, Op.RECV_B, 3, 2))
