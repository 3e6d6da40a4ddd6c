"""Hand-built layer graphs for partitioner tests (no TensorFlow)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from tfsmp.graph.ir import LayerGraph, LayerNode, TensorInfo, Tie

__all__ = [
    "add",
    "chain",
    "colocated_pair",
    "diamond",
    "multi_output",
    "random_dag",
    "shared_layer",
    "skip",
    "tied_embedding",
]


def add(g: LayerGraph, name: str, inputs: Sequence[str], *, flops: float = 1000.0,
        width: int = 16, params: int = 0, outputs: int = 1, variables: tuple[str, ...] = (),
        call: int = 0) -> list[str]:
    """Adds one call of a layer (forward ``flops``, backward 2x) producing ``outputs`` tensors
    of ``width`` float32 each; returns their keys."""
    infos = [TensorInfo(f"{name}:{call}:{i}", name, (width,)) for i in range(outputs)]
    node = g.nodes.get(name) or LayerNode(
        name, "Dense", flops_forward=flops, flops_backward=2 * flops, param_bytes=4 * params,
        trainable_param_bytes=4 * params, param_count=params, activation_bytes=4 * width * outputs,
        variables=variables or ((f"{name}/kernel",) if params else ()))
    g.add_layer(node, inputs, infos)
    return [t.key for t in infos]


def chain(n: int, flops: Sequence[float] | None = None, widths: Sequence[int] | None = None,
          params: Sequence[int] | None = None) -> LayerGraph:
    """x -> l0 -> l1 -> ... -> l{n-1}."""
    g = LayerGraph(name=f"chain{n}")
    prev = g.add_input("x", (16,))
    for i in range(n):
        (prev,) = add(g, f"l{i}", [prev], flops=flops[i] if flops else 1000.0,
                      width=widths[i] if widths else 16, params=params[i] if params else 100)
    g.set_outputs([prev])
    return g


def diamond() -> LayerGraph:
    """x -> a -> (b, c) -> d."""
    g = LayerGraph(name="diamond")
    x = g.add_input("x", (16,))
    (a,) = add(g, "a", [x])
    (b,) = add(g, "b", [a], flops=3000.0)
    (c,) = add(g, "c", [a], flops=1000.0)
    (d,) = add(g, "d", [b, c])
    g.set_outputs([d])
    return g


def skip(n: int = 6) -> LayerGraph:
    """A chain l0..l{n-1} plus a long skip: ``out = add(l{n-1}, l0)``."""
    g = LayerGraph(name="skip")
    first = prev = add(g, "l0", [g.add_input("x", (16,))])[0]
    for i in range(1, n):
        (prev,) = add(g, f"l{i}", [prev])
    (out,) = add(g, "out", [prev, first], flops=10.0)
    g.set_outputs([out])
    return g


def shared_layer() -> LayerGraph:
    """x -> a -> b -> a -> c: layer ``a`` is called twice, so ``a`` and ``b`` form a cycle."""
    g = LayerGraph(name="shared")
    x = g.add_input("x", (16,))
    (a0,) = add(g, "a", [x], params=50)
    (b,) = add(g, "b", [a0])
    (a1,) = add(g, "a", [b], call=1)
    (c,) = add(g, "c", [a1])
    (d,) = add(g, "d", [c])
    g.set_outputs([d])
    return g


def multi_output() -> LayerGraph:
    """x -> a -> b -> c; heads ``h1`` (on a) and ``c`` are both model outputs."""
    g = LayerGraph(name="multi_output")
    x = g.add_input("x", (16,))
    (a,) = add(g, "a", [x])
    (h1,) = add(g, "h1", [a], width=4)
    (b,) = add(g, "b", [a])
    (c,) = add(g, "c", [b], width=4)
    g.set_outputs([h1, c])
    return g


def colocated_pair() -> LayerGraph:
    """Two branches whose layers ``a`` and ``b`` share a kernel (a siamese pair), joined by ``c``."""
    g = LayerGraph(name="colocated")
    x = g.add_input("x", (16,))
    (a,) = add(g, "a", [x], params=10, variables=("shared/kernel", "a/bias"))
    (b,) = add(g, "b", [x], params=10, variables=("shared/kernel", "b/bias"))
    (c,) = add(g, "c", [a, b])
    (d,) = add(g, "d", [c])
    g.set_outputs([d])
    g.colocate.append(frozenset({"a", "b"}))
    return g


def tied_embedding(n: int = 4, params: int = 100, flops: float = 1000.0) -> LayerGraph:
    """emb -> l0..l{n-1} -> head -> tail, where ``head`` reuses ``emb``'s matrix (a tied
    embedding, as the tracer records it: a `Tie`, free to hold a copy on another stage)."""
    g = LayerGraph(name="tied")
    (prev,) = add(g, "emb", [g.add_input("x", (16,))], params=params,
                  variables=("emb/embeddings",), flops=flops)
    for i in range(n):
        (prev,) = add(g, f"l{i}", [prev])
    (out,) = add(g, "head", [prev], flops=flops)
    g.nodes["head"].variables = ()
    (tail,) = add(g, "tail", [out])
    g.set_outputs([tail])
    g.ties.append(Tie(("emb", "head"), ("emb/embeddings",), 4 * params, 4 * params))
    return g


def random_dag(n: int, seed: int = 0, window: int = 20, max_fanin: int = 3) -> LayerGraph:
    """``n`` layers, each reading 1..``max_fanin`` of the ``window`` latest tensors."""
    rng = random.Random(seed)
    g = LayerGraph(name=f"dag{n}")
    keys = [g.add_input("x", (16,))]
    for i in range(n):
        recent = keys[-window:]
        ins = rng.sample(recent, min(len(recent), rng.randint(1, max_fanin)))
        keys += add(g, f"l{i}", ins, flops=rng.uniform(100, 10_000), width=rng.choice([8, 16, 64]),
                    params=rng.randint(0, 1000))
    g.set_outputs([keys[-1]])
    return g
