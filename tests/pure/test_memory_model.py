"""The per-rank memory model, memory plans and the memory report (pure: hand-built graphs)."""

from __future__ import annotations

import itertools
import math

import graphs
import numpy as np
import pytest

from tfsmp.partitioning.contiguous import MemoryLimits, split_within_memory
from tfsmp.partitioning.memory import (
    ALLOCATOR_SLACK,
    BASELINE_BYTES,
    DIRECT_OP_BYTES,
    RUNTIME_BYTES,
    MemorySettings,
    cap_from_environment,
    late_weights_pay,
    predict_memory,
    recomputed_bytes,
    stage_counts,
)
from tfsmp.partitioning.memory_plan import what_fits
from tfsmp.partitioning.plan import StagePlan
from tfsmp.partitioning.planner import plan_graph
from tfsmp.partitioning.report import format_memory

MiB = 2**20


def _chain(n: int = 8, params: int = 1_000_000, width: int = 4096, saved: int | None = None
           ) -> object:
    g = graphs.chain(n, params=[params] * n, widths=[width] * n)
    for node in g:
        if not node.is_input and saved is not None:
            node.activation_bytes = saved
    return g


def _even(g: object, k: int) -> StagePlan:
    names = [n.name for n in g if not n.is_input]  # type: ignore[attr-defined]
    per = len(names) // k
    return StagePlan.from_assignment(g, {n: min(i // per, k - 1) for i, n in enumerate(names)}, k)


def test_state_is_weights_optimizer_slots_and_accumulators() -> None:
    g = _chain()
    plan = _even(g, 2)
    layer = 4 * 1_000_000
    ranks = predict_memory(plan, g, MemorySettings(partitions=2, microbatches=4, batch_size=8,
                                                   optimizer="adam", nonfinite="skip"))
    for r in ranks:
        assert (r.weights, r.optimizer, r.accumulators) == (4 * layer, 8 * layer, 4 * layer)
        assert r.baseline >= BASELINE_BYTES + RUNTIME_BYTES  # plus allocator slack
        assert r.total == sum(r.parts().values())
    sgd = predict_memory(plan, g, MemorySettings(partitions=2, microbatches=4, optimizer="sgd"))
    assert all(r.optimizer == 0 for r in sgd)


def test_one_microbatch_updates_directly_and_keeps_no_accumulators() -> None:
    g = _chain()  # Dense layers of 1M parameters, 16 KiB of input and output per sample
    plan = _even(g, 2)
    # a batch whose linear inputs and gradients outweigh the weights: a direct update
    for pipeline, direct in (("interleaved", True), ("simple", True), ("zb-h1", False)):
        ranks = predict_memory(plan, g, MemorySettings(partitions=2, microbatches=1,
                                                       batch_size=4096, pipeline=pipeline))
        assert all(r.direct is direct for r in ranks), pipeline
        assert all((r.accumulators == 0) is direct for r in ranks), pipeline
    # a small batch: late weights before the direct update ([Note: late before direct] in
    # tfsmp/runtime/stage.py), no accumulators either (every variable is linear here)
    late = predict_memory(plan, g, MemorySettings(partitions=2, microbatches=1, batch_size=8))
    assert all(not r.direct and r.accumulators == 0 for r in late)
    skip = predict_memory(plan, g, MemorySettings(partitions=2, nonfinite="skip"))
    assert all(r.accumulators > 0 for r in skip)  # a skipped step must change nothing


def test_several_microbatches_compute_linear_weight_gradients_at_the_steps_end() -> None:
    g = _chain()  # Dense layers of 1M parameters, 16 KiB of input and output per sample
    plan = _even(g, 2)
    layer = 4 * 1_000_000

    def ranks(**kw: object) -> list:
        s = MemorySettings(**{"partitions": 2, "microbatches": 4, "batch_size": 8,
                              "optimizer": "adam", **kw})  # type: ignore[arg-type]
        return predict_memory(plan, g, s)

    late = ranks()
    assert all(r.accumulators == 0 and r.optimizer == 8 * layer for r in late)
    # the step holds every microbatch's linear inputs and output gradients instead
    assert all(r.activations >= 8 * 4 * 2 * 4096 * 4 for r in late)
    # across replicas too ([Note: late weights across replicas]), at one microbatch as well
    assert all(r.accumulators == 0 for r in ranks(data_parallel=2))
    assert all(r.accumulators == 0 for r in ranks(data_parallel=2, microbatches=1))
    # a batch whose linear inputs and gradients (every replica's) outweigh the weights keeps
    # accumulators
    assert all(r.accumulators == 4 * layer for r in ranks(batch_size=4096, microbatches=8))
    assert all(r.accumulators == 4 * layer for r in ranks(batch_size=32, data_parallel=16))
    kept = ranks(direct=False)
    assert all(r.accumulators == 4 * layer for r in kept)
    assert max(r.total for r in late) < min(r.total for r in kept)


def test_late_weights_pay_only_where_linear_variables_are_most_of_the_stage() -> None:
    # held rows below the avoided accumulators, and the linear variables at least half the
    # stage's trainable bytes (late weights' programs cost by operations: a convolution stage
    # with one Dense head gained 0.8 MiB and paid 93-137 MiB)
    assert late_weights_pay(1, 60, 100)
    assert late_weights_pay(1, 50, 100)
    assert not late_weights_pay(1, 49, 100)
    assert not late_weights_pay(60, 60, 100)  # the rows weigh as much as the accumulators
    assert not late_weights_pay(0, 60, 100)  # nothing linear was seen


def test_schedules_hold_what_they_should() -> None:
    # p = 4, m = 8: GPipe holds every microbatch, 1F1B p - r on rank r, zb-h1 at least as many
    p, m = 4, 8
    gpipe = stage_counts(MemorySettings(partitions=p, microbatches=m, pipeline="simple"), p)
    one_f = stage_counts(MemorySettings(partitions=p, microbatches=m), p)
    zb = stage_counts(MemorySettings(partitions=p, microbatches=m, pipeline="zb-h1"), p)
    assert gpipe == [m, m, m, 0]  # the fused last stage stashes nothing
    assert one_f == [4, 3, 2, 0]
    assert all(z >= o for z, o in zip(zb, one_f)) and zb[-1] >= 1  # W waits on every stage


def test_activations_grow_with_held_microbatches_in_speed_mode() -> None:
    g = _chain(saved=4 * MiB)
    plan = _even(g, 4)

    def acts(pipeline: str, optimize: str) -> list[int]:
        s = MemorySettings(partitions=4, microbatches=8, pipeline=pipeline, batch_size=64,
                           optimize=optimize)
        return [r.activations for r in predict_memory(plan, g, s)]

    speed_gpipe, speed_1f1b = acts("simple", "speed"), acts("interleaved", "speed")
    assert speed_gpipe[0] > speed_1f1b[0] > speed_1f1b[2]  # m vs p - r microbatches
    assert acts("simple", "memory")[0] < speed_gpipe[0]  # memory mode stashes only inputs
    # one microbatch's recomputed activations: 8 samples x 2 layers x 4 MiB
    assert acts("interleaved", "memory")[0] >= 8 * 2 * 4 * MiB


def test_a_recomputing_backward_holds_what_a_compiled_call_was_measured_to_hold() -> None:
    # [Note: recomputed bytes] in tfsmp/graph/costs.py: memory mode's backward (and the fused
    # last stage) price `recompute_bytes`; speed mode's stash keeps the taped figure
    g = _chain(saved=4 * MiB)
    plan = _even(g, 4)

    def acts(optimize: str) -> list[int]:
        s = MemorySettings(partitions=4, microbatches=8, pipeline="interleaved", batch_size=64,
                           optimize=optimize)
        return [r.activations for r in predict_memory(plan, g, s)]

    memory, speed = acts("memory"), acts("speed")
    for node in g:
        if not node.is_input:
            node.recompute_bytes = 3 * MiB
    lower = acts("memory")
    # 8 samples x 2 layers x (4 - 3) MiB less on each rank's recomputing backward
    assert [a - b for a, b in zip(memory, lower)][:3] == [8 * 2 * MiB] * 3
    # speed mode's backward replays its products in one compiled call too ([Note: stashing] in
    # tfsmp/runtime/stage.py), so it is priced by the same figure; the stash is unchanged
    assert [a - b for a, b in zip(speed, acts("speed"))][:3] == [8 * 2 * MiB] * 3
    assert acts("speed")[3] < speed[3]  # the fused last stage is one compiled call


def test_a_replaying_stage_stashes_its_products_and_the_taped_fallback_what_the_tape_keeps(
) -> None:
    # [Note: replayed products] in tfsmp/runtime/deferred.py: a speed-mode forward keeps its
    # linear layers' outputs for the backward; a stage with a convolution keeps what the tape
    # keeps (measured: activation_bytes), and takes all its weight gradients at once
    g = _chain(saved=4 * MiB)
    plan = _even(g, 4)
    s = MemorySettings(partitions=4, microbatches=8, pipeline="interleaved", batch_size=64,
                       optimize="speed")

    def first_rank() -> int:
        return predict_memory(plan, g, s)[0].activations

    taped_stash = first_rank()  # products not measured: the tape's figure stands for them
    for node in g:
        if not node.is_input:
            node.product_bytes = 1 * MiB
    # 8 samples x 2 layers x (4 - 1) MiB, for each of the 4 microbatches 1F1B holds there
    assert taped_stash - first_rank() == 4 * 8 * 2 * 3 * MiB
    replayed, second = first_rank(), predict_memory(plan, g, s)[1].activations
    for node in g:
        if node.name == "l0":
            node.kind = "Conv2D"
    assert first_rank() > replayed  # the taped fallback's stash again
    assert predict_memory(plan, g, s)[1].activations == second  # the next stage still replays
    taped = first_rank()
    for node in g:  # [Note: kept bytes]: what the tape keeps, each tensor once
        if not node.is_input:
            node.kept_bytes = 2 * MiB
    # 8 samples x 2 layers x (4 - 2) MiB, for each of the 4 microbatches 1F1B holds there
    assert taped - first_rank() == 4 * 8 * 2 * 2 * MiB


def test_receive_buffers_hold_the_whole_batch_both_ways() -> None:
    g = _chain(width=1024)
    plan = _even(g, 2)
    ranks = predict_memory(plan, g, MemorySettings(partitions=2, microbatches=4, batch_size=32))
    assert ranks[0].buffers == ranks[1].buffers == 32 * 1024 * 4


def test_tied_copies_add_their_state_and_reduction() -> None:
    g = graphs.tied_embedding()
    names = [n.name for n in g if not n.is_input]
    plan = StagePlan.from_assignment(g, {n: (0 if i < len(names) // 2 else 1)
                                         for i, n in enumerate(names)}, 2)
    assert any(t.copies > 1 for t in plan.ties)
    ranks = predict_memory(plan, g, MemorySettings(partitions=2, microbatches=1))
    assert not any(r.direct for r in ranks)  # tied gradients are summed before the step
    copy = next(t for t in plan.ties if t.copies > 1)
    assert ranks[1].weights >= copy.param_bytes


def test_cap_comes_from_the_environment() -> None:
    assert cap_from_environment({"TFSMP_MEMORY_PER_RANK": "2684354560"}) == 2684354560
    assert cap_from_environment({}) is None
    assert cap_from_environment({"TFSMP_MEMORY_PER_RANK": "x"}) is None


# -- memory plans -----------------------------------------------------------------------------

def _heavy_first(n: int = 8) -> object:
    """A chain whose first layer has 6x the weights of the others (an embedding)."""
    g = graphs.chain(n, params=[30_000_000] + [5_000_000] * (n - 1))
    return g


def test_without_a_cap_the_memory_plan_is_the_compute_plan() -> None:
    g = _heavy_first()
    speed = plan_graph(g, 4, optimize="speed")
    memory = plan_graph(g, 4, optimize="memory")
    assert dict(memory.stage_of) == dict(speed.stage_of)
    assert any("predicted peak per rank" in n for n in memory.notes)


def test_with_a_cap_the_plan_fits_and_is_the_best_compute_split_that_does() -> None:
    g = _heavy_first()
    s = MemorySettings(partitions=4, batch_size=8)
    speed = plan_graph(g, 4, optimize="speed")
    worst = max(r.total for r in predict_memory(speed, g, s))
    cap = worst * 0.97  # the compute plan does not fit; the first layer alone on a stage does
    plan = plan_graph(g, 4, optimize="memory", memory=s, memory_cap=cap)
    assert max(r.total for r in predict_memory(plan, g, s)) <= cap
    names = [n.name for n in g if not n.is_input]
    best = math.inf
    for cuts in itertools.combinations(range(1, len(names)), 3):
        bounds = [0, *cuts, len(names)]
        stage_of = {n: next(k for k in range(4) if bounds[k] <= i < bounds[k + 1])
                    for i, n in enumerate(names)}
        candidate = StagePlan.from_assignment(g, stage_of, 4)
        if max(r.total for r in predict_memory(candidate, g, s)) <= cap:
            best = min(best, max(st.compute for st in candidate.stages))
    assert max(st.compute for st in plan.stages) == pytest.approx(best)
    assert max(st.compute for st in plan.stages) > max(st.compute for st in speed.stages)


def test_a_cap_nothing_fits_gives_the_leanest_plan_and_says_so() -> None:
    g = _heavy_first()
    s = MemorySettings(partitions=4, batch_size=8)
    plan = plan_graph(g, 4, optimize="memory", memory=s, memory_cap=100 * MiB)
    assert any("nothing fits" in n for n in plan.notes)


def test_what_fits_names_more_partitions_and_more_microbatches() -> None:
    g = _chain(n=16, params=4_000_000, saved=2 * MiB)
    s = MemorySettings(partitions=2, microbatches=1, batch_size=64, optimize="speed")
    worst = max(r.total for r in predict_memory(plan_graph(g, 2), g, s))
    hints = what_fits(g, s, worst * 0.8)
    assert any(h.startswith("partitions=") for h in hints)


def test_split_within_memory_equals_brute_force() -> None:
    rng = np.random.default_rng(0)
    for _ in range(40):
        n, k = int(rng.integers(3, 8)), int(rng.integers(1, 4))
        k = min(k, n)
        w = rng.random(n)
        fixed = np.concatenate([[0.0], np.cumsum(rng.random(n))])
        held = np.concatenate([[0.0], np.cumsum(rng.random(n) * 0.2)])
        counts = tuple(float(c) for c in rng.integers(0, 4, k))
        limit = tuple(float(x) for x in rng.random(k) * 3 + 0.5)
        limits = MemoryLimits(fixed, held, counts, limit)
        got = split_within_memory(list(w), [0.0] * (n + 1), k, limits)
        best = math.inf
        for cuts in itertools.combinations(range(1, n), k - 1):
            b = [0, *cuts, n]
            if all(limits.allowed(t, b[t], b[t + 1]) for t in range(k)):
                best = min(best, max(sum(w[b[t]:b[t + 1]]) for t in range(k)))
        if got is None:
            assert best == math.inf
            continue
        b = [*got, n]
        assert all(limits.allowed(t, b[t], b[t + 1]) for t in range(k))
        assert max(sum(w[b[t]:b[t + 1]]) for t in range(k)) == pytest.approx(best)


# -- the report -------------------------------------------------------------------------------

def test_memory_report_says_whether_it_fits_and_what_would() -> None:
    g = _chain()
    ranks = predict_memory(_even(g, 2), g, MemorySettings(partitions=2, batch_size=8))
    text = format_memory(ranks, cap=10 * 2**30)
    assert text.splitlines()[1].split() == ["rank", "stages", "weights", "optimizer",
                                            "accumulators", "activations", "buffers",
                                            "baseline", "peak"]
    assert "fits: every rank within 10.0 GiB per rank" in text
    text = format_memory(ranks, cap=100 * MiB, suggestions=["partitions=4 (largest rank 0.1 GiB)"])
    assert "does not fit 100.0 MiB per rank: rank 0" in text
    assert "would fit: partitions=4 (largest rank 0.1 GiB)" in text
    assert "nothing tried fits" in format_memory(ranks, cap=100 * MiB)


def test_a_stage_recomputes_the_smaller_of_its_layers_figures_and_what_gradients_keep() -> None:
    # [Note: kept bytes] in tfsmp/graph/costs.py: summed per layer, each layer's compiled growth
    # counts its own backward temporaries; what gradients keep plus one layer's temporaries at
    # a time is the other bound
    g = _chain(n=4, saved=4 * MiB)
    nodes = [n for n in g if not n.is_input]
    assert recomputed_bytes(nodes) == 4 * 4 * MiB  # nothing compiled measured: taped
    for n in nodes:
        n.recompute_bytes = 6 * MiB  # 2 MiB of temporaries beyond the taped 4
    assert recomputed_bytes(nodes) == 4 * 4 * MiB  # no kept bytes measured: min(6, 4) each
    for n in nodes:
        n.kept_bytes = 2 * MiB  # half the taped figure is an output no gradient keeps
    assert recomputed_bytes(nodes) == 4 * 2 * MiB + 4 * MiB  # kept + one layer's 6 - 2
    for n in nodes:  # a compiled call that prunes what the taped one keeps (GPT-2's blocks)
        n.recompute_bytes, n.kept_bytes = 3 * MiB, 7 * MiB // 2
    assert recomputed_bytes(nodes) == 4 * 3 * MiB


def test_a_direct_update_program_costs_more_host_memory_per_operation() -> None:
    g = _chain(n=2)
    for n in g:  # convolutions: no late weights, so one microbatch updates directly
        if not n.is_input:
            n.ops, n.kind = 1000, "Conv2D"
    plan = _even(g, 1)
    settings = dict(partitions=1, microbatches=1, batch_size=8, optimizer="adam")
    (direct,) = predict_memory(plan, g, MemorySettings(**settings, direct=True))
    (kept,) = predict_memory(plan, g, MemorySettings(**settings, direct=False))
    assert direct.direct and not kept.direct
    slack = ALLOCATOR_SLACK * (kept.total - kept.baseline - kept.buffers
                               - (direct.total - direct.baseline - direct.buffers))
    assert direct.baseline - kept.baseline == pytest.approx(
        DIRECT_OP_BYTES * 2000 - slack, abs=2)


def test_the_drain_split_is_priced_and_dropped_where_only_its_absence_fits() -> None:
    """[Note: drain split] in tfsmp/runtime/executor.py: the last stage holds the linear
    inputs and output gradients of its drain's microbatches until their W's; a cap that fits
    the run only without them keeps the plan and turns the split off (`StagePlan.drain_split`,
    read by the runtime's `RunPlan`)."""
    from tfsmp.partitioning.memory_check import check_memory
    from tfsmp.schedule.run_plan import DRAIN, drain_count

    assert (drain_count("speed"), drain_count("memory")) == (DRAIN, 0)
    g = _chain()
    names = [n.name for n in g if not n.is_input]  # type: ignore[attr-defined]
    plan = StagePlan.from_assignment(g, {n: int(i >= 2) for i, n in enumerate(names)}, 2)
    base = MemorySettings(partitions=2, microbatches=8, batch_size=64, optimize="speed",
                          optimizer="adam", direct=False, drain=0)
    drained = MemorySettings(**{**base.__dict__, "drain": DRAIN})
    plain, split = predict_memory(plan, g, base), predict_memory(plan, g, drained)
    assert split[0].total == plain[0].total  # stage 0 sends no gradients: nothing to drain
    # while the last microbatch's fused call runs, the one before waits for its W: 8 samples
    # of 6 layers' inputs and outputs (4096 floats each)
    assert split[1].activations - plain[1].activations >= 8 * 6 * 2 * 4096 * 4
    assert max(r.total for r in split) > max(r.total for r in plain)
    cap = (max(r.total for r in plain) + max(r.total for r in split)) / 2
    decision = check_memory(g, drained, cap, lambda s: plan)
    assert decision.fits and decision.settings.drain == 0 and not decision.plan.drain_split
    assert "no drain split" in decision.message()
    roomy = check_memory(g, drained, split[1].total * 2, lambda s: plan)
    assert roomy.fits and roomy.settings.drain == DRAIN and roomy.plan.drain_split
    assert StagePlan.from_json(decision.plan.to_json()).drain_split is False


def test_settings_without_a_drain_price_the_runtime_s_and_a_plan_without_the_split_none() -> None:
    """`MemorySettings` built without ``drain`` price what the runtime runs for ``optimize``
    (speed mode drains, memory mode does not), and a plan whose ``drain_split`` is off, as the
    runtime reads it, prices no drain whatever the settings say."""
    from dataclasses import replace

    from tfsmp.schedule.run_plan import DRAIN

    g = _chain()
    names = [n.name for n in g if not n.is_input]  # type: ignore[attr-defined]
    plan = StagePlan.from_assignment(g, {n: int(i >= 2) for i, n in enumerate(names)}, 2)
    speed = MemorySettings(partitions=2, microbatches=8, batch_size=64, optimize="speed",
                           optimizer="adam", direct=False)
    assert speed.drains() == DRAIN and replace(speed, optimize="memory").drains() == 0
    assert replace(speed, drain=0).drains() == 0
    default = predict_memory(plan, g, speed)
    assert [r.total for r in default] == [
        r.total for r in predict_memory(plan, g, replace(speed, drain=DRAIN))]
    plain = predict_memory(plan, g, replace(speed, drain=0))
    assert default[1].activations > plain[1].activations
    unsplit = predict_memory(replace(plan, drain_split=False), g, speed)
    assert [r.total for r in unsplit] == [r.total for r in plain]
