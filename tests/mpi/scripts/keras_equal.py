"""Train a model with plain Keras and with tfsmp for a few steps and compare (case-script helper).

Plain Keras trains on world rank 0 only and broadcasts its losses and weights: every rank builds
the same seeded model on the same batches with one intra-op thread, so the reference is one
deterministic computation, and running it on every rank of an oversubscribed launch only costs
CPU (as in ``tied_cases.py``).
"""

from __future__ import annotations

import json
import os
import re
import time
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


Reference = tuple[list[np.ndarray], list[float], list[np.ndarray]]
RefSpec = tuple[Callable[[], keras.Model], Callable[[], dict[str, Any]], list[tuple[Any, ...]]]
_REFERENCES: dict[str, Reference] = {}


def train_reference(build: Callable[[], keras.Model], compile_args: Callable[[], dict[str, Any]],
                    batches: list[tuple[Any, ...]]) -> Reference:
    """(initial weights, per-step losses, final weights) of plain Keras, in this process."""
    model = build()
    init = model.get_weights()
    model.compile(**compile_args())
    losses = [_first(model.train_on_batch(*b)) for b in batches]
    return init, losses, model.get_weights()


def reference(build: Callable[[], keras.Model], compile_args: Callable[[], dict[str, Any]],
              batches: list[tuple[Any, ...]]) -> Reference:
    """`train_reference` on rank 0, its result on every rank."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    out = train_reference(build, compile_args, batches) if world.Get_rank() == 0 else None
    return world.bcast(out, root=0)  # type: ignore[no-any-return]


def references(specs: dict[str, RefSpec], folder: str | None = None) -> dict[str, float]:
    """Trains the plain Keras reference of every named model once, the i-th on rank i mod size
    (all ranks train at once, then exchange), and keeps them for `compare(cache=name)`. With
    ``folder``, references found there (saved by an earlier launch) are loaded instead, and new
    ones are saved. Returns the seconds each reference took on its owner."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    paths = {name: os.path.join(folder, f"{name}.npz") if folder else "" for name in specs}
    found = world.bcast([n for n, p in paths.items() if p and os.path.exists(p)]
                        if rank == 0 else None, root=0)
    owner = {name: i % size for i, name in enumerate(specs)}
    mine: dict[str, tuple[Reference, float]] = {}
    for name, (build, compile_args, batches) in specs.items():
        if name not in found and owner[name] == rank:
            start = time.monotonic()
            mine[name] = (train_reference(build, compile_args, batches),
                          round(time.monotonic() - start, 2))
            if paths[name]:
                _save(paths[name], mine[name][0])
    seconds: dict[str, float] = {}
    for name in specs:
        if name in found:
            _REFERENCES[name], seconds[name] = _load(paths[name]), 0.0
        else:
            _REFERENCES[name], seconds[name] = world.bcast(mine.get(name), root=owner[name])
    return seconds


def _save(path: str, ref: Reference) -> None:
    init, losses, weights = ref
    tmp = f"{path}.{os.getpid()}.npz"
    arrays = {f"arr_{i}": a for i, a in enumerate([*init, *weights])}
    np.savez(tmp, losses=np.asarray(losses), n=len(init), **arrays)
    os.replace(tmp, path)


def _load(path: str) -> Reference:
    with np.load(path) as f:
        n = int(f["n"])
        arrays = [f[f"arr_{i}"] for i in range(2 * n)]
        return arrays[:n], [float(x) for x in f["losses"]], arrays[n:]


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
            batches: list[tuple[Any, ...]], rtol: float = RTOL, atol: float = ATOL,
            cache: str | None = None, noise: str | None = None,
            noise_bound: float = 0.0) -> dict[str, Any]:
    """Trains both ways and reports losses, the weight error and whether both agree.

    ``cache``: a name under which this launch keeps the reference for later cases. ``noise``:
    a regular expression of weight paths whose exact gradient is zero, so that Adam moves them
    by round-off alone; those are held to ``|w| <= noise_bound`` on both sides instead."""
    start = time.monotonic()
    found = _REFERENCES.get(cache) if cache is not None else None
    if found is None:
        found = reference(build, compile_args, batches)
        if cache is not None:
            _REFERENCES[cache] = found
    init, ref_losses, ref_weights = found
    middle = time.monotonic()
    losses, weights, dm = pipelined(build, init, compile_args, batches)
    seconds = (round(middle - start, 2), round(time.monotonic() - middle, 2))
    names = [w.path for w in dm.weights]
    quiet = [bool(noise and re.search(noise, n)) for n in names]
    noise_ok = all(float(np.max(np.abs(w), initial=0.0)) <= noise_bound
                   for q, pair in zip(quiet, zip(weights, ref_weights)) if q for w in pair)
    errs = [0.0 if q else weight_error([a], [b], rtol, atol)
            for q, a, b in zip(quiet, weights, ref_weights)]
    worst = max(range(len(errs)), key=errs.__getitem__, default=0)
    loss_ok = bool(np.allclose(losses, ref_losses, rtol=rtol, atol=atol))
    plan = dm._engine.plan
    return {"ok": bool(loss_ok and max(errs, default=0.0) <= 1.0 and noise_ok),
            "losses": losses, "ref_losses": ref_losses, "weight_err": max(errs, default=0.0),
            "worst_weight": names[worst] if names else None, "noise_ok": noise_ok,
            "stage_of": dict(plan.stage_of), "ties": [list(t.nodes) for t in plan.ties],
            "boundaries": [b.tensor for b in plan.boundaries],
            "seconds": seconds}  # (reference, pipelined)


def _first(value: Any) -> float:
    return float(value[0] if isinstance(value, (list, tuple)) else value)
