"""Fine-tune pretrained plain-Keras weights as a 2-stage pipeline, with the feature layers frozen.

Run:  tfsmp run -np 2 examples/finetune.py [--out /tmp/tfsmp_finetune] [--epochs 4]

1. Pretraining (rank 0, plain Keras, one process): a CNN learns the 10 generated "digits" of
   `train_pipeline.py` and is saved as ``pretrained.weights.h5`` — it stands in for weights you
   downloaded.
2. Fine-tuning (every rank): the same feature extractor with a new head for a new task (is the
   digit >= 5?) is built inside ``smp.deferred_init()`` (no weights allocated), its convolutional
   layers are frozen, and ``load_weights`` loads the pretrained file — each rank reads only its
   own stage's layers, and the new head (another shape) is skipped. It trains as a pipeline.
3. Export: ``model.save("finetuned.keras")`` writes one plain Keras file; rank 0 loads it with
   ``keras.models.load_model`` and checks that it predicts what the pipeline predicts.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
from train_pipeline import make_digits

import tfsmp as smp

FROZEN = ("conv1", "conv2", "conv3")


def build_model(num_classes: int, seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    L = keras.layers
    x = keras.Input((16, 16, 1), name="image")
    h = L.Conv2D(16, 3, padding="same", activation="relu", name="conv1")(x)
    h = L.Conv2D(32, 3, padding="same", activation="relu", name="conv2")(h)
    h = L.MaxPooling2D(name="pool1")(h)
    h = L.Conv2D(32, 3, padding="same", activation="relu", name="conv3")(h)
    h = L.MaxPooling2D(name="pool2")(h)
    h = L.Flatten(name="flatten")(h)
    h = L.Dense(64, activation="relu", name="dense1")(h)
    return keras.Model(x, L.Dense(num_classes, name="logits")(h), name="digits_cnn")


def pretrain(path: str, epochs: int) -> None:
    """Plain Keras in this one process: task A, 10 classes."""
    x, y = make_digits(4096, seed=1)
    model = build_model(10, seed=0)
    model.compile(optimizer=keras.optimizers.Adam(2e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(x, y, batch_size=128, epochs=epochs, verbose=0)
    print(f"pretrained: accuracy {model.evaluate(x, y, verbose=0)[1]:.3f} -> {path}", flush=True)
    model.save_weights(path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/tfsmp_finetune")
    parser.add_argument("--epochs", type=int, default=4)
    args, _ = parser.parse_known_args()
    smp.init({"partitions": 2, "microbatches": 4})
    pretrained = os.path.join(args.out, "pretrained.weights.h5")
    if smp.rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        pretrain(pretrained, args.epochs)
    smp.barrier()

    with smp.deferred_init():                # nothing allocated until each rank takes its stage
        inner = build_model(2, seed=1)       # task B: a new 2-class head
    for name in FROZEN:
        inner.get_layer(name).trainable = False
    model = smp.DistributedModel(inner)
    # Applied when the model is partitioned; the new head's shape differs: skipped, with a warning.
    model.load_weights(pretrained, skip_mismatch=True)
    model.compile(optimizer=keras.optimizers.Adam(2e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    x, digits = make_digits(2048, seed=3)
    y = (digits >= 5).astype(np.int64)
    history = model.fit(x, y, batch_size=128, epochs=args.epochs, verbose=0)

    reference = build_model(10, seed=0)      # the pretrained values, to check frozen layers
    reference.load_weights(pretrained)
    weights = dict(zip([v.path for v in inner.weights], model.get_weights()))
    frozen_same = all(np.array_equal(weights[v.path], v.numpy())
                      for name in FROZEN for v in reference.get_layer(name).weights)

    finetuned = os.path.join(args.out, "finetuned.keras")
    model.save(finetuned)                    # every rank calls it; rank 0 writes
    predictions = model.predict(x[:256], batch_size=128)
    if smp.rank() == 0:
        plain = keras.models.load_model(finetuned)
        same = bool(np.allclose(plain.predict(x[:256], verbose=0), predictions,
                                rtol=1e-6, atol=1e-6))
        print("RESULT " + json.dumps({
            "accuracy": history.history["accuracy"][-1], "frozen_layers_unchanged": frozen_same,
            "exported_predicts_the_same": same, "file": finetuned}), flush=True)


if __name__ == "__main__":
    main()
