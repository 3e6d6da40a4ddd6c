"""Models the benchmarks share (besides `tfhelp.dense_stack`): a Transformer and small CNNs.

Example::

    model = transformer_encoder()                 # BERT-style classifier, named layers
    x, y = transformer_data(256)
    MODELS["ResNet50"]()                          # keras.applications, weights=None
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["PLAN_MODELS", "cnn_data", "resnet50_small", "transformer_data", "transformer_encoder"]


def transformer_encoder(seq: int = 64, vocab: int = 1000, d: int = 128, heads: int = 4,
                        blocks: int = 4, classes: int = 10) -> Any:
    """A BERT-style encoder classifier from stock Keras layers (as in tests/tf)."""
    import keras

    layers = keras.layers
    tokens = keras.Input((seq,), dtype="int32", name="tokens")
    x = layers.Embedding(vocab, d, name="embed")(tokens)
    for i in range(blocks):
        a = layers.MultiHeadAttention(heads, d // heads, name=f"mha{i}")(x, x)
        x = layers.LayerNormalization(name=f"ln{i}a")(layers.Add(name=f"add{i}a")([x, a]))
        f = layers.Dense(4 * d, activation="gelu", name=f"ff{i}a")(x)
        f = layers.Dense(d, name=f"ff{i}b")(f)
        x = layers.LayerNormalization(name=f"ln{i}b")(layers.Add(name=f"add{i}b")([x, f]))
    x = layers.GlobalAveragePooling1D(name="pool")(x)
    return keras.Model(tokens, layers.Dense(classes, name="head")(x), name="encoder")


def transformer_data(rows: int, seq: int = 64, vocab: int = 1000, classes: int = 10,
                     seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random token ids and one-hot-like float targets for `transformer_encoder`."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab, (rows, seq), dtype=np.int32)
    y = rng.standard_normal((rows, classes)).astype(np.float32)
    return x, y


def resnet50_small(size: int = 32, classes: int = 10) -> Any:
    """keras.applications.ResNet50 on ``size``×``size`` images: trainable in seconds here."""
    import keras

    return keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=classes,
                                       classifier_activation=None)


def cnn_data(rows: int, size: int = 32, classes: int = 10, seed: int = 0
             ) -> tuple[np.ndarray, np.ndarray]:
    """Random images and float targets for `resnet50_small`."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, size, size, 3)).astype(np.float32)
    y = rng.standard_normal((rows, classes)).astype(np.float32)
    return x, y


def _app(name: str) -> Callable[[], Any]:
    def build() -> Any:
        import keras

        return getattr(keras.applications, name)(weights=None)

    return build


# Models whose plans benchmark 5 compares (built at full input size; traced, not trained).
PLAN_MODELS: dict[str, Callable[[], Any]] = {
    "ResNet50": _app("ResNet50"),
    "MobileNetV2": _app("MobileNetV2"),
    "DenseNet121": _app("DenseNet121"),
    "TransformerEncoder": transformer_encoder,
}
