"""How a loss that returns one value per batch combines over its rows, measured before the first
step (`Objective.prepare`): a sum, a mean, or neither (refused at more than one part)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from tfsmp.errors import StepError
from tfsmp.runtime.objective import Objective


class _Sum(keras.losses.Loss):
    """Keras's `run_layer_test` trains with this loss: the sum of every output."""

    def __call__(self, y_true, y_pred, sample_weight=None):  # type: ignore[no-untyped-def]
        return keras.ops.sum(y_pred)


class _SquaredMean(keras.losses.Loss):
    def __call__(self, y_true, y_pred, sample_weight=None):  # type: ignore[no-untyped-def]
        return keras.ops.square(keras.ops.mean(keras.ops.cast(y_pred, "float32") - y_true))


def _prepared(loss: keras.losses.Loss, dtype: str) -> Objective:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, dtype=dtype)])
    model.compile(optimizer="sgd", loss=loss)
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    y = np.random.default_rng(1).normal(size=(8, 16)).astype(np.float32)
    y_pred = model(x)
    model._compile_loss.build(y, y_pred)
    objective = Objective(model._compile_loss)
    objective.prepare(y, None, y_pred, parts=2, has_layer_losses=False, scaled=False,
                      rank_tag="[test]")
    return objective


@pytest.mark.parametrize("dtype", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_a_sum_over_the_rows_is_a_sum_in_every_precision(dtype: str) -> None:
    # at bfloat16 the sum of 3 rows missed a + b by more than the 1e-4 the rule allows: Keras's
    # layer tests (quantized Dense, EinsumDense, Embedding) were refused as "neither"
    (term,) = _prepared(_Sum(), dtype).terms
    assert term.mean_rule is False


@pytest.mark.parametrize("dtype", ["float32", "mixed_bfloat16"])
def test_a_loss_that_is_neither_is_still_refused(dtype: str) -> None:
    with pytest.raises(StepError, match="whose value is neither"):
        _prepared(_SquaredMean(), dtype)
