"""Keras semantics under a pipeline: plain Keras against tfsmp for every feature of the catalogue.

Each feature follows Keras's own documentation of it (the docstring of the Keras class or guide
it comes from is named in ``doc``). A case builds the model twice from one seed, trains plain
Keras in this process and `tfsmp.DistributedModel` across 2 ranks with the stage cut forced
through the feature (``cut``: the last layer of stage 0), and compares `History`, every weight
and `evaluate`. Variants: ``m1``/``m4`` (microbatches) under ``interleaved``, ``zb1``/``zb4``
under ``zb-h1``. Used by tests/mpi/test_keras_semantics.py; the feature list is
docs/keras_semantics.md's (tests/pure/test_keras_semantics_doc.py keeps them in agreement).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
from caseutil import reinit
from keras import layers as L
from keras import ops

import tfsmp
from tfsmp.errors import StepError

RTOL, ATOL = 1e-5, 1e-6
VARIANTS = {"m1": (1, "interleaved"), "m4": (4, "interleaved"),
            "zb1": (1, "zb-h1"), "zb4": (4, "zb-h1")}


@dataclass
class Feature:
    build: Callable[[], keras.Model]
    compile: Callable[[], dict[str, Any]]     # fresh loss, optimizer and metric objects
    data: Callable[[], tuple[Any, Any, Any]]  # x, y, sample_weight
    cut: str                                  # the last layer of stage 0
    doc: str                                  # the Keras documentation the case follows
    fit: dict[str, Any] = field(default_factory=lambda: {"batch_size": 16, "epochs": 2})


FEATURES: dict[str, Feature] = {}


def feature(name: str, **kw: Any) -> Callable[[Callable[[], keras.Model]], Callable[[], keras.Model]]:
    def register(build: Callable[[], keras.Model]) -> Callable[[], keras.Model]:
        FEATURES[name] = Feature(build=build, **kw)
        return build
    return register


# -- data and compile settings -----------------------------------------------------------------

def _regression(n: int = 32, d: int = 8, k: int = 3, weights: bool = False) -> tuple[Any, Any, Any]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = (x[:, :k] * 2 + 0.1 * rng.normal(size=(n, k))).astype(np.float32)
    return x, y, (rng.uniform(0.1, 2.0, size=(n,)).astype(np.float32) if weights else None)


def _tokens(n: int = 32, length: int = 6, vocab: int = 20, pad: bool = True) -> np.ndarray:
    rng = np.random.default_rng(11)
    x = rng.integers(1, vocab, size=(n, length))
    if pad:  # every row its own amount of padding: microbatches mask different counts
        for i in range(n):
            x[i, length - (i % length):] = 0
    return x.astype(np.int32)


def _sequence_targets(x: np.ndarray, vocab: int = 20) -> np.ndarray:
    return ((x * 7 + 3) % vocab).astype(np.int32)


def _sgd(**kw: Any) -> Any:
    return keras.optimizers.SGD(0.05, **kw)


def _mse(**kw: Any) -> dict[str, Any]:
    return {"optimizer": _sgd(), "loss": keras.losses.MeanSquaredError(**kw), "metrics": ["mae"]}


def _mlp(first: dict[str, Any] | None = None, last: dict[str, Any] | None = None,
         extra: Callable[[Any], Any] | None = None, seed: int = 3) -> keras.Model:
    keras.utils.set_random_seed(seed)
    x = keras.Input((8,), name="x")
    h = L.Dense(16, activation="tanh", name="d0", **(first or {}))(x)
    if extra is not None:
        h = extra(h)
    h = L.Dense(16, activation="tanh", name="d1")(h)
    return keras.Model(x, L.Dense(3, name="out", **(last or {}))(h))


# -- 1. layer losses ---------------------------------------------------------------------------

@feature("kernel_regularizer", compile=_mse, data=_regression, cut="d0",
         doc="keras.regularizers.L2 (layer weight regularizers guide)")
def _kernel_regularizer() -> keras.Model:
    return _mlp(first={"kernel_regularizer": keras.regularizers.L2(0.05)})


@feature("bias_regularizer_last_stage", compile=_mse, data=_regression, cut="d1",
         doc="keras.regularizers.L1 on bias_regularizer")
def _bias_regularizer() -> keras.Model:
    return _mlp(last={"bias_regularizer": keras.regularizers.L1(0.05),
                      "kernel_regularizer": keras.regularizers.L1L2(0.01, 0.01)})


@feature("activity_regularizer", compile=_mse, data=_regression, cut="d0",
         doc="Layer(activity_regularizer=...), Keras 3 divides it by the batch size")
def _activity_regularizer() -> keras.Model:
    return _mlp(first={"activity_regularizer": keras.regularizers.L2(0.05)})


@feature("activity_regularizer_last_stage", compile=_mse, data=_regression, cut="d1",
         doc="Layer(activity_regularizer=...) on the output layer")
def _activity_regularizer_last() -> keras.Model:
    return _mlp(last={"activity_regularizer": keras.regularizers.L1(0.02)})


class SumLoss(L.Layer):
    """The `Layer.add_loss` docstring's example: ``self.add_loss(ops.sum(x))`` (scaled)."""

    def call(self, x: Any) -> Any:
        self.add_loss(1e-3 * ops.sum(x))
        return x


