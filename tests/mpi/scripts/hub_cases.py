"""keras_hub models train like plain Keras (run by `cases_runner.py`; issue 19).

Each case builds a small keras_hub model from constructor arguments (random weights, no
preprocessor, no download), trains it 3 steps with Adam on padded batches — plain Keras on rank
0, tfsmp across the world with the automatic planner — and reports the losses and the largest
weight error (`keras_equal.compare`). Causal LMs get ``{"token_ids", "padding_mask"}``, the next
tokens as targets and the padding mask as sample weight, as keras_hub's preprocessors make
them; seq2seq models the same for the decoder; the ViT classifies random images. A case name is
``case_<model>_p<partitions>[_m<microbatches>]`` (default m = 1); ``case_references`` trains
every reference first, spread over the ranks.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import keras_hub
import numpy as np
from caseutil import reinit
from keras_equal import compare, references, rows

VOCAB, DIM, FF, SEQ, BATCH, STEPS = 64, 16, 32, 8, 8, 3
M = keras_hub.models


def llama() -> keras.Model:
    return M.LlamaCausalLM(backbone=M.LlamaBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=DIM, intermediate_dim=FF), preprocessor=None)


def mistral() -> keras.Model:
    return M.MistralCausalLM(backbone=M.MistralBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=DIM, intermediate_dim=FF, sliding_window=4), preprocessor=None)


def gemma() -> keras.Model:
    return M.GemmaCausalLM(backbone=M.GemmaBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=DIM, intermediate_dim=FF, head_dim=8), preprocessor=None)


def phi3() -> keras.Model:
    return M.Phi3CausalLM(backbone=M.Phi3Backbone(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=DIM, intermediate_dim=FF, max_sequence_length=SEQ + 1,
        pretraining_sequence_length=SEQ + 1), preprocessor=None)


def bart() -> keras.Model:
    return M.BartSeq2SeqLM(backbone=M.BartBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=DIM, intermediate_dim=FF,
        dropout=0.0, max_sequence_length=SEQ + 1), preprocessor=None)


def t5() -> keras.Model:
    return M.T5Seq2SeqLM(backbone=M.T5Backbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=DIM, intermediate_dim=FF,
        key_value_dim=8, dropout=0.0), preprocessor=None)


def vit() -> keras.Model:
    return M.ViTImageClassifier(backbone=M.ViTBackbone(
        image_shape=(8, 8, 3), patch_size=2, num_layers=1, num_heads=2, hidden_dim=DIM,
        mlp_dim=FF), num_classes=5, preprocessor=None)


def qwen_moe() -> keras.Model:
    return M.QwenMoeCausalLM(backbone=M.QwenMoeBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=DIM, intermediate_dim=FF, moe_intermediate_dim=8,
        shared_expert_intermediate_dim=8, num_experts=4, top_k=2, output_router_logits=True),
        preprocessor=None)


def mixtral() -> keras.Model:
    return M.MixtralCausalLM(backbone=M.MixtralBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=DIM, intermediate_dim=FF, num_experts=4, top_k=2, sliding_window=SEQ,
        output_router_logits=True), preprocessor=None)


def clip() -> keras.Model:
    """keras_hub's CLIP: an 'embedding' layer in each encoder ([Note: nested names] in
    tfsmp/graph/tracer.py)."""
    vision = M.CLIPVisionEncoder(patch_size=4, hidden_dim=DIM, num_layers=1, num_heads=2,
                                 intermediate_dim=FF, image_shape=(8, 8, 3))
    text = M.CLIPTextEncoder(vocabulary_size=VOCAB, embedding_dim=DIM, hidden_dim=DIM,
                             num_layers=1, num_heads=2, intermediate_dim=FF,
                             max_sequence_length=SEQ)
    return M.CLIPBackbone(vision, text, projection_dim=8)


# -- data: lists of (x, y, sample_weight) batches ------------------------------------------------

def _padded(rng: np.random.Generator, n: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids in [1, VOCAB) padded with 0 after a random length >= 2, and the padding mask."""
    ids = rng.integers(1, VOCAB, (n, length)).astype("int32")
    mask = np.arange(length)[None, :] < rng.integers(2, length + 1, n)[:, None]
    return ids * mask, mask


def _batches(x: Any, y: np.ndarray, sw: np.ndarray | None) -> list[tuple[Any, ...]]:
    out = []
    for i in range(STEPS):
        s = slice(i * BATCH, (i + 1) * BATCH)
        b = (rows(x, s.start, s.stop), rows(y, s.start, s.stop))
        out.append(b if sw is None else (*b, sw[s]))
    return out


def causal_data() -> list[tuple[Any, ...]]:
    ids, mask = _padded(np.random.default_rng(5), STEPS * BATCH, SEQ + 1)
    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
    return _batches(x, ids[:, 1:], mask[:, 1:].astype("float32"))


