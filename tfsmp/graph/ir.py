"""The layer graph: one node per Keras layer, tensor edges with per-sample sizes, and costs.

Pure: imports neither TensorFlow nor Keras. The tracer (`tfsmp.graph.tracer`) builds it; the
partitioner (`tfsmp.partitioning`) reads it.

Example::

    g = LayerGraph()
    g.add_input("x", shape=(8,), dtype="float32")
    g.add_layer(LayerNode("d1", "Dense", flops_forward=128, param_bytes=288),
                inputs=["x:0:0"], outputs=[TensorInfo("d1:0:0", "d1", (16,), "float32")])
    g.set_outputs(["d1:0:0"])

[Note: tensor keys] A tensor is keyed ``"{layer}:{call}:{index}"`` — the producing layer's name,
the index of that layer's call (a layer called twice has calls 0 and 1), and the output index of
that call. This mirrors Keras's ``KerasHistory(operation, node_index, tensor_index)``. Model inputs
are produced by their ``InputLayer`` (``"x:0:0"``). Keys are stable across processes, which is
what lets every rank agree on message tags without talking.

[Note: layer cycles] A layer called at several places whose calls change state (a Dropout's
seed, BatchNormalization statistics: any non-trainable variable) is one node, because that state
must advance in call order on one stage; so the *layer* graph may contain cycles
(``a -> b -> a``). Planners contract strongly connected components before ordering stages;
`LayerGraph.groups()` returns the components, merged further with `colocate` (layers sharing a
non-trainable variable).

[Note: mask tensors] A Keras mask (``_keras_mask`` on a tensor) is a tensor of the graph of its
own, keyed ``"<key>#mask"`` (`LayerGraph.masks` maps data key -> mask key), bool, produced by the
layer that produces the data and read by the layers that read it. So a cut through a masked
tensor is also a cut through its mask and both are priced and sent. ``outputs`` lists the model
outputs, then the masks of those that have one (the last stage needs both). See [Note: masks] in
`tfsmp.graph.tracer`.

[Note: tied copies] A layer whose variables are all trainable is instead one node per call
(`LayerNode.layer` names the Keras layer; the first call in execution order keeps the plain
name, later calls are ``"<layer>@<call>"``), and layers sharing trainable variables (a tied
embedding and its output projection) stay separate nodes. Each such set of nodes is a `Tie`:
every stage that runs one of them holds a copy of the variables, the copies start equal, their
gradients are summed over the stages before the optimizer step, so they stay equal (what
Megatron and DeepSpeed do for tied embeddings). The planner prices the copies' memory and the
extra reduction (`tfsmp.partitioning.ties`) and may still put them on one stage.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

__all__ = [
    "DTYPE_BYTES",
    "OPTIMIZER_SLOTS",
    "LayerGraph",
    "LayerNode",
    "TensorInfo",
    "Tie",
    "optimizer_slots",
]

DTYPE_BYTES: dict[str, int] = {
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4,
    "int64": 8, "uint64": 8, "bool": 1, "complex64": 8, "complex128": 16, "string": 8,
}

# Optimizer state as a multiple of trainable parameter bytes, by Keras optimizer class name.
OPTIMIZER_SLOTS: dict[str, float] = {
    "sgd": 0.0, "sgd_momentum": 1.0, "adam": 2.0, "adamw": 2.0, "adamax": 2.0, "nadam": 2.0,
    "amsgrad": 3.0, "rmsprop": 1.0, "adagrad": 1.0, "adadelta": 2.0, "ftrl": 2.0,
    "lion": 1.0, "lamb": 2.0, "adafactor": 1.0,
}


def optimizer_slots(optimizer: str | None) -> float:
    """Optimizer state bytes per trainable parameter byte (``None`` → Adam, the common case)."""
    if optimizer is None:
        return OPTIMIZER_SLOTS["adam"]
    return OPTIMIZER_SLOTS.get(optimizer.lower(), 2.0)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the model: its key (see [Note: tensor keys]), producer and per-sample shape.

    ``shape`` excludes the batch axis; ``None`` entries are dimensions unknown until run time.
    ``typical`` is the shape they had in a sample batch or a user's hint (`tfsmp.graph.costs.
    resolve_dims`); byte estimates use it, else count unknown dimensions as 1.
    """

    key: str
    producer: str
    shape: tuple[int | None, ...]
    dtype: str = "float32"
    typical: tuple[int, ...] | None = None

    @property
    def bytes_per_sample(self) -> int:
        dims = self.typical if self.typical is not None else self.shape
        n = math.prod(d if d is not None else 1 for d in dims)
        return int(n) * DTYPE_BYTES.get(self.dtype, 4)


