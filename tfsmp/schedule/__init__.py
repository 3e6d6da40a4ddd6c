"""Pipeline schedules as data: actions, generators, lowering, validation, simulation, pictures.

Example::

    from tfsmp.schedule import generate, lower, simulate, validate
    compute = generate("interleaved", num_ranks=4, num_microbatches=8)
    lowered = lower(compute, plan, num_ranks=4)        # plan: StagePlan, StageLinks or None
    validate(lowered)
    simulate(compute).bubble_fraction                  # 3/11

    where = Placement.for_pipeline("zb-v", 4, virtual_stages=2)   # stage -> rank, one owner
    zb = generate("zb-v", 4, 8, virtual_stages=2)                 # F, B and W actions
    simulate(zb, forward_time=0.5, backward_time=1.0, weight_time=0.5, placement=where)

Pure: imports neither TensorFlow nor mpi4py (matplotlib only inside `render_timeline`).
See docs/schedules.md.
"""

from tfsmp.schedule.actions import (
    Action,
    Op,
    Schedule,
    format_schedule,
    message_tag,
    parse_schedule,
    rank_of_stage,
    stages_of_rank,
    tag_upper_bound,
    weight_stages,
)
from tfsmp.schedule.generators import PIPELINES, fuse_last_stage, generate
from tfsmp.schedule.links import Links, StageLinks
from tfsmp.schedule.lowering import lower
from tfsmp.schedule.placement import Placement
from tfsmp.schedule.render import render_ascii, render_staircase, render_timeline
from tfsmp.schedule.simulate import SimResult, TimelineEntry, simulate
from tfsmp.schedule.validate import peak_activations, peak_in_flight, validate

__all__ = [
    "PIPELINES",
    "Action",
    "Links",
    "Op",
    "Placement",
    "Schedule",
    "SimResult",
    "StageLinks",
    "TimelineEntry",
    "format_schedule",
    "fuse_last_stage",
    "generate",
    "lower",
    "message_tag",
    "parse_schedule",
    "peak_activations",
    "peak_in_flight",
    "rank_of_stage",
    "render_ascii",
    "render_staircase",
    "render_timeline",
    "simulate",
    "stages_of_rank",
    "tag_upper_bound",
    "validate",
    "weight_stages",
]
