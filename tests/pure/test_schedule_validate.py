"""Validator: hand-broken schedules fail with the rule, the rank × step grid and the step marked."""

from __future__ import annotations

import re

import pytest

from tfsmp.errors import ScheduleError
from tfsmp.schedule import (
    StageLinks,
    format_schedule,
    generate,
    lower,
    parse_schedule,
    render_ascii,
    validate,
)


def _broken(text: str) -> str:
    """Validates a schedule that must fail; returns the error message."""
    with pytest.raises(ScheduleError) as info:
        validate(parse_schedule(text))
    return str(info.value)


def _lowered_text(pipeline: str, p: int, m: int, v: int = 1) -> str:
    return format_schedule(lower(generate(pipeline, p, m, v), None, p))


def test_a_swapped_receive_is_reported_with_the_grid() -> None:
    text = _lowered_text("simple", 2, 2).replace("1RECV_F0<0 1F0", "1RECV_FX 1F0")
    text = text.replace("1RECV_F1<0", "1RECV_F0<0").replace("1RECV_FX", "1RECV_F1<0")
    message = _broken(text)
    assert message.startswith(
        "Every send needs one receive of the same microbatch, in the same order on both stages. "
        "Received: stage 0 sends activations of microbatches [0, 1] to stage 1, which receives "
        "[1, 0]; they first differ at message 0.")
    grid = message.split("\n", 1)[1]
    assert grid.splitlines()[0].split() == ["step", "|", "rank", "0", "|", "rank", "1"]
    assert grid.splitlines()[1] == (
        "    0 | 0F0          | *1RECV_F1<0*  <-- ERROR HERE (rank 1: unmatched)")
    assert grid.splitlines()[2] == (
        "    1 | *0SEND_F0>1* | 1F0  <-- ERROR HERE (rank 0: unmatched)")


def test_a_backward_before_its_forward_is_reported_with_the_grid() -> None:
    message = _broken("0: 0F0 0B0\n1: 1B0 1F0")
    assert message == (
        "A stage runs a microbatch's forward before its backward. Received: 1B0 at step 0 before "
        "1F0 at step 1 on rank 1.\n"
        " step | rank 0 | rank 1\n"
        "    0 | 0F0    | *1B0*  <-- ERROR HERE (rank 1: backward before its forward)\n"
        "    1 | 0B0    | *1F0*  <-- ERROR HERE (rank 1: forward)")


def test_a_compute_order_cycle_is_a_deadlock_naming_who_waits_for_what() -> None:
    message = _broken("0: 0F0 0B0 0F1 0B1\n1: 1F0 1F1 1B0 1B1")
    assert message.startswith(
        "The schedule deadlocks (sends never block, receives wait for their send): rank 0 waits "
        "at step 1 in 0B0 for 1B0; rank 1 waits at step 1 in 1F1 for 0F1.")
    assert "*0B0*" in message and "*1F1*" in message and message.count("<-- ERROR HERE") == 1


def test_the_same_deadlock_lowered_waits_in_receives() -> None:
    lowered = lower(parse_schedule("0: 0F0 0B0 0F1 0B1\n1: 1F0 1F1 1B0 1B1"), None, 2)
    with pytest.raises(ScheduleError, match=re.escape(
            "rank 0 waits at step 2 in 0RECV_B0<1 for stage 1 (rank 1) to send it; rank 1 "
            "waits at step 2 in 1RECV_F1<0 for stage 0 (rank 0) to send it")):
        validate(lowered)


def test_a_missing_receive_is_an_unmatched_send() -> None:
    text = _lowered_text("interleaved", 2, 2).replace(" 1RECV_F1<0", "")
    with pytest.raises(ScheduleError, match=re.escape(
            "stage 0 sends activations of microbatches [0, 1] to stage 1, which receives [0]; "
            "they first differ at message 1")):
        validate(parse_schedule(text))


def test_a_send_before_the_compute_that_makes_it_is_rejected() -> None:
    text = _lowered_text("simple", 2, 1).replace("0F0 0SEND_F0>1", "0SEND_F0>1 0F0")
    with pytest.raises(ScheduleError, match=re.escape(
            "A stage sends what it computed only after computing it. Received: 0SEND_F0>1 at "
            "step 0, not after 0F0 at step 1, on rank 0.")):
        validate(parse_schedule(text))


