"""Tied copies at run time: one rank's share of the variables several stages hold a copy of.

Example::

    ties = TiedCopies.of(traced, plan, programs, comm.pipeline, placement, tag_ub=comm.tag_ub)
    ties.sync()          # once: every copy takes the lowest stage's values
    ties.reduce(grads)   # every step, after the data-parallel reduction: sum the copies' grads
                         # (grads: {stage: GradientState} of the step's result)
    ties.primary         # (stage, index) of the one accumulator the optimizer reads per variable

[Note: tied reduction] A variable that layers on several stages read (a tied embedding, a layer
called far apart; [Note: tied copies] in `tfsmp.graph.ir`) has one copy on each rank running one
of those stages (virtual stages on one rank share the Python variable). Each stage accumulates
its own gradient of it. Before the optimizer step every rank holding a copy gets every other
stage's gradient (one pickled message per peer rank and group of variables, tag
``tag_ub - 1 - group``, never a pipeline tag) and sums them in ascending stage order, so every
copy receives bit-identical gradients; with the same optimizer and the same step count the copies
and their optimizer state stay identical (skipped steps are skipped on every rank alike, [Note:
consistent skips] in the engine). Gradients that every stage has as `tf.IndexedSlices` are
concatenated in stage order, as TensorFlow aggregates them; otherwise they are summed densely.
This runs after each stage's data-parallel reduction, so every replica computes the same sums.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tfsmp.errors import StepError
from tfsmp.partitioning.plan import StagePlan
from tfsmp.schedule.placement import Placement

if TYPE_CHECKING:
    from tfsmp.runtime.gradients import GradientState

__all__ = ["TiedCopies", "tied_groups"]

# One stage's gradient of one variable: ("dense", array) or ("sparse", values, indices).
Grad = tuple[Any, ...]


@dataclass
class TiedGroup:
    """Variables held by the same stages (``stages`` ascending; at least two)."""

    stages: tuple[int, ...]
    variables: list[Any]     # in model order

    def ranks(self, placement: Placement) -> list[int]:
        return sorted({placement.rank(s) for s in self.stages})


def tied_groups(traced: Any, plan: StagePlan) -> list[TiedGroup]:
    """Trainable variables read on two or more stages, grouped by those stages, in model
    variable order (the same on every rank)."""
    holders: dict[int, list[int]] = {}
    found: dict[int, Any] = {}
    for s in range(plan.num_stages):
        for v in traced.variables_of(plan.layers(s)):
            if v.trainable:
                holders.setdefault(id(v), []).append(s)
                found[id(v)] = v
    end = len(traced.variable_order)
    order = sorted((i for i, st in holders.items() if len(st) > 1),
                   key=lambda i: traced.variable_order.get(i, end))
    groups: dict[tuple[int, ...], TiedGroup] = {}
    for i in order:
        key = tuple(holders[i])
        groups.setdefault(key, TiedGroup(key, [])).variables.append(found[i])
    return list(groups.values())


class TiedCopies:
    """This rank's tied variables: one primary accumulator each, the sync and the reduction."""

    def __init__(self, groups: list[TiedGroup], programs: dict[int, Any], group: Any,
                 placement: Placement, tag_ub: int, watch: Callable[[str], Any] | None = None
                 ) -> None:
        self.programs = programs
        self.group = group
        self.placement = placement
        self.tag_ub = tag_ub
        self.watch = watch or (lambda what: contextlib.nullcontext())
        self.count = len(groups)  # the same on every rank
        local = set(programs)
        # the groups this rank takes part in, with their numbers (tags) kept
        self.groups = [(k, g) for k, g in enumerate(groups) if local & set(g.stages)]
        # per variable of this rank: the (stage, index) of its first local stage's accumulator
        self.primary: dict[int, tuple[int, int]] = {}
        for s in sorted(programs):
            for i, v in enumerate(programs[s].trainable):
                self.primary.setdefault(id(v), (s, i))

    @classmethod
    def of(cls, traced: Any, plan: StagePlan, programs: dict[int, Any], group: Any,
           placement: Placement, *, tag_ub: int, watch: Callable[[str], Any] | None = None
           ) -> TiedCopies:
        return cls(tied_groups(traced, plan), programs, group, placement, tag_ub, watch)

    def check_collect(self, rank_tag: str) -> None:
        """`smp.step` hands each rank's own gradients to the script, which applies them itself,
        so copies of tied variables on several stages would drift apart: refuse, on every rank.

        Raises:
            StepError: when some trainable variable has copies on two or more stages.
        """
        if self.count:
            raise StepError(
                f"{rank_tag} An smp.step training step needs every trainable variable on one "
                f"stage, since the script applies each rank's gradients itself. Received: a plan "
                f"with {self.count} group(s) of tied variables copied on several stages. Train "
                f"with model.fit (which sums the copies' gradients), or put the layers sharing "
                f"the variables in one smp.partition scope.")

    def unique(self) -> list[tuple[Any, int, int]]:
        """(variable, stage, index) of each of this rank's trainable variables once, in stage
        order: what the optimizer updates."""
        out = []
        for s in sorted(self.programs):
            for i, v in enumerate(self.programs[s].trainable):
                if self.primary[id(v)] == (s, i):
                    out.append((v, s, i))
        return out

    # -- messages ------------------------------------------------------------------------------

    def _exchange(self, k: int, g: TiedGroup, mine: Any) -> dict[int, Any]:
        """Sends ``mine`` to every other rank of the group; returns {rank: its message}."""
        me = self.group.rank
        peers = [r for r in g.ranks(self.placement) if r != me]
        tag = self.tag_ub - 1 - k
        sends = [self.group.isend_obj(mine, r, tag) for r in peers]
        with self.watch(f"the gradients of tied copies from stages {list(g.stages)}"):
            got = {r: self.group.recv_obj(r, tag) for r in peers}
            for req in sends:
                req.wait()
        got[me] = mine
        return got

    def sync(self) -> None:
        """Gives every copy the values of the lowest stage's (the copy checkpoints write), so
        the copies start identical even when initializers were not seeded alike."""
        for k, g in self.groups:
            root = self.placement.rank(g.stages[0])
            mine = [v.numpy() for v in g.variables] if self.group.rank == root else None
            got = self._exchange(k, g, mine)
            if self.group.rank != root:
                for v, value in zip(g.variables, got[root]):
                    v.assign(value)

    def reduce(self, grads: Mapping[int, GradientState]) -> None:
        """Sums each tied variable's gradient over the stages holding it (see [Note: tied
        reduction]) into its primary accumulator (dense) or sparse parts; ``grads`` are this
        rank's stages' gradients of the step ([Note: results own their gradients] in
        gradients.py)."""
        for k, g in self.groups:
            local = [s for s in g.stages if s in self.programs]
            mine = {s: [self._grad(grads[s], v) for v in g.variables] for s in local}
            got = self._exchange(k, g, mine)
            per_stage: dict[int, list[Grad]] = {}
            for part in got.values():
                per_stage.update(part)
            for j, v in enumerate(g.variables):
                total = _combine([per_stage[s][j] for s in g.stages], tuple(v.shape))
                self._store(grads, v, total)

    @staticmethod
    def _grad(grads: GradientState, v: Any) -> Grad:
        i = next(i for i, w in enumerate(grads.trainable) if w is v)
        return grads.gradient(i)

    def _store(self, grads: Mapping[int, GradientState], v: Any, total: Grad) -> None:
        """[Note: gradient state] in gradients.py: the primary copy's state takes the sum."""
        s, i = self.primary[id(v)]
        if total[0] == "sparse":
            grads[s].set_sparse(i, (total[1], total[2]))
        else:
            grads[s].set_dense(i, total[1])


def _combine(parts: list[Grad], shape: tuple[int, ...]) -> Grad:
    """The sum of one variable's per-stage gradients, in the given (stage) order."""
    if all(p[0] == "sparse" for p in parts):
        return ("sparse", np.concatenate([p[1] for p in parts]),
                np.concatenate([p[2] for p in parts]))
    total: np.ndarray | None = None
    for p in parts:
        dense = p[1] if p[0] == "dense" else _densify(p[1], p[2], shape)
        total = dense.copy() if total is None else total + dense
    return ("dense", total)


def _densify(values: np.ndarray, indices: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    out = np.zeros(shape, dtype=values.dtype)
    np.add.at(out, indices, values)
    return out
