"""Compiled programs of one pipeline stage: forward, backward and the fused last stage.

Example::

    program = StageProgram(traced, plan, stage=1, optimize="memory", loss=loss_fn, scale=1/8)
    sends = program.forward(0, inputs, recv)       # stashes what backward needs
    grads_to_producers = program.backward(0, dys)  # accumulates dW into program.accumulators

[Note: stashing] ``optimize: speed`` keeps the GradientTape of every microbatch in flight, so
backward replays the forward function's stored activations (measured at 1.23× the time of one
fused forward-backward call); ``optimize: memory`` keeps only the stage's input tensors and
recomputes the forward inside a compiled backward (1.49×). The last stage fuses forward, loss and backward in one compiled call.

[Note: recompute state] A recomputed forward must see the state the original forward saw:
dropout seed-generator states, and BatchNormalization moving statistics must not be updated
twice. Backward in memory mode therefore sets the stage's non-trainable variables to the values
they had before that microbatch's forward, recomputes, and then puts back the current values.

[Note: split stages] In a zero-bubble schedule a stage with ``W`` actions runs with ``split``
set: its forward (or fused last-stage call, or memory-mode recompute) runs the layers under a
`tfsmp.runtime.deferred` recorder, its backward (``B``) accumulates only the weight gradients of
layers that are not deferred and returns the gradients for the received tensors, and `weight`
(``W``) later turns the saved layer inputs and pre-activation gradients into the deferred
layers' weight gradients ([Note: split backward] in `deferred.py`). A microbatch is held from
its forward until its ``W``. ``fresh`` and ``fresh_w`` are the two halves' [Note: fresh
accumulators] flags: B and W of one microbatch write disjoint accumulators, and a variable that
gets gradient from both (a deferred kernel that another op also reads) gets B's part added in W.

[Note: finite flags] Every compiled accumulation also returns whether the accumulators it wrote
are all finite afterwards, as a tensor kept per microbatch: the check costs no extra call and no
host synchronization per microbatch; `finite_status` reads all of a step's flags at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from tfsmp.errors import StepError
from tfsmp.partitioning.plan import Boundary, StagePlan
from tfsmp.runtime import deferred
from tfsmp.runtime.hooks import StageResult, StepMode

__all__ = ["StageProgram", "concat_sparse", "is_differentiable"]


def is_differentiable(dtype: str) -> bool:
    return dtype in ("float16", "bfloat16", "float32", "float64")


def _accumulate_into(acc: tf.Variable, g: tf.Tensor, first: bool) -> tf.Tensor:
    """``acc = g`` for the step's first microbatch, else ``acc += g`` ([Note: fresh
    accumulators]); returns whether the result is finite ([Note: finite flags])."""
    if first:
        new = acc.assign(tf.cast(g, acc.dtype))
    else:
        new = acc.assign_add(tf.cast(g, acc.dtype))
    return tf.reduce_all(tf.math.is_finite(new))


def _all(flags: list[tf.Tensor]) -> tf.Tensor:
    return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)


@dataclass
class _Stash:
    inputs: list[tf.Tensor]
    recv: list[tf.Tensor]
    tape: tf.GradientTape | None = None
    sends: list[tf.Tensor] | None = None
    state: list[tf.Tensor] | None = None
    recv_grads: list[tf.Tensor] | None = None
    slots: list[tf.Tensor] | None = None  # [Note: split stages]
    xs: list[tf.Tensor] | None = None


@dataclass
class _WeightWork:
    """What a split stage's ``W`` needs: deferred layers' inputs and pre-activation gradients,
    and B's gradients of deferred variables that other ops also read."""

    xs: list[tf.Tensor]
    dys: list[tf.Tensor]
    extras: dict[int, tf.Tensor]


