"""Train a small CNN as a 2-stage pipeline on generated 'digit' images (no download).

Run:  tfsmp run -np 2 examples/train_pipeline.py [--epochs 5] [--config '{"partitions": 2}']
      [--model-dir DIR]

It saves the trained model as one plain Keras file, `DIR/digits_cnn.keras` (DIR: `--model-dir`,
else SM_MODEL_DIR under the SageMaker-style estimator, else `model/`), which
`keras.models.load_model` opens in one process, and prints where it is.

The data: 10 fixed random 12×12 templates ("digits"); each sample is one template shifted by up
to 2 pixels, scaled, with Gaussian noise — a task a CNN learns to >95% accuracy in a few epochs.
Every rank generates the same data from the same seed, as every stage of a replica must see the
same batches.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

import tfsmp as smp


def make_digits(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    templates = np.random.default_rng(0).random((10, 12, 12)) > 0.6
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n)
    images = np.empty((n, 16, 16, 1), dtype=np.float32)
    for i, label in enumerate(labels):
        canvas = np.zeros((16, 16), dtype=np.float32)
        dy, dx = rng.integers(0, 5, size=2)
        canvas[dy:dy + 12, dx:dx + 12] = templates[label] * rng.uniform(0.7, 1.3)
        images[i, ..., 0] = canvas + rng.normal(0, 0.3, size=(16, 16))
    return images, labels


def build_model() -> keras.Model:
    keras.utils.set_random_seed(42)
    L = keras.layers
    x = keras.Input((16, 16, 1), name="image")
    h = L.Conv2D(16, 3, padding="same", activation="relu", name="conv1")(x)
    h = L.Conv2D(32, 3, padding="same", activation="relu", name="conv2")(h)
    h = L.MaxPooling2D(name="pool1")(h)
    h = L.Conv2D(32, 3, padding="same", activation="relu", name="conv3")(h)
    h = L.MaxPooling2D(name="pool2")(h)
    h = L.Flatten(name="flatten")(h)
    h = L.Dense(128, activation="relu", name="dense1")(h)
    h = L.Dense(64, activation="relu", name="dense2")(h)
    return keras.Model(x, L.Dense(10, name="logits")(h), name="digits_cnn")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--config", default=None, help="tfsmp config JSON (else SM_HP_MP_PARAMETERS)")
    parser.add_argument("--model-dir", "--model_dir", default=os.environ.get("SM_MODEL_DIR", "model"),
                        help="where to save the model (default: SM_MODEL_DIR, else ./model)")
    args, _ = parser.parse_known_args()
    config = json.loads(args.config) if args.config else None
    if config is None and not os.environ.get("SM_HP_MP_PARAMETERS"):
        config = {"partitions": 2, "microbatches": 4, "pipeline": "interleaved", "optimize": "speed"}
    smp.init(config)

    x_train, y_train = make_digits(4096, seed=1)
    x_val, y_val = make_digits(1024, seed=2)
    model = smp.DistributedModel(build_model())
    model.compile(optimizer=keras.optimizers.Adam(2e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    verbose = 2 if smp.rank() == 0 else 0
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
              validation_data=(x_val, y_val), verbose=verbose)
    if smp.rank() == 0:
        model.summary()
    loss, accuracy = model.evaluate(x_val, y_val, batch_size=256, verbose=0)
    path = os.path.abspath(os.path.join(args.model_dir, "digits_cnn.keras"))
    if smp.rank() == 0:
        os.makedirs(args.model_dir, exist_ok=True)
    model.save(path)  # every rank takes part; rank 0 writes the whole, unpartitioned model
    if smp.rank() == 0:
        print(f"rank 0 of {smp.size()} ({smp.mp_size()} stages × {smp.dp_size()} replicas): "
              f"validation loss {loss:.4f}, accuracy {accuracy:.4f}")
        print(f"saved the model to {path} ({os.path.getsize(path) / 1024:.0f} KB): "
              "keras.models.load_model opens it in one process")


if __name__ == "__main__":
    main()