class ActivityRegularizationLayer(L.Layer):
    """The subclassing guide's layer: ``self.add_loss(self.rate * ops.mean(inputs))``."""

    def __init__(self, rate: float = 1e-2, **kw: Any) -> None:
        super().__init__(**kw)
        self.rate = rate

    def call(self, inputs: Any) -> Any:
        self.add_loss(self.rate * ops.mean(inputs))
        return inputs


class WeightPenalty(L.Layer):
    """A loss added in call() that does not depend on the batch (a penalty on a weight)."""

    def build(self, shape: Any) -> None:
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones", name="w")

    def call(self, x: Any) -> Any:
        self.add_loss(1e-2 * ops.sum(ops.square(self.w)))
        return x * self.w


@feature("add_loss_sum", compile=_mse, data=_regression, cut="sum_loss",
         doc="Layer.add_loss docstring: self.add_loss(ops.sum(x))")
def _add_loss_sum() -> keras.Model:
    return _mlp(extra=lambda h: SumLoss(name="sum_loss")(h))


@feature("add_loss_mean", compile=_mse, data=_regression, cut="d0",
         doc="Making new layers via subclassing: ActivityRegularizationLayer (ops.mean)")
def _add_loss_mean() -> keras.Model:
    return _mlp(extra=lambda h: ActivityRegularizationLayer(name="act_reg")(h))


@feature("add_loss_weight_penalty", compile=_mse, data=_regression, cut="d0",
         doc="add_loss in call() of a loss that does not depend on the batch")
def _add_loss_weight() -> keras.Model:
    return _mlp(extra=lambda h: WeightPenalty(name="penalty")(h))


def _optimizer_only() -> dict[str, Any]:
    return {"optimizer": _sgd()}


@feature("add_loss_only", compile=_optimizer_only, data=_regression, cut="d0",
         doc="compile(optimizer=...) without a loss: trained on the layers' losses alone "
             "(trainer_test.py's test_internal_only_loss)")
def _add_loss_only() -> keras.Model:
    return _mlp(extra=lambda h: ActivityRegularizationLayer(rate=0.5, name="act_reg")(h),
                last={"kernel_regularizer": keras.regularizers.L2(0.01)})


# -- 2. masks ----------------------------------------------------------------------------------

def _masked_sequence(cut_before_embedding: bool, regularizer: Any = None) -> keras.Model:
    keras.utils.set_random_seed(5)
    x = keras.Input((6,), dtype="int32", name="tokens")
    h = L.Identity(name="ids")(x) if cut_before_embedding else x
    h = L.Embedding(20, 8, mask_zero=True, name="emb")(h)
    h = L.LSTM(8, return_sequences=True, name="lstm")(h)
    return keras.Model(x, L.Dense(20, name="logits", kernel_regularizer=regularizer)(h))