class StageProgram:
    """The compiled forward/backward of one stage. See the module docstring."""

    def __init__(
        self,
        traced: Any,
        plan: StagePlan,
        stage: int,
        *,
        optimize: str = "memory",
        loss: Callable[..., tf.Tensor] | None = None,
        jit_compile: bool = False,
        relax_shapes: bool = False,
        split: bool = False,
        loss_scaler: Callable[[tf.Tensor], tf.Tensor] | None = None,
    ) -> None:
        self.stage = stage
        self.is_last = stage == plan.num_stages - 1
        self.optimize = optimize
        self.traced = traced
        names = set(plan.layers(stage))
        self.calls = [c for c in traced.calls if c.layer_name in names]
        read = {k for c in self.calls for k in c.input_keys}
        self.input_keys = [k for k in traced.input_keys if k in read]
        self.recv: list[Boundary] = plan.recv_boundaries(stage)
        self.send: list[Boundary] = plan.send_boundaries(stage)
        self.output_keys = list(traced.output_keys) if self.is_last else []
        self.trainable = [v for v in traced.variables_of(names) if v.trainable]
        self.non_trainable = [v for v in traced.variables_of(names) if not v.trainable]
        self.accumulators = [
            tf.Variable(tf.zeros(v.shape, dtype=v.dtype), trainable=False,
                        name=f"acc_{stage}_{i}") for i, v in enumerate(self.trainable)]
        # [Note: fresh accumulators] The first microbatch of a step *assigns* its weight
        # gradients and later ones add to them, so accumulators are never zeroed: 0 + g == g
        # exactly, and this saves a read and a write of every gradient per step.
        self.fresh = True
        self.fresh_w = True  # the same for the deferred half ([Note: split stages])
        # [Note: sparse gradients] Embedding-like layers get tf.IndexedSlices gradients, which
        # Keras optimizers apply lazily (only the rows present). Accumulating them densely would
        # change Adam's result, so their (values, indices) are kept per microbatch and
        # concatenated in batch order; the full batch's IndexedSlices is exactly that.
        self.sparse_parts: dict[int, list[tuple[tf.Tensor, tf.Tensor]]] = {}
        self._diff_recv = [i for i, b in enumerate(self.recv) if is_differentiable(b.dtype)]
        self._diff_send = [i for i, b in enumerate(self.send) if is_differentiable(b.dtype)]
        self._loss = loss
        self._stash: dict[int, _Stash] = {}
        self.scale = tf.Variable(1.0, trainable=False, dtype=tf.float32, name=f"scale_{stage}")
        self.loss_scaler = loss_scaler  # mixed_float16: the optimizer's scale_loss
        # [Note: relaxed shapes] With inputs whose shapes vary between batches (sequence
        # lengths), a program traces for the first shape and once more, with the varying
        # dimensions relaxed to None, at the second; every later shape, new or seen, reuses a
        # trace (what Keras's own train function does). Static models keep exact-shape traces.
        def compile_fn(f: Callable[..., Any]) -> Any:
            return tf.function(f, jit_compile=jit_compile or None, reduce_retracing=relax_shapes)

        self._fwd = compile_fn(self._forward_fn)
        self._bwd_recompute = compile_fn(self._backward_recompute_fn)
        self._fused = compile_fn(self._fused_fn)
        self._eval = compile_fn(self._eval_fn)
        self._fwd_split = compile_fn(self._forward_split_fn)
        self._weight = compile_fn(self._weight_fn)
        self._accumulate = tf.function(self._accumulate_fn)
        self._flags: list[tuple[int, tf.Tensor]] = []  # [Note: finite flags]
        # [Note: collect mode] `@smp.step` returns every microbatch's gradients (StepOutput),
        # so with `collect` set the weight gradients are kept per microbatch, not summed.
        self.collect = False
        self.collected: dict[int, list[tf.Tensor]] = {}
        # [Note: split stages]: set when the schedule gives this stage W actions
        self.split = split
        self._weight_work: dict[int, _WeightWork] = {}
        self._slot_cache: dict[tuple[Any, ...], list[tf.Tensor]] = {}
        self._deferred_layers: list[Any] | None = None
        self._deferred_vars: list[int] = []  # trainable index of each deferred (variable, call)
        self._deferred: frozenset[int] = frozenset()
        self._index = {id(v): i for i, v in enumerate(self.trainable)}

    # -- the graph interpreter -----------------------------------------------------------------

    def _run(self, inputs: list[tf.Tensor], recv: list[tf.Tensor], training: bool
             ) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        env: dict[str, Any] = dict(zip(self.input_keys, inputs))
        env.update(zip((b.tensor for b in self.recv), recv))
        for call in self.calls:
            call.run(env, training=training)
        return [env[b.tensor] for b in self.send], [env[k] for k in self.output_keys]

    def _sources(self, recv: list[tf.Tensor], slots: list[tf.Tensor] | None = None) -> list[Any]:
        return ([v.value for v in self.trainable] + [recv[i] for i in self._diff_recv]
                + list(slots or []))

    def _split_grads(self, grads: list[Any], recv: list[tf.Tensor], collect: bool = False,
                     first: bool = False, defer: bool = False
                     ) -> tuple[list[tf.Tensor], Any, Any, tf.Tensor]:
        """Accumulates dense weight gradients (``first``: assigns them, [Note: fresh
        accumulators]) except deferred ones ([Note: split stages]); returns gradients for every
        received boundary, the sparse ones as ``{str(variable index): (values, indices)}`` (with
        ``collect``: the list of all weight gradients of this microbatch instead), B's
        gradients of deferred variables (``{str(index): gradient}``, only those another op
        reads) and the finite flag of the accumulators written."""
        n = len(self.trainable)
        deferred_vars = self._deferred if defer else frozenset()
        out = [tf.zeros_like(r) for r in recv]
        for j, i in enumerate(self._diff_recv):
            out[i] = tf.convert_to_tensor(grads[n + j])
        if collect:
            return out, [tf.convert_to_tensor(g) for g in grads[:n]], {}, tf.constant(True)
        sparse: dict[str, tuple[tf.Tensor, tf.Tensor]] = {}
        extras: dict[str, tf.Tensor] = {}
        flags: list[tf.Tensor] = []
        for i, (acc, g) in enumerate(zip(self.accumulators, grads[:n])):
            if i in deferred_vars:
                if g is not None:
                    extras[str(i)] = tf.convert_to_tensor(g)
            elif g is None:
                flags.append(_accumulate_into(acc, tf.zeros_like(acc), first))
            elif isinstance(g, tf.IndexedSlices):
                sparse[str(i)] = (tf.cast(g.values, acc.dtype), g.indices)
            else:
                flags.append(_accumulate_into(acc, g, first))
        return out, sparse, extras, _all(flags)

    def _keep_sparse(self, sparse: dict[str, tuple[tf.Tensor, tf.Tensor]]) -> None:
        for key, part in sparse.items():
            self.sparse_parts.setdefault(int(key), []).append(part)

    @staticmethod
    def _unconnected(defer: bool) -> tf.UnconnectedGradients:
        """ZERO unsplit; NONE when split, so B can tell which deferred variables other ops read."""
        return tf.UnconnectedGradients.NONE if defer else tf.UnconnectedGradients.ZERO

    # -- compiled functions --------------------------------------------------------------------

    def _forward_fn(self, inputs: list[tf.Tensor], recv: list[tf.Tensor], training: bool
                    ) -> list[tf.Tensor]:
        return self._run(inputs, recv, training)[0]

    def _forward_split_fn(self, inputs: list[tf.Tensor], recv: list[tf.Tensor],
                          slots: list[tf.Tensor], training: bool
                          ) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        with deferred.recording(slots, self._owns) as rec:
            sends = self._run(inputs, recv, training)[0]
        return sends, rec.xs

    def _backward_recompute_fn(self, inputs: list[tf.Tensor], recv: list[tf.Tensor],
                               dys: list[tf.Tensor], state: list[tf.Tensor], collect: bool,
                               first: bool, slots: list[tf.Tensor] | None = None) -> Any:
        current = [tf.identity(v.value) for v in self.non_trainable]
        for v, s in zip(self.non_trainable, state):
            v.assign(s)
        with tf.GradientTape() as tape:
            tape.watch([recv[i] for i in self._diff_recv] + list(slots or []))
            with deferred.recording(slots, self._owns) if slots is not None else _nothing() as rec:
                sends, _ = self._run(inputs, recv, True)
        grads = tape.gradient([sends[i] for i in self._diff_send], self._sources(recv, slots),
                              output_gradients=[dys[i] for i in self._diff_send],
                              unconnected_gradients=self._unconnected(slots is not None))
        for v, c in zip(self.non_trainable, current):
            v.assign(c)
        k = len(self.trainable) + len(self._diff_recv)
        split = self._split_grads(grads[:k], recv, collect, first, defer=slots is not None)
        if slots is None:
            return split
        return (*split, rec.xs, _zeros_for_none(grads[k:], slots))  # type: ignore[union-attr]

    def _fused_fn(self, inputs: list[tf.Tensor], recv: list[tf.Tensor], y: Any, sample_weight: Any,
                  first: bool, slots: list[tf.Tensor] | None = None) -> Any:
        with tf.GradientTape() as tape:
            tape.watch([recv[i] for i in self._diff_recv] + list(slots or []))
            with deferred.recording(slots, self._owns) if slots is not None else _nothing() as rec:
                _, outputs = self._run(inputs, recv, True)
            loss = self._loss(y, self.traced.pack_outputs(outputs), sample_weight)  # type: ignore[misc]
            scaled = tf.cast(loss, tf.float32) * self.scale
            if self.loss_scaler is not None:
                scaled = self.loss_scaler(scaled)
        grads = tape.gradient(scaled, self._sources(recv, slots),
                              unconnected_gradients=self._unconnected(slots is not None))
        k = len(self.trainable) + len(self._diff_recv)
        split = self._split_grads(grads[:k], recv, first=first, defer=slots is not None)
        if slots is None:
            return loss, outputs, split
        return loss, outputs, split, rec.xs, _zeros_for_none(grads[k:], slots)  # type: ignore[union-attr]

    def _eval_fn(self, inputs: list[tf.Tensor], recv: list[tf.Tensor], training: bool = False
                 ) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        return self._run(inputs, recv, training)

    def _accumulate_fn(self, grads: list[tf.Tensor | None], first: bool) -> tf.Tensor:
        return _all([_accumulate_into(acc, g, first)
                     for acc, g in zip(self.accumulators, grads) if g is not None])

    def _weight_fn(self, xs: list[tf.Tensor], dys: list[tf.Tensor], extras: dict[str, tf.Tensor],
                   first: bool) -> tf.Tensor:
        """W of one microbatch: the deferred layers' weight gradients into their accumulators."""
        sums: dict[int, tf.Tensor] = {int(k): g for k, g in extras.items()}
        pairs = deferred.weight_gradients(self._deferred_layers or [], xs, dys)
        for i, (_, g) in zip(self._deferred_vars, pairs):
            sums[i] = sums[i] + g if i in sums else g
        return _all([_accumulate_into(self.accumulators[i], sums[i], first) for i in sorted(sums)])

    def _take_fresh(self) -> bool:
        """Whether this microbatch is the step's first to write the accumulators (and from now
        on, not)."""
        first, self.fresh = self.fresh, False
        return first

    # -- split stages --------------------------------------------------------------------------

    def _splitting(self) -> bool:
        return self.split and not self.collect

    def _slots(self, inputs: list[tf.Tensor], recv: list[tf.Tensor]) -> list[tf.Tensor]:
        """Zero slots of this microbatch's input shapes ([Note: split backward])."""
        key = tuple((tuple(t.shape), t.dtype) for t in (*inputs, *recv))
        slots = self._slot_cache.get(key)
        if slots is None:
            if len(self._slot_cache) >= 8:  # varying lengths: bound what is kept
                self._slot_cache.clear()
            deferred.install()
            rec = deferred.discover(lambda: self._run(inputs, recv, True), self._owns)
            self._adopt(rec.layers)
            slots = self._slot_cache[key] = [tf.zeros(s, d) for s, d in zip(rec.shapes, rec.dtypes)]
        return slots

    def _owns(self, layer: Any) -> bool:
        """Whether this stage trains the layer's kernel and bias (a layer whose weights live
        elsewhere, a tied copy say, keeps its weight gradient in B)."""
        return all(id(v) in self._index for v in (layer._kernel, layer.bias) if v is not None)

    def _adopt(self, layers: list[Any]) -> None:
        """Maps the deferred calls' kernels and biases onto this stage's trainable variables."""
        if self._deferred_layers is not None:
            if len(layers) != len(self._deferred_layers) or any(
                    a is not b for a, b in zip(layers, self._deferred_layers)):
                raise StepError(
                    f"A split stage must call the same linear layers for every batch shape. "
                    f"Received: stage {self.stage} called {[x.name for x in layers]}, earlier "
                    f"{[x.name for x in self._deferred_layers]}. Use pipeline='interleaved' "
                    f"for this model.")
            return
        order = [self._index[id(v)] for layer in layers
                 for v in (layer._kernel, layer.bias) if v is not None]
        self._deferred_layers = list(layers)
        self._deferred_vars = order
        self._deferred = frozenset(order)

    def _defer(self, i: int, xs: list[tf.Tensor], dys: list[tf.Tensor], extras: dict[str, Any]
               ) -> None:
        self._weight_work[i] = _WeightWork(list(xs), list(dys),
                                           {int(k): g for k, g in extras.items()})

    # -- what the executor calls ---------------------------------------------------------------

    def forward(self, i: int, inputs: list[tf.Tensor], recv: list[tf.Tensor]) -> list[tf.Tensor]:
        """Training forward of microbatch ``i``; returns the tensors to send (boundary order)."""
        slots = self._slots(inputs, recv) if self._splitting() else None
        if self.optimize == "speed":
            tape = tf.GradientTape()
            with tape:
                tape.watch([recv[i2] for i2 in self._diff_recv] + list(slots or []))
                if slots is None:
                    sends, xs = self._fwd(inputs, recv, True), None
                else:
                    sends, xs = self._fwd_split(inputs, recv, slots, True)
            self._stash[i] = _Stash(inputs, recv, tape=tape, sends=sends, slots=slots, xs=xs)
            return list(sends)
        state = [tf.identity(v.value) for v in self.non_trainable]
        sends = self._fwd(inputs, recv, True)
        self._stash[i] = _Stash(inputs, recv, state=state, slots=slots)
        return list(sends)

    def backward(self, i: int, dys: list[tf.Tensor]) -> list[tf.Tensor]:
        """Backward of microbatch ``i`` given gradients for the sent tensors; returns gradients
        for the received tensors (boundary order) and accumulates weight gradients (on a split
        stage only those of layers that are not deferred, [Note: split stages])."""
        st = self._stash.pop(i)
        if st.recv_grads is not None:  # fused last stage: already done in forward
            return st.recv_grads
        if st.tape is not None:
            return self._backward_taped(i, st, dys)
        slots = st.slots
        first = False if self.collect else self._take_fresh()
        result = self._bwd_recompute(st.inputs, st.recv, dys, st.state or [], self.collect,
                                     first, slots)
        recv_grads, extra, extras, flag = result[:4]
        if self.collect:
            self.collected[i] = list(extra)
            return list(recv_grads)
        self._keep_sparse(extra)
        self._flags.append((i, flag))
        if slots is not None:
            self._defer(i, result[4], result[5], extras)
        return list(recv_grads)

    def _backward_taped(self, i: int, st: _Stash, dys: list[tf.Tensor]) -> list[tf.Tensor]:
        sends = st.sends or []
        slots = st.slots or []
        grads = st.tape.gradient(  # type: ignore[union-attr]
            [sends[j] for j in self._diff_send], self._sources(st.recv, slots),
            output_gradients=[dys[j] for j in self._diff_send],
            unconnected_gradients=self._unconnected(bool(slots)))
        n = len(self.trainable)
        k = n + len(self._diff_recv)
        out = [tf.zeros_like(r) for r in st.recv]
        for j, r in enumerate(self._diff_recv):
            out[r] = tf.convert_to_tensor(grads[n + j])
        if self.collect:
            self.collected[i] = [tf.convert_to_tensor(g) for g in grads[:n]]
            return out
        dense: list[Any] = []
        extras: dict[str, Any] = {}
        for r, g in enumerate(grads[:n]):
            if r in self._deferred and slots:
                if g is not None:
                    extras[str(r)] = g
                dense.append(None)
            elif g is None:
                dense.append(tf.zeros_like(self.accumulators[r]))
            elif isinstance(g, tf.IndexedSlices):
                self._keep_sparse({str(r): (tf.cast(g.values, self.accumulators[r].dtype),
                                            g.indices)})
                dense.append(None)
            else:
                dense.append(g)
        if any(g is not None for g in dense):
            self._flags.append((i, self._accumulate(dense, self._take_fresh())))
        if slots:
            self._defer(i, st.xs or [], _zeros_for_none(grads[k:], slots), extras)
        return out

    def weight(self, i: int) -> None:
        """``W`` of microbatch ``i`` ([Note: split stages]); a no-op when its backward was whole
        (an unsplit stage, or `smp.step`'s collect mode)."""
        work = self._weight_work.pop(i, None)
        if work is None or self._deferred_layers is None:
            return
        first, self.fresh_w = self.fresh_w, False
        extras = {str(k): g for k, g in work.extras.items()}
        self._flags.append((i, self._weight(work.xs, work.dys, extras, first)))

    def forward_backward_last(self, i: int, inputs: list[tf.Tensor], recv: list[tf.Tensor],
                              y: Any, sample_weight: Any) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """Last stage: forward, loss and backward in one call. Returns (loss, model outputs)."""
        slots = self._slots(inputs, recv) if self._splitting() else None
        result = self._fused(inputs, recv, y, sample_weight, self._take_fresh(), slots)
        loss, outputs, (recv_grads, sparse, extras, flag) = result[:3]
        self._keep_sparse(sparse)
        self._flags.append((i, flag))
        if slots is not None:
            self._defer(i, result[3], result[4], extras)
        self._stash[i] = _Stash(inputs, recv, recv_grads=list(recv_grads))
        return loss, list(outputs)

    def evaluate(self, inputs: list[tf.Tensor], recv: list[tf.Tensor], training: bool = False
                 ) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        """Forward without stashing: (tensors to send, model outputs on the last stage).
        Under a caller's GradientTape this is differentiable (used by `smp.step`'s last stage)."""
        sends, outputs = self._eval(inputs, recv, training)
        return list(sends), list(outputs)

    def diff_recv(self, recv: list[tf.Tensor]) -> list[tf.Tensor]:
        """The received tensors that carry gradients (floating point), in boundary order."""
        return [recv[i] for i in self._diff_recv]

    def finish_head(self, i: int, inputs: list[tf.Tensor], recv: list[tf.Tensor],
                    diff_grads: list[tf.Tensor | None]) -> None:
        """Stores the gradients a custom last-stage head computed for the received tensors."""
        out = [tf.zeros_like(r) for r in recv]
        for j, k in enumerate(self._diff_recv):
            g = diff_grads[j] if j < len(diff_grads) else None
            if g is not None:
                out[k] = tf.convert_to_tensor(g)
        self._stash[i] = _Stash(inputs, recv, recv_grads=out)

    def begin_step(self, mode: StepMode) -> None:
        """Starts a step of kind ``mode`` ([Note: one driver] in hooks.py): the next microbatch
        overwrites the accumulators, each loss is scaled by ``mode.scale``, and in collect mode
        weight gradients are kept per microbatch."""
        self.reset_accumulators()
        self.collect = mode.collect
        self.scale.assign(mode.scale)

    def result(self) -> StageResult:
        """This step's finiteness, sparse gradient parts (the live lists: a reduction may
        replace them) and collected gradients."""
        finite, first = self.finite_status()
        return StageResult(self.stage, finite, first, self.sparse_parts, dict(self.collected))

    def reset_accumulators(self) -> None:
        """Starts a new step: the next microbatch overwrites the accumulators."""
        self.fresh = True
        self.fresh_w = True
        self.sparse_parts.clear()
        self._flags.clear()
        self._weight_work.clear()
        self.collected.clear()

    def finite_status(self) -> tuple[bool, int | None]:
        """(whether every accumulator is finite after this step's microbatches, the first
        microbatch after whose accumulation one was not) from [Note: finite flags]."""
        if not self._flags:
            return True, None
        values = tf.stack([f for _, f in self._flags]).numpy()
        if values.all():
            return True, None
        return False, min(i for (i, _), ok in zip(self._flags, values) if not ok)

    def sparse_gradients(self) -> dict[int, tuple[tf.Tensor, tf.Tensor]]:
        """``{variable index: (values, indices)}`` of this step, rows in batch order."""
        return concat_sparse(self.sparse_parts)

    def held_microbatches(self) -> int:
        """Microbatches whose activations this stage holds: from forward until backward, or
        until ``W`` on a split stage."""
        return len(self._stash.keys() | self._weight_work.keys())


def concat_sparse(parts: dict[int, list[tuple[Any, Any]]]) -> dict[int, tuple[tf.Tensor, tf.Tensor]]:
    """Sparse gradient parts (``{variable index: [(values, indices), ...]}``) as one
    ``(values, indices)`` per variable, rows in the parts' order."""
    return {i: (tf.concat([v for v, _ in ps], 0), tf.concat([x for _, x in ps], 0))
            for i, ps in parts.items()}


def _zeros_for_none(grads: list[Any], like: list[tf.Tensor]) -> list[tf.Tensor]:
    """A slot's gradient is None when nothing after its layer reaches the stage's outputs."""
    return [tf.zeros_like(s) if g is None else tf.convert_to_tensor(g) for g, s in zip(grads, like)]


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield None
