"""Train a model with plain Keras and with tfsmp for a few steps and compare (case-script helper).

Plain Keras trains on world rank 0 only and broadcasts its losses and weights: every rank builds
the same seeded model on the same batches with one intra-op thread, so the reference is one
deterministic computation, and running it on every rank of an oversubscribed launch only costs
CPU (as in ``tied_cases.py``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

import tfsmp
from tfsmp.graph.tracer import trace

RTOL, ATOL = 1e-5, 1e-6


def rows(x: Any, start: int, stop: int) -> Any:
    return keras.tree.map_structure(lambda a: a[start:stop], x)


def weight_error(got: list[np.ndarray], ref: list[np.ndarray], rtol: float = RTOL,
                 atol: float = ATOL) -> float:
    """max over weights of max |got - ref| / (atol + rtol |ref|): <= 1 means equal."""
    return max((float(np.max(np.abs(a - b) / (atol + rtol * np.abs(b)))) if a.size else 0.0
                for a, b in zip(got, ref, strict=True)), default=0.0)


def forced_plan(model: keras.Model, stage_of: Callable[[str, int], int], num_stages: int,
                folder: str, name: str) -> str:
    """A partition file: ``stage_of(node, position)`` for every traced node (in topological
    order, inputs excluded). Returns its path (one file per rank: ranks write concurrently)."""
    graph = trace(model).graph
    order = [n for n in graph.topological_order() if not graph.nodes[n].is_input]
    plan = {"num_stages": num_stages,
            "stage_of": {n: stage_of(n, i) for i, n in enumerate(order)}}
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}_plan_{tfsmp_rank()}.json")
    with open(path, "w") as f:
        json.dump(plan, f)
    return path


def tfsmp_rank() -> int:
    from mpi4py import MPI

    return int(MPI.COMM_WORLD.Get_rank())


def reference(build: Callable[[], keras.Model], compile_args: Callable[[], dict[str, Any]],
              batches: list[tuple[Any, ...]]) -> tuple[list[np.ndarray], list[float],
                                                       list[np.ndarray]]:
    """(initial weights, per-step losses, final weights) of plain Keras, trained on rank 0."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    model = build()
    init = model.get_weights()
    out = None
    if world.Get_rank() == 0:
        model.compile(**compile_args())
        losses = [_first(model.train_on_batch(*b)) for b in batches]
        out = (losses, model.get_weights())
    losses, weights = world.bcast(out, root=0)
    return init, losses, weights


def pipelined(build: Callable[[], keras.Model], init: list[np.ndarray],
              compile_args: Callable[[], dict[str, Any]], batches: list[tuple[Any, ...]]
              ) -> tuple[list[float], list[np.ndarray], tfsmp.DistributedModel]:
    """Per-step losses and final weights of tfsmp training from ``init``."""
    inner = build()
    inner.set_weights(init)
    dm = tfsmp.DistributedModel(inner)
    dm.compile(**compile_args())
    losses = [_first(dm.train_on_batch(*b)) for b in batches]
    return losses, dm.get_weights(), dm


def compare(build: Callable[[], keras.Model], compile_args: Callable[[], dict[str, Any]],
            batches: list[tuple[Any, ...]], rtol: float = RTOL, atol: float = ATOL
            ) -> dict[str, Any]:
    """Trains both ways and reports losses, the weight error and whether both agree."""
    init, ref_losses, ref_weights = reference(build, compile_args, batches)
    losses, weights, dm = pipelined(build, init, compile_args, batches)
    err = weight_error(weights, ref_weights, rtol, atol)
    names = [w.path for w in dm.weights]
    worst = max(range(len(weights)), key=lambda i: weight_error([weights[i]], [ref_weights[i]],
                                                                rtol, atol), default=0)
    loss_ok = bool(np.allclose(losses, ref_losses, rtol=rtol, atol=atol))
    plan = dm._engine.plan
    return {"ok": bool(loss_ok and err <= 1.0), "losses": losses, "ref_losses": ref_losses,
            "weight_err": err, "worst_weight": names[worst] if names else None,
            "stage_of": dict(plan.stage_of), "ties": [list(t.nodes) for t in plan.ties],
            "boundaries": [b.tensor for b in plan.boundaries]}


def _first(value: Any) -> float:
    return float(value[0] if isinstance(value, (list, tuple)) else value)
