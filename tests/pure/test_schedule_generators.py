"""Generators: SMP's simple (GPipe) and interleaved (1F1B, Megatron chunks), active_microbatches.

The sweep at the end validates every generated schedule, compute-only and lowered, for
p <= 8, m <= 32, v <= 4 (2048 schedules; about 20 s on 2 busy cores) in the full run, and for
p <= 8, m <= 16, v <= 2 (512 schedules) in the default run.
"""

from __future__ import annotations

import re

import pytest

from tests.mpihelp import FULL
from tfsmp.errors import ScheduleError
from tfsmp.schedule import (
    format_schedule,
    fuse_last_stage,
    generate,
    lower,
    peak_activations,
    peak_in_flight,
    simulate,
    validate,
)
from tfsmp.schedule.registry import names

# every registered pipeline, as a message lists them (tfsmp/schedule/registry.py)
_PIPELINES = re.escape(str(list(names())))


def test_simple_runs_every_forward_before_any_backward() -> None:
    assert format_schedule(generate("simple", 2, 3)) == (
        "0: 0F0 0F1 0F2 0B0 0B1 0B2\n"
        "1: 1F0 1F1 1F2 1B0 1B1 1B2")


def test_interleaved_warms_up_p_minus_r_minus_1_forwards_then_alternates() -> None:
    assert format_schedule(generate("interleaved", 3, 4)) == (
        "0: 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3\n"
        "1: 1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3\n"
        "2: 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3")


def test_interleaved_with_virtual_stages_follows_megatrons_order() -> None:
    # p=2, v=2: rank r holds stages r and r+2; warm-up 2(p-r-1) + (v-1)p forwards.
    assert format_schedule(generate("interleaved", 2, 4, virtual_stages=2)) == (
        "0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3\n"
        "1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3")


@pytest.mark.parametrize("pipeline", ["simple", "interleaved"])
def test_one_microbatch_and_one_rank_degenerate_to_forward_then_backward(pipeline: str) -> None:
    assert format_schedule(generate(pipeline, 3, 1)) == "0: 0F0 0B0\n1: 1F0 1B0\n2: 2F0 2B0"
    assert format_schedule(generate(pipeline, 1, 1, virtual_stages=2)) == "0: 0F0 1F0 1B0 0B0"


def test_peak_activations_are_m_for_simple_and_p_minus_r_for_interleaved() -> None:
    for p in range(1, 7):
        for m in range(1, 13):
            assert peak_activations(generate("simple", p, m)) == [m] * p
            assert peak_activations(generate("interleaved", p, m)) == [
                min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("pipeline", ["simple", "interleaved"])
@pytest.mark.parametrize(("p", "m", "v"), [(4, 8, 1), (4, 8, 2), (3, 7, 3), (8, 5, 2), (2, 9, 4)])
def test_active_microbatches_caps_microbatches_in_flight(pipeline: str, p: int, m: int,
                                                         v: int) -> None:
    for cap in range(1, m + 1):
        schedule = generate(pipeline, p, m, v, active_microbatches=cap)
        assert max(peak_in_flight(schedule)) <= cap
        validate(schedule)
        validate(lower(schedule, None, p))


def test_active_microbatches_turns_simple_into_waves() -> None:
    assert format_schedule(generate("simple", 2, 4, active_microbatches=2)) == (
        "0: 0F0 0F1 0B0 0B1 0F2 0F3 0B2 0B3\n"
        "1: 1F0 1F1 1B0 1B1 1F2 1F3 1B2 1B3")


def test_active_microbatches_shortens_interleaved_warm_up() -> None:
    schedule = generate("interleaved", 4, 6, active_microbatches=2)
    assert peak_activations(schedule) == [2, 2, 2, 1]
    assert format_schedule({0: schedule[0]}) == "0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0F4 0B3 0F5 0B4 0B5"


def test_m_not_a_multiple_of_p_with_virtual_stages_stays_valid() -> None:
    # A short last group ordered as is would deadlock here; ghost padding keeps it valid.
    schedule = generate("interleaved", 4, 5, virtual_stages=3)
    validate(schedule)
    assert sorted((a.stage, a.microbatch or 0) for a in schedule[0] if a.op.value == "F") == [
        (s, i) for s in (0, 4, 8) for i in range(5)]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"pipeline": "gpipe"}, rf"pipeline must be one of {_PIPELINES}\. Received: pipeline='gpipe'"),
    ({"num_ranks": 0}, r"num_ranks must be a positive integer\. Received: num_ranks=0"),
    ({"num_microbatches": -1}, "num_microbatches must be a positive integer"),
    ({"virtual_stages": 0}, "virtual_stages must be a positive integer"),
    ({"active_microbatches": 0}, r"active_microbatches must be a positive integer or None\. Received"),
])
def test_bad_arguments_are_schedule_errors(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"pipeline": "interleaved", "num_ranks": 2, "num_microbatches": 2}
    args.update(kwargs)
    with pytest.raises(ScheduleError, match=message):
        generate(**args)  # type: ignore[arg-type]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pipeline", ["simple", "interleaved"])