def _token_compile() -> dict[str, Any]:
    return {"optimizer": _sgd(),
            "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "metrics": ["accuracy"]}


def _token_data() -> tuple[Any, Any, Any]:
    x = _tokens()
    return x, _sequence_targets(x), None


@feature("output_mask_loss_metrics", compile=_token_compile, data=_token_data, cut="ids",
         doc="Masking and padding guide: Embedding(mask_zero=True), the mask reaches the loss "
             "and the metrics")
def _output_mask() -> keras.Model:
    return _masked_sequence(cut_before_embedding=True)


@feature("mask_across_cut", compile=_token_compile, data=_token_data, cut="emb",
         doc="Masking and padding guide: a mask produced on one stage, consumed on the next")
def _mask_across() -> keras.Model:
    return _masked_sequence(cut_before_embedding=False)


@feature("masked_loss_last_batch_of_one", compile=_token_compile, cut="ids",
         data=lambda: (lambda x: (x, _sequence_targets(x), None))(_tokens(n=33)),
         doc="masked per-token loss with an epoch's last batch of one row (exact in place)")
def _masked_last_batch() -> keras.Model:
    return _masked_sequence(cut_before_embedding=True)


@feature("mask_to_attention", data=lambda: (_tokens(), np.arange(32) % 3, None),
         compile=lambda: {"optimizer": keras.optimizers.Adam(0.01),
                          "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
         cut="emb", doc="MultiHeadAttention reads the query/key masks (attention_mask guide)")
def _mask_attention() -> keras.Model:
    keras.utils.set_random_seed(6)
    x = keras.Input((6,), dtype="int32", name="tokens")
    h = L.Embedding(20, 8, mask_zero=True, name="emb")(x)
    h = L.MultiHeadAttention(2, 4, name="mha")(h, h)
    h = L.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(x, L.Dense(3, name="out")(h))


# -- 3. reductions -----------------------------------------------------------------------------

@feature("mean_with_sample_weight", data=lambda: _regression(weights=True), cut="d0",
         compile=lambda: _mse(reduction="mean_with_sample_weight"),
         doc="keras.losses.Loss(reduction='mean_with_sample_weight')")
def _mean_sw() -> keras.Model:
    return _mlp()


@feature("sum_reduction", data=lambda: _regression(weights=True), cut="d0",
         compile=lambda: _mse(reduction="sum"), doc="keras.losses.Loss(reduction='sum')")
def _sum_reduction() -> keras.Model:
    return _mlp()


def _temporal_data() -> tuple[Any, Any, Any]:
    x = _tokens(pad=False)
    rng = np.random.default_rng(3)
    return x, _sequence_targets(x), rng.uniform(0.0, 2.0, size=x.shape).astype(np.float32)


@feature("temporal_sample_weight", data=_temporal_data, cut="emb",
         compile=lambda: {"optimizer": _sgd(),
                          "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          "weighted_metrics": ["accuracy"]},
         doc="fit(sample_weight=) of shape (samples, timesteps)")
def _temporal() -> keras.Model:
    keras.utils.set_random_seed(8)
    x = keras.Input((6,), dtype="int32", name="tokens")
    h = L.Embedding(20, 8, name="emb")(x)
    return keras.Model(x, L.Dense(20, name="logits")(L.Dense(8, activation="relu", name="h")(h)))


def _two_outputs_data() -> tuple[Any, Any, Any]:
    x, y, w = _regression(weights=True)
    return x, {"a": y, "b": (y[:, 0] > 0).astype(np.int32)}, w


@feature("loss_weights_two_outputs", data=_two_outputs_data, cut="d0",
         compile=lambda: {"optimizer": _sgd(),
                          "loss": {"a": keras.losses.MeanSquaredError(),
                                   "b": keras.losses.SparseCategoricalCrossentropy(
                                       from_logits=True, reduction="mean_with_sample_weight")},
                          "loss_weights": {"a": 0.3, "b": 2.0}, "metrics": {"b": ["accuracy"]}},
         doc="compile(loss={...}, loss_weights={...}) for a multi-output model")
def _two_outputs() -> keras.Model:
    keras.utils.set_random_seed(4)
    x = keras.Input((8,), name="x")
    h = L.Dense(16, activation="tanh", name="d0")(x)
    h = L.Dense(16, activation="tanh", name="d1")(h)
    return keras.Model(x, {"a": L.Dense(3, name="a")(h), "b": L.Dense(2, name="b")(h)})


def _scalar_mse(y_true: Any, y_pred: Any) -> Any:
    return ops.mean(ops.square(y_true - y_pred))  # one value per batch, as many tutorials write


@feature("loss_function_returning_a_scalar", data=_regression, cut="d0",
         compile=lambda: {"optimizer": _sgd(), "loss": _scalar_mse},
         doc="compile(loss=<function>) whose value is a mean over the batch")
def _scalar_loss() -> keras.Model:
    return _mlp()


# -- 4. sparse gradients -----------------------------------------------------------------------

class TokenAndPositionEmbedding(L.Layer):
    """keras-io's text_classification_with_transformer layer, verbatim but for the imports."""

    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.token_emb = L.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = L.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x: Any) -> Any:
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


@feature("position_embedding_adam", data=lambda: (_tokens(pad=False), np.arange(32) % 2, None),
         compile=lambda: {"optimizer": keras.optimizers.Adam(0.01),
                          "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
         cut="tpe", doc="keras-io text classification with Transformer: TokenAndPositionEmbedding")
def _position_embedding() -> keras.Model:
    keras.utils.set_random_seed(9)
    x = keras.Input((6,), dtype="int32", name="tokens")
    h = TokenAndPositionEmbedding(6, 20, 8, name="tpe")(x)
    h = L.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(x, L.Dense(2, name="out")(h))


# -- 5. optimizer options ----------------------------------------------------------------------

def _opt(make: Callable[[], Any]) -> Callable[[], dict[str, Any]]:
    return lambda: {"optimizer": make(), "loss": keras.losses.MeanSquaredError()}


for _name, _make, _doc in [
    ("global_clipnorm", lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.5),
     "Optimizer(global_clipnorm=...): clip by the norm of all gradients"),
    ("clipnorm", lambda: _sgd(clipnorm=0.5), "Optimizer(clipnorm=...)"),
    ("clipvalue", lambda: _sgd(clipvalue=0.1), "Optimizer(clipvalue=...)"),
    ("ema", lambda: keras.optimizers.SGD(0.05, use_ema=True, ema_momentum=0.9),
     "Optimizer(use_ema=True): EMA weights swapped in at the end of fit"),
    ("ema_overwrite_frequency", lambda: keras.optimizers.SGD(
        0.05, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=3),
     "Optimizer(use_ema=True, ema_overwrite_frequency=3)"),
    ("loss_scale_factor", lambda: _sgd(loss_scale_factor=64.0), "Optimizer(loss_scale_factor=...)"),
    ("gradient_accumulation_steps", lambda: _sgd(gradient_accumulation_steps=2),
     "Optimizer(gradient_accumulation_steps=2)"),
    ("learning_rate_schedule", lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5)),
     "keras.optimizers.schedules.ExponentialDecay"),
]:
    FEATURES[_name] = Feature(build=lambda: _mlp(), compile=_opt(_make), data=_regression,
                              cut="d0", doc=_doc)


