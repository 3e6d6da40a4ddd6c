"""One stage's gradients in one step, owned in one place: accumulators, sparse rows, finiteness.

Example::

    store = GradientStore(stage=1, trainable=program.trainable)   # accumulators, sparse rules
    grads = store.step()                           # a step starts: the next write assigns
    first = grads.take_fresh()                     # inside compiled code: acc = g, then acc += g
    grads.add_sparse(microbatch, {"3": (values, indices)})
    grads.combine_microbatches()                   # the batch's IndexedSlices per variable
    grads.sparse[3]                                # (values, indices) as the full batch has them

[Note: gradient state] Every gradient a stage produces during a step lives here and nowhere
else: the dense accumulators its compiled programs write, the sparse parts of embedding-like
variables, the finite flags of every accumulation, the per-microbatch gradients `smp.step`
collects, and the stage's layer-loss values. The engine's data-parallel reduction, the tied-copy
sum and the optimizer step read and replace them only through these methods, so no other object
holds an alias that a later phase could see stale.

[Note: sparse structure] A Keras optimizer applies a `tf.IndexedSlices` gradient slice by slice
(Adam squares each slice's values and scatter-adds them), so two slices of one row do not equal
one slice of their sum. The step must therefore hand the optimizer exactly the slices the full
batch's gradient would have. That depends on the lookup: a lookup whose indices come from the
batch (token ids) yields one slice per looked-up row, so the full batch's slices are every
microbatch's and replica's slices concatenated in batch order (``"concat"``); a lookup whose
indices do not depend on the batch (`Embedding(ops.arange(L))` position tables, T5's relative
position buckets) yields the same indices for any batch, with values summed over the batch, so
the full batch's gradient has those indices once and the sum of the parts' values (``"sum"``).
Which of the two a variable follows is measured once per stage (`StageProgram._measure_sparse`):
its gradient for a microbatch and for that microbatch repeated twice have the same number of
slices for ``"sum"`` and twice as many for ``"concat"``. The counts are the static shapes of a
trace that never runs (run eagerly, the stage's tape held twice a microbatch's activations and
set a rank's peak); only a count known at run time alone runs the stage.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import tensorflow as tf

from tfsmp.errors import StepError

__all__ = ["GradientState", "GradientStore", "SparsePart", "all_finite", "combine_parts"]

SparsePart = tuple[Any, Any]  # (values, indices) of one tf.IndexedSlices gradient
CONCAT, SUM = "concat", "sum"


def combine_parts(parts: list[SparsePart], rule: str, what: str = "") -> SparsePart:
    """The full batch's ``(values, indices)`` from parts in batch order ([Note: sparse structure]).

    Raises:
        StepError: for the ``"sum"`` rule, when the parts' indices differ (the lookup was
            measured to be independent of the batch, so they must not).
    """
    if len(parts) == 1:
        return parts[0]
    if rule == CONCAT:
        return (tf.concat([tf.convert_to_tensor(v) for v, _ in parts], 0),
                tf.concat([tf.convert_to_tensor(x) for _, x in parts], 0))
    first = np.asarray(parts[0][1])
    for _, x in parts[1:]:
        if not np.array_equal(np.asarray(x), first):
            raise StepError(
                f"A lookup whose indices do not depend on the batch must read the same rows for "
                f"every microbatch. Received: different rows for {what or 'a variable'} in "
                f"different microbatches. Use microbatches=1 for this model, or report the model.")
    total = tf.add_n([tf.convert_to_tensor(v) for v, _ in parts])
    return total, tf.convert_to_tensor(parts[0][1])


def _dense(g: Any) -> tf.Tensor:
    return g.values if isinstance(g, tf.IndexedSlices) else g


def _exactly_finite(grads: list[Any]) -> tf.Tensor:
    flags = [tf.reduce_all(tf.math.is_finite(_dense(g))) for g in grads]
    return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)


def all_finite(grads: list[Any]) -> tf.Tensor:
    """Whether every element of every tensor is finite ([Note: cheap finiteness] in
    fused_step.py): one sum over them all, the exact element-wise test only where it is not."""
    if not grads:
        return tf.constant(True)
    total = tf.add_n([tf.cast(tf.reduce_sum(_dense(g)), tf.float32) for g in grads])
    return tf.cond(tf.math.is_finite(total), lambda: tf.constant(True),
                   lambda: _exactly_finite(grads))


class GradientStore:
    """A stage's gradient storage that outlives steps: its accumulators (one variable per
    trainable, reused by every step) and the sparse rules measured once ([Note: sparse
    structure]). Each step's gradients are a new `GradientState` made by `step`."""

    def __init__(self, stage: int, trainable: list[Any], accumulate: bool = True) -> None:
        self.stage = stage
        self.trainable = trainable
        # none when the stage updates its variables inside its backward ([Note: direct update]
        # in tfsmp/runtime/memory.py)
        self.accumulators: list[tf.Variable] = []
        # [Note: traced accumulators] A compiled program captures the accumulator variables
        # it writes when it traces; this counts the times the set of variables changed, so
        # that programs traced before trace anew (a model compiled again with a new optimizer
        # decides its accumulators anew, and its old programs wrote the dropped variables).
        self.generation = 0
        if accumulate:
            self.ensure_accumulators()
        self.rules: dict[int, str] = {}  # sparse variable index -> CONCAT | SUM
        self._check = tf.function(all_finite)  # [Note: finite flags] in stage.py

    def written_finite(self, sparse: frozenset[int]) -> bool:
        """Whether every accumulator a step wrote is finite (one compiled sum over them): all
        but placeholders ([Note: weights at the step's end]) and ``sparse`` variables'."""
        accs = [a for i, (a, v) in enumerate(zip(self.accumulators, self.trainable))
                if i not in sparse and tuple(a.shape) == tuple(v.shape)]
        return bool(self._check(accs)) if accs else True

    def ensure_accumulators(self, skip: frozenset[int] = frozenset()) -> None:
        """One accumulator per trainable variable, keeping those that exist; a variable of
        ``skip`` gets an empty placeholder instead (its gradient is computed at the step's end:
        [Note: weights at the step's end] in stage.py)."""
        have = self.accumulators
        out = []
        for i, v in enumerate(self.trainable):
            old = have[i] if i < len(have) else None
            full = i not in skip
            if old is not None and (tuple(old.shape) == tuple(v.shape)) == full:
                out.append(old)
                continue
            out.append(tf.Variable(tf.zeros(v.shape if full else (0,), dtype=v.dtype),
                                   trainable=False, name=f"acc_{self.stage}_{i}"))
        if len(out) != len(have) or any(a is not b for a, b in zip(out, have)):
            self.generation += 1
        self.accumulators = out

    def drop_accumulators(self) -> None:
        """No accumulators until `ensure_accumulators` makes them anew."""
        if self.accumulators:
            self.accumulators = []
            self.generation += 1

    def step(self) -> GradientState:
        """The gradients of a new step, owned by that step's result ([Note: gradient state])."""
        return GradientState(self)


