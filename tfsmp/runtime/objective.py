"""The training objective of a pipelined step: Keras's compiled loss, split into microbatch parts.

Example::

    objective = Objective(model._compile_loss)
    objective.prepare(y, sample_weight, y_pred_like, parts=m * d, rank_tag=tag)  # every rank
    consts = objective.constants(rows_global=256, rows=32, y=y, sample_weight=sw, scale=1.0)
    with objective.recording() as terms:          # inside a stage's compiled function
        compile_loss(y_i, y_pred_i, sw_i)
    backprop = objective.backprop(terms, consts)  # this microbatch's share of the batch loss

[Note: loss numerators] Keras reduces a loss over the whole batch: ``sum(values * weights) / D``
where the normalizer ``D`` is the number of loss values (``"sum_over_batch_size"``), the number
of unmasked ones when the prediction carries a Keras mask, the sum of the sample weights
(``"mean_with_sample_weight"``), or 1 (``"sum"``). A microbatch's own mean divides by its own
``D``, so averaging microbatch losses is right only when every microbatch has the same ``D``
(masked tokens and sample weights differ). Each microbatch therefore yields its numerator ``N``
and normalizer ``D`` per compiled-loss term, computed by Keras's own loss code with the
reduction set aside, and the batch's value of a term is ``ΣN / ΣD`` over every microbatch and
replica. The backward pass of microbatch ``i`` differentiates ``Σ_k w_k · N_k,i / D_k`` with the
batch's normalizer ``D_k``, known before the step for every kind of term but one:

- ``count``: ``D`` is the number of values, a fixed count per sample, so ``D = D_i · rows / rows_i``;
- ``weights``: the batch's sum of sample weights, from the batch on the host;
- ``sum``: 1;
- ``scalar``: a loss function that returns one value per call; it is measured once whether it
  sums or averages its rows ([Note: decomposable losses] in layer_losses.py) and weighted so;
- ``mask``: the count of unmasked values, which only the forward pass reveals. With one part per
  step it is exact in place; otherwise the term must be the step's only loss, and the gradients
  of ``Σ N`` are divided by the batch's ``ΣD`` once, before the optimizer step (deferred).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import ops, tree
from keras.src.backend import get_keras_mask, set_keras_mask
from keras.src.losses import loss as keras_loss

from tfsmp.errors import StepError
from tfsmp.runtime import layer_losses

__all__ = ["Consts", "Objective", "Term"]

# kinds of terms ([Note: loss numerators])
SUM, COUNT, WEIGHTS, MASK, SCALAR = "sum", "count", "weights", "mask", "scalar"
_MEANS = ("sum_over_batch_size", "mean")


class Consts:
    """The layout of the per-microbatch constants vector every stage program takes.

    ``[rows, rows_mb, scale, exact_mask, inv_weights_0..K-1, mean_rule_0..K-1]``: the global
    batch's rows, this microbatch's rows, the loss scale, 1 when a ``mask`` term is exact in
    place (one part per step), each ``weights`` term's 1 / (batch's sum of sample weights), and
    1 where a ``scalar`` term averages its rows.
    """

    ROWS, ROWS_MB, SCALE, EXACT_MASK, TERMS = 0, 1, 2, 3, 4

    @staticmethod
    def frac(consts: tf.Tensor) -> tf.Tensor:
        """This microbatch's share of the batch's rows."""
        return tf.math.divide_no_nan(consts[Consts.ROWS_MB], consts[Consts.ROWS])


@dataclass
class Term:
    """One compiled-loss term: a flat loss of `CompileLoss` (one per output it applies to)."""

    path: tuple[Any, ...]
    name: str
    weight: float
    loss: Any
    kind: str = COUNT
    mean_rule: bool = True  # ``scalar`` kind: the value averages its rows (else sums them)


@dataclass
class Recorded:
    """What the terms of one call of the compiled loss produced (inside compiled code)."""

    numerators: list[tf.Tensor] = field(default_factory=list)
    normalizers: list[tf.Tensor] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)  # each term's loss weight


class _Recorder:
    """Stands in for one flat loss inside `CompileLoss.call` and records its N and D."""

    def __init__(self, loss: Any, reduction: str | None, out: Recorded) -> None:
        self.loss, self.reduction, self.out = loss, reduction, out
        self.name = getattr(loss, "name", "loss")

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> tf.Tensor:
        n, d, kind = decompose(self.loss, y_true, y_pred, sample_weight)
        self.out.numerators.append(n)
        self.out.normalizers.append(d)
        self.out.kinds.append(kind)
        return tf.math.divide_no_nan(n, d) if kind not in (SUM, SCALAR) else n


def _custom_call(loss: Any) -> bool:
    return not isinstance(loss, keras.losses.Loss) or type(loss).__call__ is not keras.losses.Loss.__call__


def decompose(loss: Any, y_true: Any, y_pred: Any, sample_weight: Any) -> tuple[tf.Tensor, tf.Tensor, str]:
    """(numerator, normalizer, kind) of one Keras loss on one microbatch: `Loss.__call__` with
    the reduction split into its sum and its divisor ([Note: loss numerators])."""
    if _custom_call(loss):  # a Loss whose __call__ is its own: its value, measured as a scalar
        value = ops.cast(loss(y_true, y_pred, sample_weight), "float32")
        return value, tf.ones((), value.dtype), SCALAR
    reduction = loss.reduction
    in_mask = get_keras_mask(y_pred)
    with keras.name_scope(loss.name):
        y_pred = tree.map_structure(lambda x: ops.convert_to_tensor(x, dtype=loss.dtype), y_pred)
        y_true = tree.map_structure(lambda x: ops.convert_to_tensor(x, dtype=loss.dtype), y_true)
        values = loss.call(y_true, y_pred)
        out_mask = get_keras_mask(values)
        mask = in_mask if out_mask is None else (out_mask if in_mask is None else in_mask & out_mask)
        values = ops.convert_to_tensor(values, dtype=loss.dtype)
        weights = None if sample_weight is None else ops.convert_to_tensor(sample_weight, loss.dtype)
        if mask is not None:
            mask = ops.convert_to_tensor(mask, dtype=loss.dtype)
        merged = keras_loss.apply_mask(weights, mask, dtype=values.dtype, reduction="sum")
        if merged is not None:
            merged = ops.cast(merged, values.dtype)
            values, merged = keras_loss.squeeze_or_expand_to_same_rank(values, merged)
            values = values * merged
        if tuple(values.shape) == () or reduction == "sum":
            return ops.sum(values), tf.ones((), values.dtype), SCALAR if not values.shape.rank else SUM
        size = ops.cast(ops.size(values), values.dtype)
        n = ops.sum(values)
        if reduction in _MEANS:
            if mask is None:
                return n, size, COUNT
            valid = ops.sum(mask)  # Keras: sum(v*w*mask*total/valid) / size == n / valid
            return n, valid * size / ops.cast(ops.size(mask), values.dtype), MASK
        if merged is None:  # mean_with_sample_weight without weights or mask: the count
            return n, size, COUNT
        return n, ops.sum(merged), MASK if mask is not None else WEIGHTS


class Objective:
    """The compiled loss of a model, decomposed for microbatches. See the module docstring."""

    def __init__(self, compile_loss: Any, custom: Any = None) -> None:
        self.compile_loss = compile_loss
        # [Note: a model's own compute_loss] in tfsmp/keras/model_loss.py: called as
        # ``custom(inputs, y, y_pred, sample_weight)`` (``inputs``: the model's inputs in
        # `TracedModel.input_keys` order), one scalar term in place of the compiled loss's
        self.custom = custom
        self.terms: list[Term] = []
        self.deferred = False  # a mask term's normalizer is applied after accumulation
        self.prepared = False

    # -- recording inside compiled code --------------------------------------------------------

    @contextlib.contextmanager
    def recording(self) -> Iterator[Recorded]:
        """Inside this scope, a call of the compiled loss records every term's N and D (and
        leaves Keras's per-output loss metrics alone: the step updates them once, exactly)."""
        cl, out = self.compile_loss, Recorded()
        original_build = cl.build

        def swap() -> tuple[Any, Any]:
            saved = (cl._flat_losses, cl._metrics)  # noqa: SLF001 (Keras's CompileLoss)
            out.weights = [1.0 if f.loss_weights is None else float(f.loss_weights)
                           for f in saved[0]]
            cl._flat_losses = [f._replace(loss=_Recorder(f.loss, getattr(f.loss, "reduction", None),
                                                         out)) for f in saved[0]]
            cl._metrics = [None] * len(saved[0])  # noqa: SLF001
            return saved

        saved: list[Any] = []

        def build(y_true: Any, y_pred: Any) -> None:
            original_build(y_true, y_pred)
            saved.append(swap())

        if cl.built:
            saved.append(swap())
        else:
            cl.build = build
        try:
            yield out
        finally:
            if "build" in vars(cl):
                del cl.build
            if saved:
                cl._flat_losses, cl._metrics = saved[0]  # noqa: SLF001

    def call(self, y: Any, y_pred: Any, sample_weight: Any, inputs: list[Any] | None = None
             ) -> Recorded:
        """Runs the compiled loss on one microbatch, recording its terms (none for a model
        compiled without a loss, which trains on its layers' losses alone, as in Keras); or
        the model's own compute_loss (`custom`), one ``scalar`` term, given the microbatch's
        ``inputs``."""
        if self.custom is not None:
            if inputs is None:
                raise StepError("A model's own compute_loss needs the microbatch's inputs "
                                "(tfsmp passes them to the last stage). Please report this.")
            value = tf.cast(self.custom(inputs, y, y_pred, sample_weight), tf.float32)
            return Recorded([value], [tf.ones((), tf.float32)], [SCALAR], [1.0])
        if self.compile_loss is None:
            return Recorded()
        with self.recording() as out:
            self.compile_loss(y, y_pred, sample_weight)
        return out

    def foreign_read(self, y: Any, sample_weight: Any, y_pred: Any, inputs: list[Any]
                     ) -> str | None:
        """[Note: a loss that reads other stages] A model's own compute_loss runs inside the
        last stage's compiled programs, where a variable another rank holds cannot be read.
        Traces it as they do (on specs shaped like ``y``, ``sample_weight``, ``y_pred`` and
        ``inputs``, running nothing) on a rank that holds the last stage: the path of the
        first such variable it reads, else None. Any other error the trace meets is left to the
        step, which reports it as before."""
        if self.custom is None:
            return None
        from tfsmp.graph.deferred import ForeignRead

        def trace(ys: Any, sws: Any, preds: list[tf.Tensor], ins: list[tf.Tensor]) -> tf.Tensor:
            self.call(ys, tree.pack_sequence_as(y_pred, preds), sws, ins)
            return tf.zeros(())

        specs = tree.map_structure(_spec, (y, sample_weight))
        try:
            tf.function(trace, autograph=False).get_concrete_function(
                *specs, [_spec(t) for t in tree.flatten(y_pred)], [_spec(t) for t in inputs])
        except ForeignRead as e:
            return e.path
        except Exception:  # not this check's to report: the step does
            return None
        return None

    def backprop(self, rec: Recorded, consts: tf.Tensor) -> tf.Tensor:
        """This microbatch's share of the batch's compiled loss ([Note: loss numerators]).

        Raises:
            StepError: (while tracing) when the terms' kinds differ from those `prepare`
                learnt, since the step's constants were computed for those.
        """
        prepared = [t.kind for t in self.terms]
        if self.prepared and rec.kinds != prepared:
            raise StepError(
                f"The compiled loss must have the same kinds of terms in every step. Received: "
                f"{rec.kinds} while tracing a stage, {prepared} before training (a Keras mask "
                f"on the model's output that tfsmp did not see at the start). Please report "
                f"the model; microbatches=1 with one replica avoids the split.")
        total = tf.zeros((), tf.float32)
        k = len(rec.numerators)
        frac = Consts.frac(consts)
        for j, (n, d, kind) in enumerate(zip(rec.numerators, rec.normalizers, rec.kinds)):
            n, d = tf.cast(n, tf.float32), tf.cast(d, tf.float32)
            if kind == COUNT:
                share = tf.math.divide_no_nan(n * frac, d)
            elif kind == WEIGHTS:
                share = n * consts[Consts.TERMS + j]
            elif kind == MASK:
                exact = consts[Consts.EXACT_MASK]
                share = exact * tf.math.divide_no_nan(n, d) + (1.0 - exact) * n
            elif kind == SCALAR:
                mean = consts[Consts.TERMS + k + j]
                share = n * (mean * frac + (1.0 - mean))
            else:
                share = n
            total += share * rec.weights[j]
        return total

    # -- before the first step, on every rank --------------------------------------------------

    def prepare(self, y: Any, sample_weight: Any, y_pred: Any, *, parts: int,
                has_layer_losses: bool, scaled: bool, rank_tag: str,
                inputs: list[Any] | None = None) -> None:
        """Learns each term's kind by tracing the compiled loss on inputs shaped like the
        step's (``y_pred``: tensors shaped like the model's outputs, carrying their Keras masks),
        and refuses what a pipeline cannot honour, on every rank alike, before any message.

        Raises:
            StepError: a reduction of None, a scalar loss that is neither a sum nor a mean over
                its rows, or a masked term that is not the step's only loss.
        """
        if self.custom is not None:  # [Note: a model's own compute_loss]
            self.terms, self.deferred = [Term((), "compute_loss", 1.0, None, SCALAR)], False
            # once, eagerly, on every rank: what its first call creates (a compiled loss's
            # per-output means, its own metrics' variables) exists alike everywhere
            self.call(y, y_pred, sample_weight, inputs)
            check = getattr(self.custom, "check_additive", None)
            if has_layer_losses and check is not None:
                check(inputs, y, y_pred, sample_weight, rank_tag=rank_tag)
            if parts > 1:
                self._scalar_rules(y, sample_weight, y_pred, rank_tag, inputs)
            self.prepared = True
            return
        if self.compile_loss is None:  # the layers' losses only: no terms
            self.terms, self.deferred, self.prepared = [], False, True
            return
        preds = tree.flatten(y_pred)
        masks = [get_keras_mask(t) for t in preds]
        found: list[Recorded] = []

        def trace(ys: Any, sws: Any, placeholders: list[tf.Tensor]) -> tf.Tensor:
            for p, m in zip(placeholders, masks):
                if m is not None:
                    set_keras_mask(p, tf.ones(tf.concat([tf.shape(p)[:1], m.shape[1:]], 0), tf.bool))
            found.append(self.call(ys, tree.pack_sequence_as(y_pred, placeholders), sws))
            return tf.zeros(())

        specs = tree.map_structure(_spec, (y, sample_weight))
        tf.function(trace, autograph=False).get_concrete_function(*specs, [_spec(t) for t in preds])
        rec = found[-1]
        flat = self.compile_loss._flat_losses
        self.terms = [Term(tuple(f.path), f.name, w, f.loss, kind)
                      for f, w, kind in zip(flat, rec.weights, rec.kinds)]
        for t in self.terms:
            reduction = getattr(t.loss, "reduction", "sum_over_batch_size")
            if reduction in (None, "none") and not _custom_call(t.loss):
                raise StepError(
                    f"{rank_tag} A training loss must reduce to one value per batch. Received: "
                    f"loss '{t.name}' with reduction={reduction!r}. Use reduction="
                    f"'sum_over_batch_size' (Keras's default) or 'sum'.")
        if parts > 1 and any(t.kind == SCALAR for t in self.terms):
            self._scalar_rules(y, sample_weight, y_pred, rank_tag)
        masked = [t for t in self.terms if t.kind == MASK]
        self.deferred = bool(masked) and parts > 1  # ``parts``: the most a step can have
        if self.deferred and (len(self.terms) > 1 or has_layer_losses or scaled):
            others = ("other compiled losses" if len(self.terms) > 1 else
                      "layer losses (regularizers, add_loss)" if has_layer_losses else
                      "loss scaling (mixed precision or loss_scale_factor)")
            raise StepError(
                f"{rank_tag} A loss normalized by the count of unmasked values is known only "
                f"after the forward pass, so with several microbatches or replicas tfsmp divides "
                f"the accumulated gradients by it once, which needs it to be the step's only "
                f"loss. Received: masked loss '{masked[0].name}' together with {others}, "
                f"microbatches x replicas = {parts}. Use microbatches=1 with one replica, or "
                f"pass the mask as sample_weight with reduction='sum_over_batch_size'.")
        self.prepared = True

    def _scalar_rules(self, y: Any, sample_weight: Any, y_pred: Any, rank_tag: str,
                      inputs: list[Any] | None = None) -> None:
        """Measures whether each loss that returns one value per call averages its rows or
        sums them ([Note: decomposable losses] in layer_losses.py)."""
        preds = tree.flatten(y_pred)
        masks = [get_keras_mask(t) for t in preds]

        def values(rows: np.ndarray) -> list[float]:
            # in float32: whether a loss sums or averages its rows does not depend on the
            # precision, and a half-precision sum of 3 rows misses a + b by more than the
            # comparison's 1e-4 (a mixed_bfloat16 or quantized model's outputs)
            take = _widened(_take(rows))
            parts = []
            for p, m in zip(preds, masks):
                q = take(p)
                if m is not None:
                    set_keras_mask(q, take(m))
                parts.append(q)
            rec = self.call(tree.map_structure(take, y), tree.pack_sequence_as(y_pred, parts),
                            None if sample_weight is None else tree.map_structure(take, sample_weight),
                            None if inputs is None else [_take(rows)(v) for v in inputs])
            return [float(n) for n in rec.numerators]

        n = int(np.shape(preds[0])[0]) if preds else 1  # the rows (y may be None: a
        # model's own compute_loss that needs no targets)
        if self.custom is not None:  # its own errors (a value per sample, say) surface here
            values(np.arange(3, dtype=np.int64) % max(n, 1))
        rules = layer_losses.classify(values, n)
        for j, t in enumerate(self.terms):
            if t.kind != SCALAR:
                continue
            rule = rules[j] if rules is not None else None
            if rule is None and self.custom is not None:
                raise StepError(
                    f"{rank_tag} A model's own compute_loss() runs once per microbatch, so "
                    f"with several microbatches or replicas its value must be a sum or a mean "
                    f"over the batch's samples (Keras's losses are means). Received: a "
                    f"compute_loss whose value on a batch is neither (measured on 3 samples "
                    f"and their parts). Use microbatches=1 with one replica, or return a mean "
                    f"over the samples.")
            if rule is None:
                raise StepError(
                    f"{rank_tag} A loss that returns one value per batch must be a sum or a "
                    f"mean over its samples for tfsmp to split the batch into microbatches. "
                    f"Received: loss '{t.name}', whose value is neither. Return one value per "
                    f"sample (as Keras's losses do), or use microbatches=1 with one replica.")
            t.mean_rule = rule == layer_losses.MEAN

    # -- per step, on the host -----------------------------------------------------------------

    def constants(self, *, rows: int, rows_mb: int, sample_weight: Any, scale: float, parts: int
                  ) -> np.ndarray:
        """The constants vector of one microbatch (`Consts`); ``sample_weight`` is the global
        batch's, from which every ``weights`` term's normalizer comes."""
        k = len(self.terms)
        out = np.zeros(Consts.TERMS + 2 * k, np.float32)
        out[Consts.ROWS], out[Consts.ROWS_MB], out[Consts.SCALE] = rows, rows_mb, scale
        out[Consts.EXACT_MASK] = 1.0 if parts == 1 else 0.0
        for j, t in enumerate(self.terms):
            if t.kind == WEIGHTS and sample_weight is not None:
                sw = _resolve(t.path, sample_weight) if tree.is_nested(sample_weight) else sample_weight
                total = float(np.sum(np.asarray(sw, dtype=np.float64)))
                out[Consts.TERMS + j] = 1.0 / total if total else 0.0
            out[Consts.TERMS + k + j] = 1.0 if t.mean_rule else 0.0
        return out

    def partial(self, records: list[tuple[np.ndarray, np.ndarray, int]], rows: int
                ) -> np.ndarray:
        """One rank's ``[numerators..., normalizers...]`` summed over its microbatches, from
        each microbatch's (N per term, D per term, rows); a ``scalar`` term's N is weighted by
        its rule here (its normalizer stays 0)."""
        k = len(self.terms)
        out = np.zeros(2 * k, np.float64)
        for n, d, rows_mb in records:
            for j, t in enumerate(self.terms):
                if t.kind == SCALAR:
                    out[j] += float(n[j]) * (rows_mb / rows if t.mean_rule else 1.0)
                else:
                    out[j] += float(n[j])
                    out[k + j] += float(d[j])
        return out

    def values(self, summed: np.ndarray) -> list[float]:
        """Each term's batch value from `partial`'s sums over every part of the batch."""
        k = len(self.terms)
        out = []
        for j, t in enumerate(self.terms):
            if t.kind in (SUM, SCALAR):
                out.append(float(summed[j]))
            else:
                d = float(summed[k + j])
                out.append(float(summed[j]) / d if d else 0.0)
        return out

    def total(self, values: list[float]) -> float:
        """The compiled loss of the batch: the terms' values, weighted."""
        return float(sum(t.weight * v for t, v in zip(self.terms, values)))

    def deferred_factor(self, summed: np.ndarray, parts: int) -> float:
        """What the accumulated gradients are multiplied by before the optimizer step: 1, or
        1 / the batch's count of unmasked values for a mask term deferred in a step of several
        parts (with one part it was exact in place, `Consts.EXACT_MASK`)."""
        if not self.deferred or parts <= 1:
            return 1.0
        k = len(self.terms)
        d = float(summed[k])
        return 1.0 / d if d else 0.0


def _spec(x: Any) -> Any:
    if x is None:
        return None
    t = tf.convert_to_tensor(x)
    return tf.TensorSpec([None, *t.shape[1:]], t.dtype)


def _take(rows: np.ndarray) -> Any:
    def take(x: Any) -> Any:
        return None if x is None else tf.gather(tf.convert_to_tensor(x), rows)
    return take


def _widened(take: Any) -> Any:
    """``take``, with half-precision floats (float16, bfloat16) cast to float32."""
    def widened(x: Any) -> Any:
        t = take(x)
        if t is not None and t.dtype in (tf.float16, tf.bfloat16):
            return tf.cast(t, tf.float32)
        return t
    return widened


def _resolve(path: tuple[Any, ...], obj: Any) -> Any:
    for p in path:
        obj = obj[p]
    return obj
