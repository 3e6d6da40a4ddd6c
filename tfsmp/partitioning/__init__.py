"""tfsmp.partitioning: split a layer graph into ordered pipeline stages (pure).

Example::

    from tfsmp.partitioning import plan_graph
    plan = plan_graph(graph, 4, optimize="speed")   # a StagePlan

`plan_graph` (planner.py) runs METIS (metis.py), the contiguous DP (contiguous.py) or the manual
plan (manual.py); `report.py` prints and draws plans; `api.py` is `tfsmp.plan(model, ...)`.
"""

from tfsmp.partitioning.plan import Boundary, StageCost, StagePlan
from tfsmp.partitioning.planner import plan_graph, vertex_weights

__all__ = ["Boundary", "StageCost", "StagePlan", "plan_graph", "vertex_weights"]