def _adamw_excluding_bias() -> dict[str, Any]:
    opt = keras.optimizers.AdamW(0.01, weight_decay=0.1)
    opt.exclude_from_weight_decay(var_names=["bias"])
    return {"optimizer": opt, "loss": keras.losses.MeanSquaredError()}


FEATURES["weight_decay_exclusions"] = Feature(
    build=lambda: _mlp(), compile=_adamw_excluding_bias, data=_regression, cut="d0",
    doc="AdamW(weight_decay=...) with exclude_from_weight_decay(var_names=['bias'])")


# -- 7., 8. data: steps_per_epoch, batch sizes --------------------------------------------------

FEATURES["steps_per_epoch_arrays"] = Feature(
    build=lambda: _mlp(), compile=_mse, data=_regression, cut="d0",
    fit={"batch_size": 8, "epochs": 3, "steps_per_epoch": 3},
    doc="fit(steps_per_epoch=) on arrays: the next epoch goes on where the last stopped")
FEATURES["uneven_batches"] = Feature(
    build=lambda: _mlp(), compile=_mse, data=lambda: _regression(weights=True), cut="d0",
    fit={"batch_size": 10, "epochs": 2},
    doc="fit(batch_size=10) on 32 samples: microbatches of unequal sizes, a last batch of 2")
FEATURES["batch_smaller_than_microbatches"] = Feature(
    build=lambda: _mlp(), compile=_mse, data=lambda: _regression(n=9), cut="d0",
    fit={"batch_size": 3, "epochs": 1},
    doc="fit(batch_size=3) with microbatches=4: fewer rows than microbatches")


# -- running one feature -------------------------------------------------------------------------

def _plan_file(build: Callable[[], keras.Model], cut: str, x: Any, rank: int) -> str:
    """A stage plan with every layer up to ``cut`` (in call order) on stage 0."""
    from tfsmp.graph.tracer import trace
    from tfsmp.partitioning.plan import StagePlan

    traced = trace(build(), sample_input=x[:2])
    names = [c.layer_name for c in traced.calls]
    last = max(i for i, n in enumerate(names) if n == cut)
    stage_of = {n: 0 for n in names[:last + 1]}
    stage_of.update({n: 1 for n in names[last + 1:] if n not in stage_of})
    plan = StagePlan.from_assignment(traced.graph, stage_of, 2)
    fd, path = tempfile.mkstemp(prefix=f"tfsmp-conformance-{rank}-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(plan.to_json())
    atexit.register(_remove, path)  # the run reads it while it trains: gone when the rank ends
    return path


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def _close(a: Any, b: Any) -> bool:
    return bool(np.allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=RTOL,
                            atol=ATOL))


