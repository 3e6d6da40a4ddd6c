"""Entry point for the estimator example: reads SM_CHANNEL_TRAINING, trains a DistributedModel, saves to SM_MODEL_DIR.

Runs unchanged under `tfsmp.estimator` (launch.py), on SageMaker, under `tfsmp run`, and under
`horovodrun`::

    horovodrun -np 4 --binding-args="--bind-to none --map-by slot" \\
        python train.py --training data --model_dir model

The SMP configuration arrives as SM_HP_MP_PARAMETERS (set by the estimator, or by hand);
`smp.init()` reads it. The toolkit also passes it as `--mp_parameters k=v,...`, which is ignored.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import numpy as np


def parse_args() -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--training", default=env("SM_CHANNEL_TRAINING", "data"),
                   help="directory holding train.npz (x, y)")
    p.add_argument("--model_dir", default=env("SM_MODEL_DIR", "model"))
    p.add_argument("--output_data_dir", default=env("SM_OUTPUT_DATA_DIR", "output"))
    args, _ = p.parse_known_args()  # the toolkit adds --mp_parameters and other hyperparameters
    return args


def build_model(features: int, classes: int) -> Any:
    """A small Functional MLP (a keras.Model; keras is imported late so --help is fast)."""
    import keras

    inputs = keras.Input((features,), name="features")
    x = inputs
    for i, width in enumerate((128, 128, 64, 64)):
        x = keras.layers.Dense(width, activation="relu", name=f"dense_{i}")(x)
    outputs = keras.layers.Dense(classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="mlp")


def main() -> None:
    args = parse_args()
    import keras

    import tfsmp as smp

    smp.init()  # partitions, microbatches, ... from SM_HP_MP_PARAMETERS
    data = np.load(os.path.join(args.training, "train.npz"))
    x, y = data["x"].astype("float32"), data["y"].astype("int64")
    keras.utils.set_random_seed(1234)  # the same initial weights on every rank

    model = smp.DistributedModel(build_model(x.shape[1], int(y.max()) + 1))
    model.compile(optimizer=keras.optimizers.Adam(args.learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    history = model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs,
                        verbose=2 if smp.rank() == 0 else 0)

    # Every rank takes part in saving and predicting; rank 0 writes the files.
    os.makedirs(args.model_dir, exist_ok=True)
    model.save(os.path.join(args.model_dir, "model.keras"))  # a plain Keras model
    probe = x[:16]
    predictions = np.asarray(model.predict(probe, verbose=0))
    if smp.rank() == 0:
        os.makedirs(args.output_data_dir, exist_ok=True)
        np.savez(os.path.join(args.output_data_dir, "probe.npz"), x=probe, y=predictions)
        with open(os.path.join(args.output_data_dir, "history.json"), "w") as f:
            json.dump({k: [float(v) for v in vs] for k, vs in history.history.items()}, f)
        print(f"saved {args.model_dir}/model.keras; loss per epoch: {history.history['loss']}")


if __name__ == "__main__":
    main()
