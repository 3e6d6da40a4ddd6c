"""The pipeline registry (tfsmp/schedule/registry.py) and the run description (run_plan.py):
every layer that names schedules reads the records, and the runtime and the memory model read
one `RunPlan`."""

from __future__ import annotations

import pytest

from tfsmp.config import validate
from tfsmp.errors import ScheduleError
from tfsmp.partitioning.memory import MemorySettings, run_of
from tfsmp.schedule import Placement, generate
from tfsmp.schedule.registry import Pipeline, get, names, pipelines, register
from tfsmp.schedule.run_plan import RunPlan


def test_every_module_of_the_package_is_registered_in_listing_order() -> None:
    assert names()[:4] == ("simple", "interleaved", "zb-h1", "zb-v")
    assert "looped-bfs" in names()
    assert [p.name for p in pipelines()] == list(names())


def test_the_config_and_the_placement_read_the_records() -> None:
    for record in pipelines():
        cfg = validate({"pipeline": record.name, "partitions": 2})
        assert cfg.chunks == record.chunks_for(1)
        placement = Placement.for_pipeline(record.name, 2, cfg.chunks)
        assert placement.kind == record.placement
        schedule = generate(record.name, 2, 4, cfg.chunks)
        assert any(a.op.value == "W" for acts in schedule.values() for a in acts) == \
            record.splits_backward


def test_a_second_record_of_one_name_is_refused() -> None:
    twin = Pipeline("simple", "another", generate=get("simple").generate,
                    bubble=get("simple").bubble)
    with pytest.raises(ScheduleError, match=r"a second pipeline named 'simple'"):
        register(twin)


def test_the_run_plan_decides_direct_updates_once() -> None:
    assert RunPlan.of("interleaved", 2, 1).direct_possible(0)
    assert not RunPlan.of("interleaved", 2, 2).direct_possible(0)        # accumulate m > 1
    assert not RunPlan.of("zb-h1", 2, 1).direct_possible(0)              # split stages
    assert not RunPlan.of("interleaved", 2, 1, data_parallel=2).direct_possible(0)
    assert not RunPlan.of("interleaved", 2, 1, tied=True).direct_possible(0)
    assert not RunPlan.of("interleaved", 2, 1, nonfinite="skip").direct_possible(0)
    run = RunPlan.of("interleaved", 2, 1)
    assert run.keeps_accumulators(0, optimizer_allows_direct=False)     # global_clipnorm, EMA ...
    assert not run.keeps_accumulators(0, optimizer_allows_direct=True)


def test_the_memory_model_reads_the_run_the_runtime_runs() -> None:
    settings = MemorySettings(partitions=4, microbatches=8, pipeline="zb-v", virtual_stages=2)
    run = run_of(settings)
    assert run.compute == RunPlan.of("zb-v", 4, 8, virtual_stages=2).compute
    assert run.split_stages == frozenset(range(8))
    assert run.placement.kind == "v"
