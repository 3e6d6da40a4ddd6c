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
called on. A mask missed there would be silently dropped at a cut. So a Keras layer call is run
once more, in execution order, on placeholders in a scratch graph, through `Call.run` (which
attaches the masks found so far to its inputs), and the masks its outputs come out with are the
ones a stage will see: the same code in the same graph mode as a stage's compiled function.
Nothing runs and nothing is allocated (variables read as placeholders: `ScratchScope` in
`reads.py`). Only calls that may carry a mask run: those with a masked input or a masked
symbolic output, and those whose layer may create one (`_may_create_masks`: ``mask_zero=True``
or ``Masking`` anywhere inside it, or a layer class from outside Keras and keras_hub, which may
attach masks in ``call``). Building the graph of every call costs about 1 s for a keras_hub
BERT-base backbone (12 layers, 768 wide), which has no mask source and so runs none. A call that
cannot run on placeholders keeps the masks of the symbolic trace. ``keras.ops`` calls neither
read nor attach masks (only ``Layer.__call__`` handles them).
"""

from __future__ import annotations

from typing import Any

import keras
from keras.src.backend import get_keras_mask

from tfsmp.graph.reads import placeholder, scratch_graph

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
    sources: dict[int, bool] = {}
    for call in calls:
        layer = isinstance(call.layer, keras.layers.Layer)
        masked_in = [layer and k in found for k in call.input_keys]
        call.input_mask_keys = [mask_key(k) if m else None for k, m in zip(call.input_keys,
                                                                           masked_in)]
        call.output_mask_keys = [None] * len(call.output_keys)
        if layer and (any(masked_in) or any(k in symbolic for k in call.output_keys)
                      or _may_create_masks(call.layer, sources)):
            found.update(_outputs_masks(call, specs, found, symbolic))
        call.output_mask_keys = [mask_key(k) if k in found else None for k in call.output_keys]
    return found


# Packages whose layers create masks only through `mask_zero`, `Masking` or `compute_mask`.
_KNOWN = ("keras.", "keras_hub.", "keras_nlp.")


def _may_create_masks(layer: Any, cache: dict[int, bool]) -> bool:
    """Whether a call of ``layer`` on unmasked inputs may return a masked tensor: it, or a layer
    inside it, has ``mask_zero=True``, is a ``Masking`` layer, or is user code (which may attach
    masks in ``call``). See [Note: mask discovery]."""
    if id(layer) not in cache:
        inner = [layer, *layer._flatten_layers(include_self=False, recursive=True)]
        cache[id(layer)] = any(
            getattr(sub, "mask_zero", False) is True or isinstance(sub, keras.layers.Masking)
            or not type(sub).__module__.startswith(_KNOWN) for sub in inner)
    return cache[id(layer)]


def _outputs_masks(call: Any, specs: dict[str, Any], found: dict[str, Any],
                   symbolic: dict[str, Any]) -> dict[str, Any]:
    try:
        return _run_for_masks(call, specs, found)
    except Exception:  # runs only on real data: trust the symbolic trace
        return {k: symbolic[k] for k in call.output_keys if k in symbolic}


def _run_for_masks(call: Any, specs: dict[str, Any], found: dict[str, Any]) -> dict[str, Any]:
    with scratch_graph():
        env = {k: placeholder(specs[k]) for k in call.input_keys}
        env.update({mask_key(k): placeholder(found[k]) for k in call.input_keys if k in found})
        call.run(env)
        out = {}
        for key in call.output_keys:
            mask = get_keras_mask(env[key])
            if mask is not None:
                out[key] = keras.KerasTensor(tuple(mask.shape), dtype=mask.dtype.name)
        return out