@dataclass
class LayerNode:
    """One Keras layer (all of its calls), with per-sample costs.

    Attributes:
        name: the Keras layer name, unique within the model.
        kind: the layer's class name (``"Dense"``, ``"InputLayer"``, ``"TFOpLambda"`` …).
        flops_forward: estimated forward FLOPs per sample, summed over all calls.
        flops_backward: estimated backward FLOPs per sample (about 2× forward when trainable).
        param_bytes: bytes of all its variables.
        trainable_param_bytes: bytes of its trainable variables (these carry optimizer state).
        param_count: number of scalar parameters.
        activation_bytes: bytes per sample of the outputs of all its calls.
        measured_seconds: forward+backward seconds per sample from `profile`, or None.
        variables: variable paths (``"dense/kernel"``), in Keras order.
        calls: how many times the layer is called in the model (by this node).
        layer: the Keras layer whose calls this node runs, when not ``name`` (a tied copy,
            see [Note: tied copies]).
        ops: TensorFlow operations of its calls' forward graphs (0: not measured), which the
            memory model prices ([Note: memory model] in tfsmp/partitioning/memory.py).
        linear_bytes: bytes per sample of the inputs and outputs of the Dense and EinsumDense
            layers its calls run (0: not measured): what a zero-bubble W keeps.
        recompute_bytes: bytes per sample its calls hold in a compiled forward and backward,
            the recomputing backward of ``optimize: memory`` (0: not measured; then
            ``activation_bytes`` stands for it; [Note: recomputed bytes] in
            tfsmp/graph/costs.py).
        product_bytes: bytes per sample of the outputs of the Dense and EinsumDense layers its
            calls run (0: not measured): what a speed-mode forward stashes for a replaying
            backward ([Note: replayed products] in tfsmp/runtime/deferred.py).
        kept_bytes: bytes per sample a compiled backward keeps of its calls: what their
            gradients keep besides their outputs, and each output only where this call's
            gradient or a consumer's keeps it (0: not measured; [Note: kept bytes] in
            tfsmp/graph/costs.py).
    """

    name: str
    kind: str
    flops_forward: float = 0.0
    flops_backward: float = 0.0
    param_bytes: int = 0
    trainable_param_bytes: int = 0
    param_count: int = 0
    activation_bytes: int = 0
    measured_seconds: float | None = None
    variables: tuple[str, ...] = ()
    calls: int = 1
    layer: str = ""
    ops: int = 0
    linear_bytes: int = 0
    recompute_bytes: int = 0
    kept_bytes: int = 0
    product_bytes: int = 0

    @property
    def keras_layer(self) -> str:
        """The Keras layer name (``name`` unless this node is a tied copy)."""
        return self.layer or self.name

    @property
    def is_input(self) -> bool:
        return self.kind == "InputLayer"

    @property
    def compute(self) -> float:
        """Forward+backward cost: measured seconds when profiled, else FLOPs."""
        if self.measured_seconds is not None:
            return self.measured_seconds
        return self.flops_forward + self.flops_backward


@dataclass(frozen=True)
class Tie:
    """Trainable variables that several nodes read, held as one copy per stage that runs any of
    them (see [Note: tied copies]). ``nodes[0]`` owns them: its ``param_bytes`` count them once.

    Example::

        Tie(nodes=("emb", "head"), variables=("emb/embeddings",), param_bytes=4000,
            trainable_param_bytes=4000)
    """

    nodes: tuple[str, ...]
    variables: tuple[str, ...]
    param_bytes: int = 0
    trainable_param_bytes: int = 0

    @property
    def owner(self) -> str:
        return self.nodes[0]


