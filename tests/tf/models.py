"""A zoo of small Keras models, one of each kind a user writes, with seeded weights and data.

Example::

    model = build_cnn(seed=1)              # same weights on every call with the same seed
    x, y = data_cnn(64, seed=0)            # inputs as model(x) takes them, targets shaped like y
    for name, (build, data) in ZOO.items(): ...

Every initializer is seeded from ``seed``, so two builds (eager, or under
`tfsmp.graph.deferred_scope` and then materialized in any order) hold identical weights. Targets
are float arrays shaped like the outputs (use a mean-squared-error loss). Layer names are left to
Keras (unique per process), except where a test needs to refer to a layer.

Tests in ``tests/tf`` ``import models`` (pytest puts their directory on ``sys.path``); elsewhere,
``from tests.tf import models`` with the repository root on ``sys.path``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
from keras import layers, ops

__all__ = [
    "ZOO",
    "SubclassedNet",
    "build_cnn",
    "build_mlp",
    "build_multi_io",
    "build_nested",
    "build_sequential",
    "build_shared",
    "build_subclassed",
    "build_transformer",
    "data_cnn",
    "data_mlp",
    "data_multi_io",
    "data_nested",
    "data_sequential",
    "data_shared",
    "data_subclassed",
    "data_transformer",
]


class _Seeds:
    """Hands out initializers seeded ``seed * 1000 + i`` for i = 0, 1, 2 …"""

    def __init__(self, seed: int) -> None:
        self.seed, self.i = seed, 0

    def __call__(self, kind: str = "glorot") -> keras.initializers.Initializer:
        self.i += 1
        s = self.seed * 1000 + self.i
        if kind == "normal":
            return keras.initializers.RandomNormal(stddev=0.1, seed=s)
        return keras.initializers.GlorotUniform(seed=s)

    def dense(self, units: int, **kw: Any) -> layers.Dense:
        return layers.Dense(units, kernel_initializer=self(), bias_initializer=self("normal"), **kw)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _target(n: int, shape: tuple[int, ...], seed: int) -> np.ndarray:
    return _rng(seed + 7).standard_normal((n, *shape)).astype("float32")


# -- MLP ---------------------------------------------------------------------------------------

def build_mlp(seed: int = 0, width: int = 32) -> keras.Model:
    """Input(16) -> Dense(width, relu) -> Dense(width, relu) -> Dense(4): a chain of 3 layers."""
    s = _Seeds(seed)
    x = keras.Input((16,), name="x")
    h = s.dense(width, activation="relu")(x)
    h = s.dense(width, activation="relu")(h)
    return keras.Model(x, s.dense(4)(h), name="mlp")


def data_mlp(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    return _rng(seed).standard_normal((n, 16)).astype("float32"), _target(n, (4,), seed)


# -- residual CNN ------------------------------------------------------------------------------

def build_cnn(seed: int = 0) -> keras.Model:
    """Conv blocks with a skip connection (Add), batch norm, depthwise/separable convs, pooling."""
    s = _Seeds(seed)
    x = keras.Input((12, 12, 3), name="image")
    c1 = layers.Conv2D(8, 3, padding="same", activation="relu", kernel_initializer=s(),
                       bias_initializer=s("normal"))(x)
    c2 = layers.Conv2D(8, 3, padding="same", kernel_initializer=s())(c1)
    c2 = layers.BatchNormalization(gamma_initializer=s("normal"))(c2)
    h = layers.ReLU()(layers.Add()([c1, c2]))          # the skip connection
    h = layers.MaxPooling2D(2)(h)
    h = layers.DepthwiseConv2D(3, padding="same", depthwise_initializer=s())(h)
    h = layers.SeparableConv2D(12, 3, depthwise_initializer=s(), pointwise_initializer=s())(h)
    h = layers.GlobalAveragePooling2D()(h)
    return keras.Model(x, s.dense(5)(h), name="cnn")


def data_cnn(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    return _rng(seed).standard_normal((n, 12, 12, 3)).astype("float32"), _target(n, (5,), seed)


# -- multiple inputs and outputs ----------------------------------------------------------------

def build_multi_io(seed: int = 0) -> keras.Model:
    """Inputs {"a": (8,), "b": (4,)} -> outputs {"main": (3,), "aux": (2,)}."""
    s = _Seeds(seed)
    a = keras.Input((8,), name="a")
    b = keras.Input((4,), name="b")
    ha = s.dense(16, activation="tanh")(a)
    hb = s.dense(16, activation="tanh")(b)
    h = layers.Concatenate()([ha, hb])
    main = s.dense(3, name="main")(s.dense(16, activation="relu")(h))
    aux = s.dense(2, name="aux")(layers.Multiply()([ha, hb]))
    return keras.Model({"a": a, "b": b}, {"main": main, "aux": aux}, name="multi_io")


def data_multi_io(n: int, seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    r = _rng(seed)
    x = {"a": r.standard_normal((n, 8)).astype("float32"),
         "b": r.standard_normal((n, 4)).astype("float32")}
    return x, {"main": _target(n, (3,), seed), "aux": _target(n, (2,), seed + 1)}


# -- a layer called at two places ----------------------------------------------------------------

def build_shared(seed: int = 0) -> keras.Model:
    """x -> shared -> mid -> shared -> head: the layer graph has the cycle shared <-> mid."""
    s = _Seeds(seed)
    x = keras.Input((8,), name="x")
    shared = s.dense(8, activation="tanh", name="shared")
    mid = s.dense(8, activation="relu", name="mid")
    h = shared(mid(shared(x)))
    return keras.Model(x, s.dense(3, name="head")(h), name="shared_net")


def data_shared(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    return _rng(seed).standard_normal((n, 8)).astype("float32"), _target(n, (3,), seed)


# -- Transformer encoder block ---------------------------------------------------------------

def build_transformer(seed: int = 0, vocab: int = 50, seq: int = 10, dim: int = 16,
                      heads: int = 2) -> keras.Model:
    """Token ids (seq,) -> Embedding -> one post-norm encoder block -> mean pool -> Dense(3)."""
    s = _Seeds(seed)
    tokens = keras.Input((seq,), dtype="int32", name="tokens")
    h = layers.Embedding(vocab, dim, embeddings_initializer=s("normal"))(tokens)
    att = layers.MultiHeadAttention(heads, dim // heads, kernel_initializer=s(),
                                    name="attention")(h, h)
    h = layers.LayerNormalization(gamma_initializer=s("normal"))(layers.Add()([h, att]))
    f = s.dense(2 * dim, activation="gelu")(h)
    f = s.dense(dim)(f)
    h = layers.LayerNormalization()(layers.Add()([h, f]))
    h = layers.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, s.dense(3)(h), name="transformer")


def data_transformer(n: int, seed: int = 0, vocab: int = 50,
                     seq: int = 10) -> tuple[np.ndarray, np.ndarray]:
    return _rng(seed).integers(0, vocab, (n, seq)).astype("int32"), _target(n, (3,), seed)


# -- nested models -------------------------------------------------------------------------------

def build_nested(seed: int = 0) -> keras.Model:
    """A Functional encoder (itself nesting a Functional block) applied to two inputs (siamese),
    then a nested Sequential head: flattened, each encoder layer has two calls."""
    s = _Seeds(seed)
    bx = keras.Input((16,))
    block = keras.Model(bx, s.dense(16, activation="relu")(bx), name="block")
    ex = keras.Input((8,))
    e = block(s.dense(16, activation="relu")(ex))
    encoder = keras.Model(ex, s.dense(8)(e), name="encoder")
    head = keras.Sequential([keras.Input((16,)), s.dense(8, activation="relu"), s.dense(2)],
                            name="head")
    x1 = keras.Input((8,), name="left")
    x2 = keras.Input((8,), name="right")
    joined = layers.Concatenate()([encoder(x1), encoder(x2)])
    return keras.Model([x1, x2], head(joined), name="nested")


def data_nested(n: int, seed: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    r = _rng(seed)
    return ([r.standard_normal((n, 8)).astype("float32"),
             r.standard_normal((n, 8)).astype("float32")], _target(n, (2,), seed))


# -- Sequential ----------------------------------------------------------------------------------

def build_sequential(seed: int = 0, built: bool = True) -> keras.Sequential:
    """Dense(24, relu) -> Dropout -> Dense(24, relu) -> Dense(4); ``built=False`` omits the Input."""
    s = _Seeds(seed)
    stack: list[Any] = [keras.Input((10,))] if built else []
    stack += [s.dense(24, activation="relu"), layers.Dropout(0.25, seed=seed),
              s.dense(24, activation="relu"), s.dense(4)]
    return keras.Sequential(stack, name="sequential_net")


def data_sequential(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    return _rng(seed).standard_normal((n, 10)).astype("float32"), _target(n, (4,), seed)


# -- subclassed ----------------------------------------------------------------------------------

class SubclassedNet(keras.Model):
    """Conv2D, Flatten, Dense layers and keras.ops; ``d2`` is called twice; ``scale`` is a model
    weight used by a keras.ops call."""

    def __init__(self, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        s = _Seeds(seed)
        self.conv = layers.Conv2D(4, 3, activation="relu", kernel_initializer=s())
        self.flat = layers.Flatten()
        self.d1 = s.dense(16)
        self.d2 = s.dense(16, activation="tanh")
        self.drop = layers.Dropout(0.1, seed=seed)
        self.out = s.dense(3)
        self.scale = self.add_weight(shape=(16,), initializer=s("normal"), name="scale")

    def call(self, x: Any, training: bool | None = None) -> Any:
        h = self.d1(self.flat(self.conv(x)))
        h = ops.relu(h) + ops.mean(h, axis=-1, keepdims=True) * self.scale
        h = self.d2(self.d2(h))
        return self.out(self.drop(h, training=training))


def build_subclassed(seed: int = 0) -> keras.Model:
    """An unbuilt `SubclassedNet`: trace it with ``sample_input=data_subclassed(...)[0]``."""
    return SubclassedNet(seed, name="subclassed")


def data_subclassed(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    return _rng(seed).standard_normal((n, 8, 8, 1)).astype("float32"), _target(n, (3,), seed)


ZOO: dict[str, tuple[Callable[..., keras.Model], Callable[..., Any]]] = {
    "mlp": (build_mlp, data_mlp),
    "cnn": (build_cnn, data_cnn),
    "multi_io": (build_multi_io, data_multi_io),
    "shared": (build_shared, data_shared),
    "transformer": (build_transformer, data_transformer),
    "nested": (build_nested, data_nested),
    "sequential": (build_sequential, data_sequential),
    "subclassed": (build_subclassed, data_subclassed),
}
