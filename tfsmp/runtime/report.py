"""The step report: every rank's finiteness and loss parts in one allgather, one loss assembly, one non-finite message.

Example::

    mine = RankReport.of(result, objective, rows=shape.rows, layer=..., regularization=...)
    report = StepReport.gather(comm.world, mine, watch)   # every rank's, in one allgather
    report.finite                                          # the same answer on every rank
    factor = report.assemble(objective, result, parts)     # result.loss, result.term_values

[Note: consistent skips] Whether an update is applied is decided from every rank's report, so
it is applied or skipped on every rank alike, and every rank learns the step's loss: the
compiled loss's terms from their numerators and normalizers summed over every part of the batch
([Note: loss numerators] in objective.py), plus every stage's layer losses and the weight
regularizers (each counted once in the job). Evaluation reports the same record with nothing
non-finite in it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

if TYPE_CHECKING:
    from tfsmp.comm.base import Group
    from tfsmp.runtime.executor import StepResult
    from tfsmp.runtime.objective import Objective

__all__ = ["DIRECT_NOTE", "RankReport", "StateWatch", "StepReport", "loss_records"]


def loss_records(objective: Objective, result: StepResult
                 ) -> tuple[list[tuple[np.ndarray, np.ndarray, int]], list[int]]:
    """The last stage's (numerators, normalizers, rows) per microbatch of ``result`` in order,
    and the microbatches whose numbers are not finite."""
    records, bad = [], []
    for i in sorted(result.records):
        n, d, _ = result.records[i]
        n, d = np.asarray(n), np.asarray(d)
        if not (np.isfinite(n).all() and np.isfinite(d).all()):
            bad.append(i)
        records.append((n, d, result.microbatches[i].size))
    return records, bad


@dataclass(frozen=True)
class RankReport:
    """What one rank tells every other at the end of a step."""

    partial: np.ndarray  # the compiled loss's [numerators..., normalizers...] (objective.partial)
    layer: float = 0.0  # this rank's stages' layer losses
    regularization: float = 0.0  # the weight regularizers this rank counts
    finite: bool = True  # every gradient of this rank's stages was finite
    first_nonfinite: dict[int, int] = field(default_factory=dict)  # stage -> microbatch
    bad_microbatches: tuple[int, ...] = ()  # loss parts that were not finite

    @classmethod
    def of_training(cls, result: StepResult, objective: Objective | None, rows: int, *,
                    regularization: float) -> RankReport:
        """This rank's report of a training step ([Note: one driver] in hooks.py: read from
        the result's stage results only)."""
        stages = result.stages.values()
        first = {r.stage: r.first_nonfinite for r in stages if r.first_nonfinite is not None}
        partial, bad = np.zeros(0), list[int]()
        if objective is not None and objective.prepared and result.records:
            records, bad = loss_records(objective, result)
            partial = objective.partial(records, rows)
        layer = float(sum(float(v) for r in stages for v in r.grads.losses.values()))
        return cls(partial, layer, regularization, all(r.finite for r in stages), first,
                   tuple(bad))


@dataclass(frozen=True)
class StepReport:
    """Every rank's `RankReport`, in world-rank order."""

    ranks: list[RankReport]

    @classmethod
    def gather(cls, world: Group, mine: RankReport, watch: Callable[[str], Any], what: str
               ) -> StepReport:
        with watch(what):
            return cls(list(world.allgather_obj(mine)))

    @property
    def finite(self) -> bool:
        return all(r.finite for r in self.ranks) and not any(r.bad_microbatches
                                                             for r in self.ranks)

    def assemble(self, objective: Objective | None, result: StepResult, parts: int) -> float:
        """Fills ``result.loss`` and ``result.term_values`` (the one loss assembly); returns the
        factor the gradients are multiplied by ([Note: loss numerators] in objective.py)."""
        if objective is None or not objective.prepared:
            return 1.0
        found = [r.partial for r in self.ranks if len(r.partial)]
        summed = np.sum(found, axis=0) if found else np.zeros(2 * len(objective.terms))
        result.term_values = objective.values(summed)
        result.loss = (objective.total(result.term_values)
                       + sum(r.layer for r in self.ranks)
                       + sum(r.regularization for r in self.ranks))
        return objective.deferred_factor(summed, parts)

    def nonfinite_message(self, rank_tag: str, step: int, direct: bool) -> str:
        """The one message of a step with non-finite values, naming where they appeared."""
        grads = {s: i for r in self.ranks for s, i in r.first_nonfinite.items()}
        mbs = sorted({i for r in self.ranks for i in r.bad_microbatches})
        where = ", ".join(f"stage {s} from microbatch {i}" if i >= 0 else
                          f"stage {s} (every microbatch's inputs were finite)"
                          for s, i in sorted(grads.items()))
        return (
            f"{rank_tag} Non-finite values at step {step}: loss of microbatch(es) "
            f"{mbs or 'none'} on the last stage; gradients of {where or 'no stage'}. "
            f"{DIRECT_NOTE if direct else ''}"
            f"Lower the learning rate, check the data, or set nonfinite='skip' to skip such "
            f"updates on every rank.")


DIRECT_NOTE = ("With one microbatch each stage updates its variables during its backward "
                "pass ([Note: direct update]), so variables with finite gradients were updated. ")


class StateWatch:
    """Warns once when a layer changed its own state during a step of several microbatches:
    it did so once per microbatch, where plain Keras does it once per batch (BatchNormalization's
    moving statistics are documented in docs/keras_semantics.md)."""

    def __init__(self, programs: Mapping[int, Any], rank_tag: str) -> None:
        self.programs = programs
        self.rank_tag = rank_tag
        self.warned = False

    @contextlib.contextmanager
    def watching(self, several_microbatches: bool) -> Iterator[None]:
        """Around a step: compares the layers' own state before and after (once per run)."""
        watch = several_microbatches and not self.warned
        before = self._digest() if watch else {}
        self.warned |= watch
        yield
        if before:
            after = self._digest()
            changed = sorted({name for name, value in before.items()
                              if after.get(name) != value})
            if changed:
                warnings.warn(
                    f"{self.rank_tag} Layers {changed} updated their own state in call(); "
                    f"with several microbatches they do so once per microbatch, where plain "
                    f"Keras does once per batch (as BatchNormalization, "
                    f"docs/keras_semantics.md).", stacklevel=5)

    def _digest(self) -> dict[str, float]:
        """A checksum of every non-trainable variable a layer may update in call() (moving
        statistics, documented apart, and random seed states excluded)."""
        return {f"{c.layer_name}": float(tf.reduce_sum(tf.abs(tf.cast(v, tf.float64))))
                for p in self.programs.values() for c in p.calls
                for v in getattr(c.layer, "non_trainable_variables", [])
                if "seed_generator" not in v.path and "moving_" not in v.path}
