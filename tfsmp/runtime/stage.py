"""Compiled programs of one pipeline stage: forward, backward and the fused last stage.

Example::

    program = StageProgram(traced, plan, stage=1, optimize="memory", loss=loss_fn, scale=1/8)
    sends = program.forward(0, inputs, recv)       # stashes what backward needs
    grads_to_producers = program.backward(0, dys)  # accumulates dW into program.accumulators

[Note: stashing] ``optimize: speed`` keeps the GradientTape of every microbatch in flight, so
backward replays the forward function's stored activations (DESIGN.md: 1.23× the fused floor);
``optimize: memory`` keeps only the stage's input tensors and recomputes the forward inside a
compiled backward (1.49×). The last stage fuses forward, loss and backward in one compiled call.

[Note: recompute state] A recomputed forward must see the state the original forward saw:
dropout seed-generator states, and BatchNormalization moving statistics must not be updated
twice. Backward in memory mode therefore sets the stage's non-trainable variables to the values
they had before that microbatch's forward, recomputes, and then puts back the current values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from tfsmp.partitioning.plan import Boundary, StagePlan

__all__ = ["StageProgram", "is_differentiable"]


def is_differentiable(dtype: str) -> bool:
    return dtype in ("float16", "bfloat16", "float32", "float64")


def _accumulate_into(acc: tf.Variable, g: tf.Tensor, first: bool) -> None:
    """``acc = g`` for the step's first microbatch, else ``acc += g`` ([Note: fresh
    accumulators])."""
    if first:
        acc.assign(tf.cast(g, acc.dtype))
    else:
        acc.assign_add(tf.cast(g, acc.dtype))


@dataclass
class _Stash:
    inputs: list[tf.Tensor]
    recv: list[tf.Tensor]
    tape: tf.GradientTape | None = None
    sends: list[tf.Tensor] | None = None
    state: list[tf.Tensor] | None = None
    recv_grads: list[tf.Tensor] | None = None


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
        self.loss_scaler: Callable[[tf.Tensor], tf.Tensor] | None = None  # mixed_float16
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
        self._accumulate = tf.function(self._accumulate_fn)
        self._finite = tf.function(self._finite_fn)
        self.nonfinite_microbatch: int | None = None  # first microbatch with non-finite grads
        self.track_finite = True  # per-microbatch check; pointless (skipped) with one microbatch
        # [Note: collect mode] `@smp.step` returns every microbatch's gradients (StepOutput),
        # so with `collect` set the weight gradients are kept per microbatch, not summed.
        self.collect = False
        self.collected: dict[int, list[tf.Tensor]] = {}

    # -- the graph interpreter -----------------------------------------------------------------

    def _run(self, inputs: list[tf.Tensor], recv: list[tf.Tensor], training: bool
             ) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        env: dict[str, Any] = dict(zip(self.input_keys, inputs))
        env.update(zip((b.tensor for b in self.recv), recv))
        for call in self.calls:
            call.run(env, training=training)
        return [env[b.tensor] for b in self.send], [env[k] for k in self.output_keys]

    def _sources(self, recv: list[tf.Tensor]) -> list[Any]:
        return [v.value for v in self.trainable] + [recv[i] for i in self._diff_recv]

    def _split_grads(self, grads: list[Any], recv: list[tf.Tensor], collect: bool = False,
                     first: bool = False) -> tuple[list[tf.Tensor], Any]:
        """Accumulates dense weight gradients (``first``: assigns them, [Note: fresh
        accumulators]); returns gradients for every received boundary and the sparse ones as
        ``{str(variable index): (values, indices)}`` (with ``collect``: the list of all weight
        gradients of this microbatch instead)."""
        n = len(self.trainable)
        sparse: dict[str, tuple[tf.Tensor, tf.Tensor]] = {}
        if collect:
            out = [tf.zeros_like(r) for r in recv]
            for j, i in enumerate(self._diff_recv):
                out[i] = tf.convert_to_tensor(grads[n + j])
            return out, [tf.convert_to_tensor(g) for g in grads[:n]]
        for i, (acc, g) in enumerate(zip(self.accumulators, grads[:n])):
            if isinstance(g, tf.IndexedSlices):
                sparse[str(i)] = (tf.cast(g.values, acc.dtype), g.indices)
            else:
                _accumulate_into(acc, g, first)
        out = [tf.zeros_like(r) for r in recv]
        for j, i in enumerate(self._diff_recv):
            out[i] = tf.convert_to_tensor(grads[n + j])
        return out, sparse

    def _keep_sparse(self, sparse: dict[str, tuple[tf.Tensor, tf.Tensor]]) -> None:
        for key, part in sparse.items():
            self.sparse_parts.setdefault(int(key), []).append(part)

    # -- compiled functions --------------------------------------------------------------------

    def _forward_fn(self, inputs: list[tf.Tensor], recv: list[tf.Tensor], training: bool
                    ) -> list[tf.Tensor]:
        return self._run(inputs, recv, training)[0]

    def _backward_recompute_fn(self, inputs: list[tf.Tensor], recv: list[tf.Tensor],
                               dys: list[tf.Tensor], state: list[tf.Tensor], collect: bool,
                               first: bool) -> Any:
        current = [tf.identity(v.value) for v in self.non_trainable]
        for v, s in zip(self.non_trainable, state):
            v.assign(s)
        with tf.GradientTape() as tape:
            tape.watch([recv[i] for i in self._diff_recv])
            sends, _ = self._run(inputs, recv, True)
        grads = tape.gradient([sends[i] for i in self._diff_send], self._sources(recv),
                              output_gradients=[dys[i] for i in self._diff_send],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        for v, c in zip(self.non_trainable, current):
            v.assign(c)
        return self._split_grads(grads, recv, collect, first)

    def _fused_fn(self, inputs: list[tf.Tensor], recv: list[tf.Tensor], y: Any, sample_weight: Any,
                  first: bool) -> tuple[tf.Tensor, list[tf.Tensor], Any]:
        with tf.GradientTape() as tape:
            tape.watch([recv[i] for i in self._diff_recv])
            _, outputs = self._run(inputs, recv, True)
            loss = self._loss(y, self.traced.pack_outputs(outputs), sample_weight)  # type: ignore[misc]
            scaled = tf.cast(loss, tf.float32) * self.scale
            if self.loss_scaler is not None:
                scaled = self.loss_scaler(scaled)
        grads = tape.gradient(scaled, self._sources(recv),
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return loss, outputs, self._split_grads(grads, recv, first=first)

    def _eval_fn(self, inputs: list[tf.Tensor], recv: list[tf.Tensor], training: bool = False
                 ) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        return self._run(inputs, recv, training)

    def _finite_fn(self) -> tf.Tensor:
        flags = [tf.reduce_all(tf.math.is_finite(a)) for a in self.accumulators]
        return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)

    def _note_finite(self, i: int) -> None:
        """Remembers the first microbatch after which accumulated gradients are not finite."""
        if self.track_finite and self.nonfinite_microbatch is None and not bool(self._finite()):
            self.nonfinite_microbatch = i

    def _accumulate_fn(self, grads: list[tf.Tensor], first: bool) -> None:
        for acc, g in zip(self.accumulators, grads):
            if g is not None:
                _accumulate_into(acc, g, first)

    def _take_fresh(self) -> bool:
        """Whether this microbatch is the step's first to write the accumulators (and from now
        on, not)."""
        first, self.fresh = self.fresh, False
        return first

    # -- what the executor calls ---------------------------------------------------------------

    def forward(self, i: int, inputs: list[tf.Tensor], recv: list[tf.Tensor]) -> list[tf.Tensor]:
        """Training forward of microbatch ``i``; returns the tensors to send (boundary order)."""
        if self.optimize == "speed":
            tape = tf.GradientTape()
            with tape:
                tape.watch([recv[i2] for i2 in self._diff_recv])
                sends = self._fwd(inputs, recv, True)
            self._stash[i] = _Stash(inputs, recv, tape=tape, sends=sends)
            return list(sends)
        state = [tf.identity(v.value) for v in self.non_trainable]
        sends = self._fwd(inputs, recv, True)
        self._stash[i] = _Stash(inputs, recv, state=state)
        return list(sends)

    def backward(self, i: int, dys: list[tf.Tensor]) -> list[tf.Tensor]:
        """Backward of microbatch ``i`` given gradients for the sent tensors; returns gradients
        for the received tensors (boundary order) and accumulates weight gradients."""
        st = self._stash.pop(i)
        if st.recv_grads is not None:  # fused last stage: already done in forward
            return st.recv_grads
        if st.tape is not None:
            sends = st.sends or []
            grads = st.tape.gradient([sends[j] for j in self._diff_send], self._sources(st.recv),
                                     output_gradients=[dys[j] for j in self._diff_send],
                                     unconnected_gradients=tf.UnconnectedGradients.ZERO)
            n = len(self.trainable)
            if self.collect:
                self.collected[i] = [tf.convert_to_tensor(g) for g in grads[:n]]
                out = [tf.zeros_like(r) for r in st.recv]
                for j, k in enumerate(self._diff_recv):
                    out[k] = tf.convert_to_tensor(grads[n + j])
                return out
            dense: list[Any] = []
            for k, g in enumerate(grads[:n]):
                if isinstance(g, tf.IndexedSlices):
                    self._keep_sparse({str(k): (tf.cast(g.values, self.accumulators[k].dtype),
                                                g.indices)})
                    dense.append(None)
                else:
                    dense.append(g)
            if n:
                self._accumulate(dense, self._take_fresh())
            self._note_finite(i)
            out = [tf.zeros_like(r) for r in st.recv]
            for j, k in enumerate(self._diff_recv):
                out[k] = tf.convert_to_tensor(grads[n + j])
            return out
        first = False if self.collect else self._take_fresh()
        recv_grads, extra = self._bwd_recompute(st.inputs, st.recv, dys, st.state or [],
                                                self.collect, first)
        if self.collect:
            self.collected[i] = list(extra)
            return list(recv_grads)
        self._keep_sparse(extra)
        self._note_finite(i)
        return list(recv_grads)

    def forward_backward_last(self, i: int, inputs: list[tf.Tensor], recv: list[tf.Tensor],
                              y: Any, sample_weight: Any) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """Last stage: forward, loss and backward in one call. Returns (loss, model outputs)."""
        loss, outputs, (recv_grads, sparse) = self._fused(inputs, recv, y, sample_weight,
                                                          self._take_fresh())
        self._keep_sparse(sparse)
        self._note_finite(i)
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

    def reset_accumulators(self) -> None:
        """Starts a new step: the next microbatch overwrites the accumulators."""
        self.fresh = True
        self.sparse_parts.clear()
        self.nonfinite_microbatch = None
        self.collected.clear()

    def sparse_gradients(self) -> dict[int, tuple[tf.Tensor, tf.Tensor]]:
        """``{variable index: (values, indices)}`` of this step, rows in batch order."""
        return {i: (tf.concat([v for v, _ in parts], 0), tf.concat([x for _, x in parts], 0))
                for i, parts in self.sparse_parts.items()}

    def held_microbatches(self) -> int:
        return len(self._stash)