def _fit_kwargs(feat: Feature, sw: Any) -> dict[str, Any]:
    return {"shuffle": False, "verbose": 0, "sample_weight": sw, **feat.fit}


def reference(name: str) -> dict[str, Any]:
    """Plain Keras: history, weights and evaluate of one feature."""
    feat = FEATURES[name]
    x, y, sw = feat.data()
    model = feat.build()
    model.compile(**feat.compile(), run_eagerly=True)  # no traced train function: 3x quicker
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = model.fit(x, y, **_fit_kwargs(feat, sw)).history
    evaluation = model.evaluate(x, y, sample_weight=sw, batch_size=feat.fit["batch_size"],
                                verbose=0, return_dict=True)
    return {"history": history, "weights": model.get_weights(), "evaluate": evaluation}


def pipelined(name: str, variant: str, rank: int) -> dict[str, Any]:
    feat = FEATURES[name]
    m, pipeline = VARIANTS[variant]
    x, y, sw = feat.data()
    plan = _plan_file(feat.build, feat.cut, x, rank)
    # a fault in one rank's step leaves its peer waiting: the watchdog ends the launch soon
    reinit({"partitions": 2, "stall_timeout": 120}, microbatches=m, pipeline=pipeline,
           partition_file=plan)
    dm = tfsmp.DistributedModel(feat.build())
    dm.compile(**feat.compile())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = dm.fit(x, y, **_fit_kwargs(feat, sw)).history
    evaluation = dm.evaluate(x, y, sample_weight=sw, batch_size=feat.fit["batch_size"],
                             verbose=0, return_dict=True)
    return {"history": history, "weights": dm.get_weights(), "evaluate": evaluation}


def compare(name: str, variant: str, rank: int, ref: dict[str, Any]) -> dict[str, Any]:
    """{"ok", "history", "weights", "evaluate", "detail"} of one feature and variant."""
    try:
        got = pipelined(name, variant, rank)
    except (StepError, ValueError, TypeError) as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    hist = {k: _close(got["history"].get(k, np.nan), v) for k, v in ref["history"].items()}
    keys_same = sorted(got["history"]) == sorted(ref["history"])
    weights = [_close(a, b) for a, b in zip(got["weights"], ref["weights"])]
    evals = {k: _close(got["evaluate"].get(k, np.nan), v) for k, v in ref["evaluate"].items()}
    worst = max((float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                 for a, b in zip(got["weights"], ref["weights"])), default=0.0)
    ok = keys_same and all(hist.values()) and all(weights) and all(evals.values()) and \
        len(got["weights"]) == len(ref["weights"])
    out: dict[str, Any] = {"ok": ok, "max_weight_diff": worst}
    if not ok:
        out["detail"] = {"history": {k: [got["history"].get(k), ref["history"][k]] for k in ref["history"]},
                         "keys": [sorted(got["history"]), sorted(ref["history"])],
                         "evaluate": {k: [got["evaluate"].get(k), v] for k, v in ref["evaluate"].items()},
                         "weights_ok": weights}
    return out


def run(ctx: Any, names: list[str], variants: list[str]) -> dict[str, Any]:
    out = {}
    for name in names:
        ref = reference(name)
        for variant in variants:
            out[f"{name}@{variant}"] = compare(name, variant, ctx.rank, ref)
    return json.loads(json.dumps(out, default=float))


# -- what a pipeline refuses, before any work ----------------------------------------------------

class OwnTrainStep(keras.Model):
    """The "Customizing what happens in fit()" guide's model: its own train_step."""

    def train_step(self, data: Any) -> Any:
        return super().train_step(data)


class OwnTestStep(keras.Model):
    def test_step(self, data: Any) -> Any:
        return super().test_step(data)


class OwnComputeLoss(keras.Model):
    """`Trainer.compute_loss`'s docstring: a model that computes its own loss."""

    def compute_loss(self, x: Any = None, y: Any = None, y_pred: Any = None,
                     sample_weight: Any = None, training: bool = True) -> Any:
        return ops.mean((y_pred - y) ** 2)