class GradientState:
    """One stage's gradients in one step. See the module docstring.

    [Note: results own their gradients] A step's `GradientState` is made when the step starts
    (`GradientStore.step`) and handed to the step's `StageResult`; the next step gets a new one.
    Its sparse parts, finite flags, collected per-microbatch gradients and layer losses are its
    own, so a `StepResult` kept past later steps stays whole. The dense accumulators are
    variables the store reuses from step to step (held by reference: a step's values last
    until the next step of the stage writes them), since copying every gradient per step
    would cost the memory and time they save.
    """

    def __init__(self, store: GradientStore) -> None:
        self._store = store
        self.stage = store.stage
        self.trainable = store.trainable
        # [Note: fresh accumulators] The first microbatch of a step *assigns* its weight
        # gradients and later ones add to them, so accumulators are never zeroed: 0 + g == g
        # exactly, and this saves a read and a write of every gradient per step.
        self.fresh = True
        self.fresh_w = True  # the same for a split stage's deferred half ([Note: split stages])
        self._parts: dict[int, dict[int, SparsePart]] = {}  # variable -> microbatch -> part
        self.sparse: dict[int, SparsePart] = {}  # the step's combined sparse gradients
        # [Note: finite flags] in stage.py: exact per-microbatch verdicts (the taped fallback's,
        # a direct update's) and hints (whether a microbatch's inputs were finite)
        self._flags: list[tuple[int, tf.Tensor]] = []
        self._hints: list[tuple[int, tf.Tensor]] = []
        self.collected: dict[int, list[Any]] = {}  # [Note: collect mode] in stage.py
        self.losses: dict[int, tf.Tensor] = {}  # microbatch -> the stage's layer losses

    @property
    def accumulators(self) -> list[tf.Variable]:
        """The stage's accumulators (the store's variables, by reference)."""
        return self._store.accumulators

    @property
    def rules(self) -> dict[int, str]:
        """The stage's measured sparse rules ([Note: sparse structure])."""
        return self._store.rules

    # -- a step --------------------------------------------------------------------------------

    def take_fresh(self) -> bool:
        """Whether this write is the step's first to the accumulators (and from now on, not)."""
        first, self.fresh = self.fresh, False
        return first

    def take_fresh_all(self) -> bool:
        """`take_fresh` for a backward that writes every accumulator, the W half's included
        (an unsplit backward: [Note: drain split] in executor.py)."""
        first = self.fresh
        self.fresh = self.fresh_w = False
        return first

    def take_fresh_w(self) -> bool:
        """`take_fresh` for a split stage's W half ([Note: split stages] in stage.py)."""
        first, self.fresh_w = self.fresh_w, False
        return first

    def add_flag(self, microbatch: int, flag: tf.Tensor) -> None:
        self._flags.append((microbatch, flag))

    def add_hint(self, microbatch: int, flag: tf.Tensor) -> None:
        self._hints.append((microbatch, flag))

    def add_sparse(self, microbatch: int, parts: dict[str, SparsePart]) -> None:
        """Keeps microbatch ``microbatch``'s sparse gradients (``{str(index): (values, indices)}``,
        as compiled code returns them)."""
        for key, part in parts.items():
            self._parts.setdefault(int(key), {})[microbatch] = part

    def zero_if_unwritten(self) -> None:
        """A step in which no microbatch reached this stage (a replica without rows in the
        batch) leaves the accumulators holding the last step's values: make them zeros."""
        if self.fresh and self.fresh_w and not self._parts:
            for acc in self.accumulators:
                acc.assign(tf.zeros_like(acc))

    def has_sparse(self) -> bool:
        return bool(self._parts) or bool(self.sparse)

    def sparse_indices(self) -> list[int]:
        """The variables with sparse gradients this step."""
        return sorted(self._parts.keys() | self.sparse.keys())

    def combine_microbatches(self) -> None:
        """Replaces the per-microbatch parts by the step's gradient per variable, in batch order."""
        for i, by_mb in self._parts.items():
            parts = [by_mb[k] for k in sorted(by_mb)]
            self.sparse[i] = combine_parts(parts, self.rules.get(i, CONCAT), self.variable_name(i))
        self._parts.clear()

    def combine_replicas(self, gathered: Iterable[dict[int, SparsePart]]) -> None:
        """Every replica's combined parts (in data-rank order, which is batch order) as one."""
        per_var: dict[int, list[SparsePart]] = {}
        for replica in gathered:
            for i, part in replica.items():
                per_var.setdefault(i, []).append(part)
        self.sparse = {i: combine_parts(parts, self.rules.get(i, CONCAT), self.variable_name(i))
                       for i, parts in per_var.items()}

    def host_sparse(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """The combined sparse gradients as numpy arrays (to send to peers)."""
        return {i: (np.asarray(v), np.asarray(x)) for i, (v, x) in self.sparse.items()}

    def set_sparse(self, i: int, part: SparsePart | None) -> None:
        """Replaces variable ``i``'s sparse gradient (None: it is dense from now on)."""
        if part is None:
            self.sparse.pop(i, None)
        else:
            self.sparse[i] = (tf.convert_to_tensor(part[0]), tf.convert_to_tensor(part[1]))

    def set_dense(self, i: int, value: Any) -> None:
        """Replaces variable ``i``'s gradient by a dense ``value``."""
        self.sparse.pop(i, None)
        self.accumulators[i].assign(value)

    def gradient(self, i: int) -> tuple[Any, ...]:
        """Variable ``i``'s gradient this step: ("sparse", values, indices) or ("dense", array)."""
        if i in self.sparse:
            values, indices = self.sparse[i]
            return ("sparse", np.asarray(values), np.asarray(indices))
        return ("dense", self.accumulators[i].numpy())

    def finite_status(self) -> tuple[bool, int | None]:
        """(whether the step's gradients are finite, the first microbatch to blame: -1 when
        none can be named) ([Note: finite flags] in stage.py); sparse parts are checked here
        too."""
        ok = all(bool(tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(v))))
                 for v, _ in self.sparse.values())
        wrote = not (self.fresh and self.fresh_w)
        dense_ok = self._store.written_finite(frozenset(self.sparse)) if wrote else True
        bad = _failed(self._flags)
        if bad is None and dense_ok:
            return ok, None
        if bad is None:
            bad = _failed(self._hints)
        return False, -1 if bad is None else bad

    def variable_name(self, i: int) -> str:
        v = self.trainable[i]
        return f"'{getattr(v, 'path', None) or v.name}'"


def _failed(flags: list[tuple[int, tf.Tensor]]) -> int | None:
    """The first microbatch whose flag is False (flags read at once), or None."""
    if not flags:
        return None
    values = tf.stack([f for _, f in flags]).numpy()
    if values.all():
        return None
    return min(i for (i, _), good in zip(flags, values) if not good)
