"""Which traced tensors carry a Keras mask when the model runs: the mask keys of every call.

Example::

    specs = attach_masks(calls, tensor_specs, symbolic_masks)   # sets Call.*_mask_keys
    specs["emb:0:0#mask"]          # KerasTensor(shape=(None, None), dtype=bool)

[Note: mask discovery] The symbolic trace does not know every mask the model carries when it
runs: a layer whose ``call`` attaches a mask itself and whose ``compute_mask`` says nothing
(``ReversibleEmbedding(mask_zero=True)``, keras_hub's ``TokenAndPositionEmbedding(mask_zero=
True)``, whose masks keras_hub's ``TransformerEncoder`` then reads) has no mask on its symbolic
output, because Keras builds a Functional graph through ``compute_output_spec``, not ``call``;
and a nested model's inner tensors are traced without the masks of the outer tensors it is
called on. A mask missed there would be silently dropped at a cut. So each Keras layer call is
run once more, in execution order, on placeholders in a scratch graph, through `Call.run` (which
attaches the masks found so far to its inputs), and the masks its outputs come out with are the
ones a stage will see: the same code in the same graph mode as a stage's compiled function.
Nothing runs and nothing is allocated (a deferred variable reads as its initializer's graph);
measured on a keras_hub BERT-base backbone (12 layers, 768 wide), the whole pass builds graphs
for about 1.2 s. A call that cannot run on placeholders keeps the masks of the symbolic trace.
``keras.ops`` calls neither read nor attach masks (only ``Layer.__call__`` handles them).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from keras.src.backend import get_keras_mask
from keras.src.backend.common.symbolic_scope import SymbolicScope

from tfsmp.graph.deferred import deferred_scope
from tfsmp.graph.reads import placeholder

__all__ = ["attach_masks", "mask_key"]


def mask_key(key: str) -> str:
    """The key of the mask of tensor ``key`` ([Note: mask tensors] in `ir.py`)."""
    return f"{key}#mask"


def attach_masks(calls: list[Any], specs: dict[str, Any], symbolic: dict[str, Any]
                 ) -> dict[str, Any]:
    """Sets every call's ``input_mask_keys`` and ``output_mask_keys``. See [Note: mask discovery].

    Args:
        calls: the traced calls, in execution order.
        specs: ``{tensor key: KerasTensor}`` for every model input and call output.
        symbolic: ``{tensor key: KerasTensor}`` of the masks the symbolic trace saw.

    Returns:
        ``{tensor key: KerasTensor}``: the spec of each mask, by the key of its tensor.
    """
    found: dict[str, Any] = {}
    with deferred_scope():
        for call in calls:
            layer = isinstance(call.layer, keras.layers.Layer)
            call.input_mask_keys = [mask_key(k) if layer and k in found else None
                                    for k in call.input_keys]
            call.output_mask_keys = [None] * len(call.output_keys)
            if layer:
                found.update(_outputs_masks(call, specs, found, symbolic))
            call.output_mask_keys = [mask_key(k) if k in found else None for k in call.output_keys]
    return found


def _outputs_masks(call: Any, specs: dict[str, Any], found: dict[str, Any],
                   symbolic: dict[str, Any]) -> dict[str, Any]:
    try:
        return _run_for_masks(call, specs, found)
    except Exception:  # runs only on real data: trust the symbolic trace
        return {k: symbolic[k] for k in call.output_keys if k in symbolic}


def _run_for_masks(call: Any, specs: dict[str, Any], found: dict[str, Any]) -> dict[str, Any]:
    with tf.__internal__.FuncGraph("tfsmp_masks").as_default():
        env = {k: placeholder(specs[k]) for k in call.input_keys}
        env.update({mask_key(k): placeholder(found[k]) for k in call.input_keys if k in found})
        with keras.StatelessScope(initialize_variables=False), SymbolicScope():
            call.run(env)
        out = {}
        for key in call.output_keys:
            mask = get_keras_mask(env[key])
            if mask is not None:
                out[key] = keras.KerasTensor(tuple(mask.shape), dtype=mask.dtype.name)
        return out

