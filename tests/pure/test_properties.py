"""Property tests: every generated schedule, lowered over any stage graph, validates and simulates.

Hypothesis draws the pipeline, ranks p, microbatches m, virtual stages v, the in-flight cap, a
random forward stage graph (skip links of any length, stages with no producer), data
parallelism and reduce buckets; then checks what the runtime relies on: the compute is complete
and ordered, the lowered schedule validates (pairing, ordering, deadlock dry run), its text form
round-trips, and the simulator finishes with a timeline that respects every dependency.
Config parsing properties live in tests/pure/test_config.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tfsmp.schedule import (
    PIPELINES,
    Action,
    Op,
    Placement,
    Schedule,
    StageLinks,
    format_schedule,
    generate,
    lower,
    parse_schedule,
    peak_in_flight,
    simulate,
    validate,
)
from tfsmp.schedule.actions import message_key

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Case:
    pipeline: str
    p: int
    m: int
    v: int
    cap: int | None
    links: StageLinks
    data_parallel: bool
    buckets: int

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    @property
    def placement(self) -> Placement:
        return Placement.for_pipeline(self.pipeline, self.p, self.v)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    pipeline = draw(st.sampled_from(PIPELINES))
    p = draw(st.integers(1, 6))
    v = {"zb-h1": 1, "zb-v": 2}.get(pipeline) or draw(st.integers(1, 3))
    m = draw(st.integers(1, 12))
    cap = draw(st.none() | st.integers(1, m))
    n = p * v
    forward = {s: sorted(set(draw(st.lists(st.integers(s + 1, n - 1), max_size=3))))
               for s in range(n - 1)}
    if draw(st.booleans()):  # most plans: every stage feeds the next, plus skips
        forward = {s: sorted({s + 1, *cs}) for s, cs in forward.items()}
    return Case(pipeline, p, m, v, cap, StageLinks(n, forward), draw(st.booleans()),
                draw(st.integers(1, 3)))


def _lowered(case: Case) -> tuple[Schedule, Schedule]:
    compute = generate(case.pipeline, case.p, case.m, case.v, active_microbatches=case.cap)
    return compute, lower(compute, case.links, case.p, data_parallel=case.data_parallel,
                          reduce_buckets=case.buckets, placement=case.placement)


@SETTINGS
@given(cases())
def test_generated_compute_is_complete_ordered_and_capped(case: Case) -> None:
    compute, _ = _lowered(case)
    assert sorted(compute) == list(range(case.p))
    for rank, actions in compute.items():
        stages = case.placement.stages(rank)
        expected = {(s, i) for s in stages for i in range(case.m)}
        forwards = [(a.stage, a.microbatch) for a in actions if a.op is Op.FORWARD]
        backwards = [(a.stage, a.microbatch) for a in actions if a.op is Op.BACKWARD]
        assert sorted(forwards) == sorted(expected) == sorted(backwards)  # each exactly once
        seen = set()
        for a in actions:  # a backward after its own forward
            if a.op is Op.FORWARD:
                seen.add((a.stage, a.microbatch))
            else:
                assert (a.stage, a.microbatch) in seen, (rank, str(a))
    if case.cap is not None:
        assert max(peak_in_flight(compute)) <= case.cap


@SETTINGS
@given(cases())
def test_lowered_schedule_validates_over_any_stage_graph_and_round_trips(case: Case) -> None:
    compute, lowered = _lowered(case)
    validate(compute, links=case.links, placement=case.placement)
    validate(lowered, links=case.links, placement=case.placement)
    assert parse_schedule(format_schedule(lowered)) == lowered
    for rank, actions in lowered.items():
        assert actions[-1] == Action(rank, Op.STEP)
        assert [a for a in actions if a.is_compute] == compute[rank]  # lowering adds, never moves
        reduces = [a for a in actions if a.op is Op.REDUCE]
        stages = {a.stage for a in compute[rank]}
        assert len(reduces) == (len(stages) * case.buckets if case.data_parallel else 0)


@SETTINGS
@given(cases(), st.data())
def test_simulator_finishes_and_respects_every_dependency(case: Case, data: st.DataObject) -> None:
    _, lowered = _lowered(case)
    n = case.num_stages
    times = st.lists(st.floats(0.1, 5.0), min_size=n, max_size=n)
    fwd, bwd, red = data.draw(times), data.draw(times), data.draw(times)
    comm = data.draw(st.floats(0.0, 2.0))
    result = simulate(lowered, forward_time=fwd, backward_time=bwd, comm_time=comm,
                      reduce_time=red, step_time=0.5, links=case.links, num_ranks=case.p,
                      placement=case.placement)
    entries = {(e.rank, str(e.action)): e for e in result.timeline}
    assert len(result.timeline) == sum(len(a) for a in lowered.values()) == len(entries)
    assert 0.0 <= result.bubble_fraction < 1.0
    assert result.makespan >= max(result.busy) - 1e-9
    sends = {message_key(e.action): e for e in result.timeline
             if e.action.op in (Op.SEND_F, Op.SEND_B)}
    for e in result.timeline:
        a = e.action
        if a.op in (Op.RECV_F, Op.RECV_B):  # a receive ends when its message has arrived
            send = sends[message_key(a)]
            cross = case.placement.rank(send.action.stage) != e.rank
            assert e.end >= send.start + (comm if cross else 0.0) - 1e-9, str(a)
        if a.op is Op.FORWARD:  # after the forwards of every producer of this microbatch
            for q in case.links.peers_backward(a.stage):
                producer = entries[(case.placement.rank(q), f"{q}F{a.microbatch}")]
                assert e.start >= producer.end - 1e-9, (str(a), q)
        if a.op is Op.BACKWARD:  # after the backwards of every consumer
            for c in case.links.peers_forward(a.stage):
                consumer = entries[(case.placement.rank(c), f"{c}B{a.microbatch}")]
                assert e.start >= consumer.end - 1e-9, (str(a), c)
    serial = sum(fwd) * case.m + sum(bwd) * case.m + sum(red) + 0.5 * case.p
    assert result.makespan <= serial + comm * len(sends) + 1e-6  # never idles without a cause
