"""Models and data of the checkpoint tests, in plain Keras (no tfsmp: the verifier imports it too)."""

from __future__ import annotations

import keras
import numpy as np

BATCH = 16


def build_mlp(seed: int = 1234, head: int = 3) -> keras.Model:
    """Six weighted layers, no batch-coupled or random layer: its training does not depend on
    how the batch is split, so runs under different partitionings agree to rounding."""
    keras.utils.set_random_seed(seed)
    L = keras.layers
    x = keras.Input((12,), name="x")
    h = x
    for i in range(4):
        h = L.Dense(16, activation="tanh", name=f"d{i}")(h)
        if i == 1:
            h = L.LayerNormalization(name="ln")(h)
    return keras.Model(x, L.Dense(head, name="head")(h), name="mlp")


def build_rich(seed: int = 21) -> keras.Model:
    """BatchNormalization, Dropout (a seed-generator state) and a nested Functional model."""
    keras.utils.set_random_seed(seed)
    L = keras.layers
    inner_in = keras.Input((16,))
    inner = keras.Model(inner_in, L.Dense(16, activation="tanh", name="inner_d")(inner_in),
                        name="block")
    x = keras.Input((10,), name="x")
    h = L.Dense(16, activation="relu", name="a")(x)
    h = L.BatchNormalization(name="bn")(h)
    h = L.Dropout(0.3, name="drop")(h)
    h = inner(h)
    h = L.Dense(8, activation="relu", name="b")(h)
    return keras.Model(x, L.Dense(4, name="out")(h), name="rich")


def mlp_data(steps: int = 6) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    n = steps * BATCH
    return (rng.normal(size=(n, 12)).astype(np.float32),
            rng.normal(size=(n, 3)).astype(np.float32))


def rich_data(n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    return (rng.normal(size=(n, 10)).astype(np.float32),
            rng.normal(size=(n, 4)).astype(np.float32))


def reinit(**config: object) -> None:
    """tfsmp started afresh with ``config`` (4 microbatches unless it says otherwise)."""
    import tfsmp

    if tfsmp.is_initialized():
        tfsmp.shutdown()
    tfsmp.init({"microbatches": 4, **config})


def batch_of(x: np.ndarray, y: np.ndarray, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Batch ``i`` of BATCH rows."""
    return x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]


def rel_err(a: list[np.ndarray], b: list[np.ndarray], rtol: float, atol: float) -> float:
    """Largest |a-b| / (atol + rtol |b|): <= 1 means equal at that tolerance."""
    return max(float(np.max(np.abs(u - v) / (atol + rtol * np.abs(v)))) for u, v in zip(a, b))