def test_validator_passes_every_generated_schedule_up_to_p8_m32_v4(pipeline: str) -> None:
    # The default run takes every p <= 8 with m <= 16 and v <= 2 (a quarter of the time); the
    # full run (CI, TFSMP_FULL_TESTS=1) goes to m = 32 and v = 4.
    for p in range(1, 9):
        for v in range(1, 5 if FULL else 3):
            for m in range(1, 33 if FULL else 17):
                compute = generate(pipeline, p, m, v)
                validate(compute)
                validate(lower(compute, None, p))


def test_fuse_last_stage_moves_each_last_stage_backward_to_its_forward() -> None:
    # [Note: fused last stage]: what the runtime executes.
    assert format_schedule(fuse_last_stage(generate("simple", 3, 3))) == (
        "0: 0F0 0F1 0F2 0B0 0B1 0B2\n"
        "1: 1F0 1F1 1F2 1B0 1B1 1B2\n"
        "2: 2F0 2B0 2F1 2B1 2F2 2B2")
    assert format_schedule(fuse_last_stage(generate("simple", 2, 2, virtual_stages=2))) == (
        "0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1\n"
        "1: 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1")
    for p, m in ((1, 1), (2, 5), (4, 8), (3, 2)):
        plain = generate("interleaved", p, m)
        assert fuse_last_stage(plain) == plain  # 1F1B already runs them so
        assert fuse_last_stage(generate("simple", p, m))[p - 1] == plain[p - 1]


@pytest.mark.parametrize("pipeline", ["simple", "interleaved"])
def test_fused_schedules_keep_every_action_and_stay_valid(pipeline: str) -> None:
    for p in (1, 2, 3, 4, 8):
        for v in (1, 2, 3):
            for m in (1, 2, 5, 8):
                for cap in (None, 2):
                    compute = generate(pipeline, p, m, v, active_microbatches=cap)
                    fused = fuse_last_stage(compute)
                    assert {r: sorted(map(str, a)) for r, a in fused.items()} == \
                        {r: sorted(map(str, a)) for r, a in compute.items()}
                    validate(fused)
                    validate(lower(fused, None, p))


def test_with_a_fused_last_stage_simple_reaches_the_gpipe_formula() -> None:
    # Stage times as the runtime has them: the last stage's forward holds its backward.
    p, m = 2, 8
    times = {"forward_time": [1.0, 3.0], "backward_time": [2.0, 0.0]}
    textbook = simulate(generate("simple", p, m), **times)
    fused = simulate(fuse_last_stage(generate("simple", p, m)), **times)
    assert fused.makespan < textbook.makespan
    assert fused.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert textbook.bubble_fraction > 0.3