def seq2seq_data() -> list[tuple[Any, ...]]:
    rng = np.random.default_rng(6)
    enc, enc_mask = _padded(rng, STEPS * BATCH, SEQ)
    dec, dec_mask = _padded(rng, STEPS * BATCH, SEQ + 1)
    x = {"encoder_token_ids": enc, "encoder_padding_mask": enc_mask,
         "decoder_token_ids": dec[:, :-1], "decoder_padding_mask": dec_mask[:, :-1]}
    return _batches(x, dec[:, 1:], dec_mask[:, 1:].astype("float32"))


def image_data() -> list[tuple[Any, ...]]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(STEPS * BATCH, 8, 8, 3)).astype("float32")
    return _batches(x, rng.integers(0, 5, STEPS * BATCH).astype("int32"), None)


def contrastive_data() -> list[tuple[Any, ...]]:
    """CLIP: image i matches text i; each row's target is its own index in the batch."""
    rng = np.random.default_rng(8)
    images = rng.normal(size=(STEPS * BATCH, 8, 8, 3)).astype("float32")
    ids, _ = _padded(rng, STEPS * BATCH, SEQ)
    match = np.tile(np.arange(BATCH, dtype="int32"), STEPS)
    return _batches({"images": images, "token_ids": ids},
                    {"vision_logits": match, "text_logits": match}, None)


MODELS: dict[str, tuple[Callable[[], keras.Model], Callable[[], list[tuple[Any, ...]]]]] = {
    "llama": (llama, causal_data), "mistral": (mistral, causal_data),
    "gemma": (gemma, causal_data), "phi3": (phi3, causal_data),
    "bart": (bart, seq2seq_data), "t5": (t5, seq2seq_data), "vit": (vit, image_data),
    "qwenmoe": (qwen_moe, causal_data), "mixtral": (mixtral, causal_data),
    "clip": (clip, contrastive_data)}


def _compile() -> dict[str, Any]:
    return {"optimizer": keras.optimizers.Adam(LR),
            "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True)}


def _seeded(build: Callable[[], keras.Model]) -> Callable[[], keras.Model]:
    def make() -> keras.Model:
        keras.utils.set_random_seed(1)
        return build()
    return make


# Tolerances beyond rtol 1e-5 / atol 1e-6, each measured. Adam's update g / (|g| + eps), with
# eps = 1e-7, turns round-off in a gradient near eps into a 1e5 x larger weight change:
# - T5 at p = 2, m = 1 differed by up to 1.4e-6 (1.24 x the standard tolerance) in
#   cross-attention query/key kernels: bit-exact at p = 1, 0.0065 x with SGD, 0.013 x with
#   Adam(epsilon=1e-4). So T5 is held to atol 1e-5.
# - ViT at m = 2 differed by up to 9.3e-6 (1.93 x) in attention value kernels, the same at p = 1
#   (summing two microbatches' gradients rounds differently from the full batch's): 0.31 x with
#   Adam(epsilon=1e-4), bit-exact at m = 1. So ViT is held to atol 1e-5 too.
# - Attention key biases get an exact gradient of 0 (softmax ignores a per-query constant), so
#   Adam moves them by lr x the sign of round-off (ViT, p = 1, m = 2: |dw| 2.2e-4, 223 x): they
#   are only held to |w| <= STEPS x lr on both sides (`keras_equal.compare(noise=...)`).
ATOL = {"t5": 1e-5, "vit": 1e-5}
NOISE = {"vit": r"/mha/key/bias$"}
LR = 1e-2


def case_references(ctx: object) -> dict[str, float]:
    """Every model's plain Keras reference, trained once per launch across the ranks (or read
    from ``$TFSMP_HUB_REF_DIR``, where the first launch leaves them); ``$TFSMP_HUB_MODELS``
    (comma-separated) limits them to the models the launch trains."""
    only = [m for m in os.environ.get("TFSMP_HUB_MODELS", "").split(",") if m]
    specs = {name: (_seeded(build), _compile, data()) for name, (build, data) in MODELS.items()
             if not only or name in only}
    return references(specs, os.environ.get("TFSMP_HUB_REF_DIR"))


def train(name: str, partitions: int, microbatches: int) -> dict[str, Any]:
    build, data = MODELS[name]
    reinit({}, partitions=partitions, microbatches=microbatches)
    return compare(_seeded(build), _compile, data(), cache=name, atol=ATOL.get(name, 1e-6),
                   noise=NOISE.get(name), noise_bound=STEPS * LR)


def __getattr__(case: str) -> Callable[[object], dict[str, Any]]:
    """``case_<model>_p<p>[_m<m>]`` -> a case function (the runner looks cases up by name)."""
    if not case.startswith("case_"):
        raise AttributeError(case)
    parts = case[len("case_"):].split("_")
    name, p = parts[0], int(parts[1][1:])
    m = int(parts[2][1:]) if len(parts) > 2 else 1
    if name not in MODELS:
        raise AttributeError(case)
    return lambda ctx: train(name, p, m)