@dataclass
class LayerGraph:
    """Layers (nodes) and the tensors flowing between them (edges). See the module docstring."""

    nodes: dict[str, LayerNode] = field(default_factory=dict)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    # layer name -> tensor keys it reads / writes, over all its calls, in call order
    reads: dict[str, list[str]] = field(default_factory=dict)
    writes: dict[str, list[str]] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    # groups of layers that share a non-trainable variable and must sit on one stage
    colocate: list[frozenset[str]] = field(default_factory=list)
    # layers sharing trainable variables, which may sit apart holding copies ([Note: tied copies])
    ties: list[Tie] = field(default_factory=list)
    # tensor key -> key of its Keras mask, itself a bool tensor of the graph ([Note: mask tensors])
    masks: dict[str, str] = field(default_factory=dict)
    name: str = "model"
    _readers: dict[str, list[str]] | None = field(default=None, repr=False, compare=False)

    # -- building ------------------------------------------------------------------------------

    def add_input(self, name: str, shape: tuple[int | None, ...], dtype: str = "float32") -> str:
        """Adds an ``InputLayer`` node and its tensor; returns the tensor key."""
        key = f"{name}:0:0"
        self._readers = None
        self.nodes[name] = LayerNode(name, "InputLayer", activation_bytes=0)
        self.tensors[key] = TensorInfo(key, name, tuple(shape), dtype)
        self.reads[name] = []
        self.writes[name] = [key]
        self.inputs.append(key)
        return key

    def add_layer(self, node: LayerNode, inputs: Iterable[str], outputs: Iterable[TensorInfo]) -> None:
        """Adds a layer call. Calling it again with the same node name records another call."""
        outs = list(outputs)
        self._readers = None
        if node.name not in self.nodes:
            self.nodes[node.name] = node
            self.reads[node.name] = []
            self.writes[node.name] = []
        for t in outs:
            self.tensors[t.key] = t
        self.reads[node.name].extend(k for k in inputs if k not in self.reads[node.name])
        self.writes[node.name].extend(t.key for t in outs)

    def set_outputs(self, keys: Iterable[str]) -> None:
        self.outputs = list(keys)

    # -- queries -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[LayerNode]:
        return iter(self.nodes.values())

    def producer(self, tensor_key: str) -> str:
        return self.tensors[tensor_key].producer

    def consumers(self, tensor_key: str) -> list[str]:
        """Layers that read the tensor, in node order."""
        if self._readers is None:
            readers: dict[str, list[str]] = {}
            for n in self.nodes:
                for k in self.reads[n]:
                    readers.setdefault(k, []).append(n)
            self._readers = readers
        return list(self._readers.get(tensor_key, ()))

    def edges(self) -> dict[tuple[str, str], int]:
        """Layer-to-layer edges ``(src, dst) -> bytes per sample`` (self-loops dropped)."""
        out: dict[tuple[str, str], int] = {}
        for dst, keys in self.reads.items():
            for k in keys:
                src = self.tensors[k].producer
                if src != dst:
                    out[(src, dst)] = out.get((src, dst), 0) + self.tensors[k].bytes_per_sample
        return out

    def predecessors(self, name: str) -> list[str]:
        return list(dict.fromkeys(self.tensors[k].producer for k in self.reads[name]
                                  if self.tensors[k].producer != name))

    def successors(self, name: str) -> list[str]:
        out: list[str] = []
        for k in self.writes[name]:
            out.extend(c for c in self.consumers(k) if c != name and c not in out)
        return out

    def groups(self) -> list[list[str]]:
        """Layers that must share a stage: strongly connected components of the layer graph,
        merged with `colocate`. Returned in a topological order of the condensed graph, each
        group's members in node order. See [Note: layer cycles]."""
        order = list(self.nodes)
        index = {n: i for i, n in enumerate(order)}
        parent = list(range(len(order)))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        def union(a: int, b: int) -> None:
            ra, rb = find(a), find(b)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)

        for comp in _tarjan_scc(order, {n: self.successors(n) for n in order}):
            for n in comp[1:]:
                union(index[comp[0]], index[n])
        for group in self.colocate:
            members = [index[n] for n in group if n in index]
            for m in members[1:]:
                union(members[0], m)
        # Co-location can create new cycles between merged groups; iterate to a fixed point.
        while True:
            merged = self._merge_group_cycles(order, find, union)
            if not merged:
                break
        buckets: dict[int, list[str]] = {}
        for n in order:
            buckets.setdefault(find(index[n]), []).append(n)
        return self._toposort_groups(list(buckets.values()))

    def _merge_group_cycles(self, order: list[str], find: object, union: object) -> bool:
        f = find  # typed loosely to keep the helper small
        u = union
        index = {n: i for i, n in enumerate(order)}
        gid = {n: f(index[n]) for n in order}  # type: ignore[operator]
        succ: dict[int, set[int]] = {}
        for (a, b) in self.edges():
            if gid[a] != gid[b]:
                succ.setdefault(gid[a], set()).add(gid[b])
        ids = sorted(set(gid.values()))
        comps = _tarjan_scc(ids, {i: sorted(succ.get(i, ())) for i in ids})
        merged = False
        for comp in comps:
            for other in comp[1:]:
                u(comp[0], other)  # type: ignore[operator]
                merged = True
        return merged

    def _toposort_groups(self, groups: list[list[str]]) -> list[list[str]]:
        where = {n: gi for gi, g in enumerate(groups) for n in g}
        indeg = [0] * len(groups)
        succ: list[set[int]] = [set() for _ in groups]
        for (a, b) in self.edges():
            ga, gb = where[a], where[b]
            if ga != gb and gb not in succ[ga]:
                succ[ga].add(gb)
                indeg[gb] += 1
        ready = [i for i in range(len(groups)) if indeg[i] == 0]
        out: list[list[str]] = []
        while ready:
            i = min(ready)  # deterministic: earliest group in node order first
            ready.remove(i)
            out.append(groups[i])
            for j in sorted(succ[i]):
                indeg[j] -= 1
                if indeg[j] == 0:
                    ready.append(j)
        return out

    def with_ties_colocated(self) -> LayerGraph:
        """This graph with every `Tie` made a co-located group: the plans that keep each set of
        tied layers on one stage (no copies)."""
        return LayerGraph(
            nodes=self.nodes, tensors=self.tensors, reads=self.reads, writes=self.writes,
            inputs=self.inputs, outputs=self.outputs, name=self.name, ties=[], masks=self.masks,
            colocate=[*self.colocate, *(frozenset(t.nodes) for t in self.ties)])

    def topological_order(self) -> list[str]:
        """Layer names in an order where every group precedes the groups it feeds."""
        return [n for g in self.groups() for n in g]

    # -- totals --------------------------------------------------------------------------------

    def total_compute(self) -> float:
        return sum(n.compute for n in self)

    def total_param_bytes(self) -> int:
        return sum(n.param_bytes for n in self)

    def memory_of(self, name: str, optimizer: str | None = None, batch_size: int = 1) -> float:
        """Bytes a layer pins on its stage: parameters, optimizer state and stashed activations."""
        n = self.nodes[name]
        return (n.param_bytes + optimizer_slots(optimizer) * n.trainable_param_bytes
                + n.activation_bytes * batch_size)


def _tarjan_scc(order: list[str] | list[int], succ: dict[str, list[str]] | dict[int, list[int]]) -> list[list]:  # type: ignore[type-arg]
    """Strongly connected components with more than one member (iterative Tarjan)."""
    index: dict[object, int] = {}
    low: dict[object, int] = {}
    on_stack: set[object] = set()
    stack: list[object] = []
    comps: list[list] = []  # type: ignore[type-arg]
    counter = 0
    for root in order:
        if root in index:
            continue
        work: list[tuple[object, int]] = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack.add(v)
            nbrs = succ.get(v, [])  # type: ignore[call-overload]
            if i < len(nbrs):
                work.append((v, i + 1))
                w = nbrs[i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    pos = {n: k for k, n in enumerate(order)}
                    comps.append(sorted(comp, key=lambda n: pos[n]))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return comps