def _functional_as(cls: type) -> keras.Model:
    keras.utils.set_random_seed(3)
    x = keras.Input((8,), name="x")
    h = L.Dense(16, activation="tanh", name="d0")(x)
    return cls(x, L.Dense(3, name="out")(h))


@feature("own_compute_loss", compile=_mse, data=_regression, cut="d0",
         doc="`Trainer.compute_loss` docstring: a model that computes its own loss")
def _own_compute_loss() -> keras.Model:
    return _functional_as(OwnComputeLoss)


def _squared_mean(y_true: Any, y_pred: Any) -> Any:
    return ops.square(ops.mean(y_pred - y_true))  # neither a sum nor a mean over the samples


class Counter(L.Layer):
    """A layer that keeps its own count of calls (state updated inside call)."""

    def build(self, shape: Any) -> None:
        self.count = self.add_weight(shape=(), initializer="zeros", trainable=False, name="count")

    def call(self, x: Any) -> Any:
        self.count.assign_add(1.0)
        return x


def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except (StepError, ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _refused(build: Callable[[], keras.Model], compile_kwargs: dict[str, Any], m: int = 4,
             entry: str = "fit", data: Callable[[], tuple[Any, Any, Any]] = _regression,
             **config: Any) -> str:
    x, y, sw = data()
    reinit({"partitions": 2, "stall_timeout": 120}, microbatches=m, **config)
    dm = tfsmp.DistributedModel(build())
    dm.compile(**compile_kwargs)
    if entry == "fit":
        return _error(lambda: dm.fit(x, y, sample_weight=sw, batch_size=16, epochs=1, verbose=0))
    return _error(lambda: dm.evaluate(x, y, batch_size=16, verbose=0))


def case_refusals(ctx: Any) -> dict[str, str]:
    masked_and_l2 = lambda: _masked_sequence(True, keras.regularizers.L2(0.01))  # noqa: E731
    return {
        "train_step": _refused(lambda: _functional_as(OwnTrainStep), _mse()),
        "test_step": _refused(lambda: _functional_as(OwnTestStep), _mse(), entry="evaluate"),
        "reduction_none": _refused(_mlp, {"optimizer": _sgd(),
                                          "loss": keras.losses.MeanSquaredError(reduction=None)}),
        "scalar_neither": _refused(_mlp, {"optimizer": _sgd(), "loss": _squared_mean}),
        "masked_with_layer_loss": _refused(masked_and_l2, _token_compile(), data=_token_data),
        "global_clipnorm_xla": _refused(_mlp, {"optimizer": keras.optimizers.Adam(
            global_clipnorm=1.0), "loss": "mse"}, xla=True),
    }


def case_scalar_neither_at_one_part(ctx: Any) -> dict[str, Any]:
    """A loss that is neither a sum nor a mean trains exactly at m=1 with one replica."""
    feat = Feature(build=_mlp, compile=lambda: {"optimizer": _sgd(), "loss": _squared_mean},
                   data=_regression, cut="d0", doc="")
    FEATURES["_scalar_neither"] = feat
    try:
        return compare("_scalar_neither", "m1", ctx.rank, reference("_scalar_neither"))
    finally:
        del FEATURES["_scalar_neither"]


def case_state_warning(ctx: Any) -> list[str]:
    """A layer that updates its own state in call() warns once that it does so per microbatch."""
    x, y, _ = _regression()
    reinit({"partitions": 2}, microbatches=4)
    dm = tfsmp.DistributedModel(_mlp(extra=lambda h: Counter(name="counter")(h)))
    dm.compile(**_mse())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dm.fit(x, y, batch_size=16, epochs=2, verbose=0)
    return [str(w.message) for w in seen if "once per microbatch" in str(w.message)]


# -- the test's selections -----------------------------------------------------------------------

# features whose behaviour depends on the schedule (zb-h1 splits the backward) or on the step
# having one part: run at every variant by default, the others at m4 only
EVERY_VARIANT = ("kernel_regularizer", "add_loss_mean", "output_mask_loss_metrics",
                 "mask_to_attention", "position_embedding_adam", "global_clipnorm",
                 "loss_weights_two_outputs", "uneven_batches")


def case_default(ctx: Any) -> dict[str, Any]:
    out = run(ctx, [n for n in FEATURES if n not in EVERY_VARIANT], ["m4"])
    out.update(run(ctx, list(EVERY_VARIANT), list(VARIANTS)))
    return out


def case_full(ctx: Any) -> dict[str, Any]:
    return run(ctx, list(FEATURES), list(VARIANTS))
