"""Plain Keras in one process (tfsmp is not imported): the exported files predict what the
4-stage model predicted. Usage: checkpoint_verify.py DIR; prints one JSON line."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from checkpoint_models import build_rich

directory = sys.argv[1]
x = np.load(os.path.join(directory, "export4_x.npy"))
expected = np.load(os.path.join(directory, "export4_pred.npy"))


def err(pred: object) -> float:
    """Largest |pred - expected| / (1e-7 + 1e-6 |expected|): <= 1 means equal at rtol 1e-6."""
    p = np.asarray(pred)
    return float(np.max(np.abs(p - expected) / (1e-7 + 1e-6 * np.abs(expected))))


out: dict[str, object] = {}
out["keras_file"] = err(keras.models.load_model(os.path.join(directory, "export4.keras"))
                        .predict(x, verbose=0))
out["cli_export"] = err(keras.models.load_model(os.path.join(directory, "cli_export.keras"))
                        .predict(x, verbose=0))
fresh = build_rich(seed=1)
fresh.load_weights(os.path.join(directory, "export4.weights.h5"))
out["weights_file"] = err(fresh.predict(x, verbose=0))
serving = tf.saved_model.load(os.path.join(directory, "export4_savedmodel"))
out["savedmodel"] = err(serving.signatures["serving_default"](tf.constant(x))["output_0"])
out["tfsmp_imported"] = "tfsmp" in sys.modules
print(json.dumps(out), flush=True)