def test_a_receive_after_the_compute_that_reads_it_is_rejected() -> None:
    text = _lowered_text("simple", 2, 1).replace("1RECV_F0<0 1F0", "1F0 1RECV_F0<0")
    with pytest.raises(ScheduleError, match="receives what it computes with before computing"):
        validate(parse_schedule(text))


@pytest.mark.parametrize(("text", "message"), [
    ("0: 0F0 0B0 0F0\n1: 1F0 1B0", r"runs each microbatch's forward once\. Received: 0F0 at rank 0, steps 0 and 2"),
    ("0: 0F0 0B0\n1: 1F0", r"Every stage runs a forward and a backward of every microbatch 0\.\.0 \(stages 0\.\.1\)\. Received: no 1B0"),
    ("0: 1F0 1B0\n1: 0F0 0B0", r"Stage s runs on rank s % 2\. Received: 1F0 on rank 0 \(step 0\); move it to rank 1"),
    ("0: 0F0 0REDUCE 0B0\n1: 1F0 1B0", r"reduces its gradients after its last backward\. Received: 0REDUCE at step 1"),
    ("0: 0F0 0STEP 0B0\n1: 1F0 1B0", r"one optimizer STEP, after all its compute and reductions\. Received: STEP at steps \[1\]"),
    ("0: 0F0 0B0 0REDUCE\n1: 1F0 1B0", r"same gradient buckets once each .* stage 1 has \[\], stage 0 has \['REDUCE'\]"),
    ("0: 0F0 0SEND_F0>2 0B0\n1: 1F0 1B0", r"Activations flow to later stages and gradients to earlier ones"),
    ("0: 0F0 0B0\n2: 2F0 2B0", r"maps ranks 0\.\.p-1 to their actions\. Received: ranks \[0, 2\]"),
])
def test_hand_broken_schedules_name_the_rule(text: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        validate(parse_schedule(text))


def test_lowered_schedules_are_checked_against_the_plans_links() -> None:
    lowered = lower(generate("interleaved", 4, 2), None, 4)
    skip = StageLinks(4, {0: [1, 3], 1: [2], 2: [3]})
    with pytest.raises(ScheduleError, match=r"stage 0 sends no activations of microbatch 0 to stage 3"):
        validate(lowered, links=skip)
    with pytest.raises(ScheduleError, match=r"messages between stages 1 and 2, which the plan does not link"):
        validate(lowered, links=StageLinks(4, {0: [1, 3], 2: [3]}))
    validate(lower(generate("interleaved", 4, 2), skip, 4), links=skip)


def test_compute_only_schedules_are_dry_run_along_the_links() -> None:
    # Fine on a chain; with a skip 0 -> 2, stage 2's forward needs 0F1, which rank 0 runs last.
    text = "0: 0F0 0B0 0F1 0B1\n1: 1F0 1B0 1F1 1B1\n2: 2F0 2F1 2B0 2B1"
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(parse_schedule(text))
    chain_ok = "0: 0F0 0F1 0B0 0B1\n1: 1F0 1F1 1B0 1B1\n2: 2F0 2F1 2B0 2B1"
    validate(parse_schedule(chain_ok), links=StageLinks(3, {0: [1, 2], 1: [2]}))


def test_buffer_limit_counts_activation_sets_held() -> None:
    validate(generate("interleaved", 4, 8), max_activations=4)
    with pytest.raises(ScheduleError, match=re.escape(
            "A rank holds at most max_activations=3 activation sets (forward run, backward not "
            "yet). Received: rank 0 holds 4 at step 3.")):
        validate(generate("interleaved", 4, 8), max_activations=3)


def test_large_grids_show_the_steps_around_the_failure() -> None:
    text = _lowered_text("interleaved", 4, 32).replace("3B20", "3BX").replace("3F20", "3B20")
    text = text.replace("3BX", "3F20")
    with pytest.raises(ScheduleError) as info:
        validate(parse_schedule(text))
    message = str(info.value)
    assert "3B20 at step" in message and "  ... |" in message
    assert len(message.splitlines()) < 60


def test_render_ascii_marks_cells_and_can_hide_communication() -> None:
    lowered = lower(generate("simple", 2, 1), None, 2)
    assert render_ascii(lowered, compute_only=True) == (
        " step | rank 0 | rank 1\n"
        "    0 | 0F0    | 1F0\n"
        "    1 | 0B0    | 1B0")
    marked = render_ascii(lowered, marks={(1, 1): "here"})
    assert "*1F0*" in marked and "<-- ERROR HERE (rank 1: here)" in marked
