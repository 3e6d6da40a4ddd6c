"""Runs one rank's lowered schedule: a dispatch table from action to handler.

Example::

    ex = Executor(lowered.actions[rank], programs, plan, comm.pipeline, 2, 4,
                  placement=lowered.placement)
    result = ex.run(microbatches, mode=StepMode(train=True), hooks=engine)

[Note: plan and step] An executor holds what one schedule needs on every step: the actions, the
programs, the message plan and the receive-buffer pool. What one step makes (received and
produced tensors, posted receives, pending sends, the result) lives in a `_Step` made by `run`,
so no step reads another's leftovers.

[Note: pre-posted receives] Before the first action of a step, every receive of the step is
posted (``Irecv`` into a fresh buffer) and every send is non-blocking. Large messages travel by
MPI's rendezvous protocol, so a sender would otherwise stall until its peer reached the matching
receive (measured on a 2-stage prototype, 16 steps at batch 512: 2.97 s without pre-posting,
2.04 s with it, 1.98 s in one process).
With all receives posted, a schedule whose receives are satisfiable in order cannot deadlock,
which is what the schedule validator checks.

[Note: tags] A message is one boundary tensor of one microbatch in one direction; its tag comes
from `tfsmp.schedule.actions.message_tag` (boundary index, consumer stage, microbatch, direction),
which every rank computes identically from the plan. Stage pairs on the same rank (virtual
stages) hand tensors over in memory under the same key. A boundary whose shape is known only at
run time also sends a shape header, tagged ``tag_upper_bound(...) + tag`` ([Note: dynamic
boundaries] in `dynamic_shapes.py`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from tfsmp.comm.base import Group, Request, testall
from tfsmp.errors import StepError
from tfsmp.partitioning.plan import Boundary, StagePlan
from tfsmp.runtime import watchdog as wd
from tfsmp.runtime.buffers import ReceivePool, aligned_empty, as_tensor, held, host_view, wire
from tfsmp.runtime.dynamic_shapes import BoundaryShapes, is_dynamic
from tfsmp.runtime.hooks import Head, LastStage, StageResult, StepHooks, StepMode
from tfsmp.runtime.stage import StageProgram, is_differentiable
from tfsmp.schedule.actions import Action, Op, message_tag, tag_upper_bound
from tfsmp.schedule.placement import Placement

if TYPE_CHECKING:
    from tfsmp.timeline.events import Tracer

# aligned_empty, as_tensor, held and host_view live in buffers.py; imported from here too
__all__ = ["Executor", "MicroBatch", "StepResult", "aligned_empty", "as_tensor", "held",
           "host_view"]


@dataclass
class MicroBatch:
    """One microbatch as the stages see it: model inputs by tensor key, targets, weights."""

    inputs: dict[str, Any]
    y: Any = None
    sample_weight: Any = None
    size: int = 0
    consts: Any = None  # the microbatch's constants vector (`tfsmp.runtime.objective.Consts`)


@dataclass
class StepResult:
    # microbatch -> (loss numerators, normalizers, layer loss) of the last stage (training)
    records: dict[int, tuple[Any, Any, Any]] = field(default_factory=dict)
    outputs: dict[int, list[tf.Tensor]] = field(default_factory=dict)  # microbatch -> outputs
    layer_losses: dict[int, Any] = field(default_factory=dict)  # inference: microbatch -> sum
    microbatches: list[MicroBatch] = field(default_factory=list)  # what the step ran on
    loss: float = 0.0  # the batch's loss as Keras reports it (filled at STEP, or by evaluate)
    term_values: list[float] = field(default_factory=list)  # each compiled-loss term's value
    max_held: int = 0  # peak microbatches whose activations a rank held
    # training steps: what each of this rank's stages produced ([Note: one driver] in hooks.py)
    stages: dict[int, StageResult] = field(default_factory=dict)


_Key = tuple[Op, int, int, int]  # a receive: (RECV_F or RECV_B, stage, peer, microbatch)


def _mb(a: Action) -> int:
    """The microbatch of a per-microbatch action (the schedule's parser guarantees one)."""
    return a.microbatch  # type: ignore[return-value]


def _peer(a: Action) -> int:
    """The peer stage of a send or receive (the schedule's parser guarantees one)."""
    return a.peer  # type: ignore[return-value]


@dataclass(frozen=True)
class _Receive:
    """One receive action's messages, computed once per executor ([Note: message plan])."""

    key: _Key  # (receive op, stage, peer, microbatch), as in `_Step.posted`
    boundaries: list[Boundary]
    pool_keys: list[tuple[Any, ...]]
    tags: list[int]
    src: int
    consumer: int
    microbatch: int
    backward: bool


@dataclass
class _Pending:
    boundaries: list[Boundary]
    buffers: list[np.ndarray]
    requests: list[Request]
    headers: list[tuple[Boundary, np.ndarray]] = field(default_factory=list)
    header_requests: list[Request] = field(default_factory=list)


@dataclass
class _Step:
    """What one step makes ([Note: plan and step])."""

    microbatches: list[MicroBatch]
    mode: StepMode
    hooks: StepHooks | None
    head: Head | None
    result: StepResult
    mb_shapes: list[dict[int, tuple[int, ...]]] = field(default_factory=list)
    posted: dict[_Key, _Pending] = field(default_factory=dict)
    mailbox: dict[_Key, list[tf.Tensor]] = field(default_factory=dict)
    received: dict[tuple[int, int], dict[int, tf.Tensor]] = field(default_factory=dict)
    produced: dict[tuple[int, int], dict[int, tf.Tensor]] = field(default_factory=dict)
    grad_in: dict[tuple[int, int], dict[int, tf.Tensor]] = field(default_factory=dict)
    grad_out: dict[tuple[int, int], dict[int, tf.Tensor]] = field(default_factory=dict)
    sends: list[tuple[Request, np.ndarray]] = field(default_factory=list)


_POOL_SHAPES = 4  # distinct shapes per message whose buffers a dynamic-shape executor keeps


class Executor:
    """Executes one rank's actions for one step. See the module docstring."""

    def __init__(
        self,
        actions: list[Action],
        programs: dict[int, StageProgram],
        plan: StagePlan,
        group: Group,
        num_ranks: int,
        num_microbatches: int,
        *,
        placement: Placement,
        stall_timeout: float = 600.0,
        tracer: Tracer | None = None,
        rank_tag: str = "",
        shapes: BoundaryShapes | None = None,
    ) -> None:
        self.actions = actions
        self.programs = programs
        self.plan = plan
        self.group = group
        self.num_ranks = num_ranks
        self.placement = placement
        self.m = num_microbatches
        self.stall_timeout = stall_timeout
        self.tracer = tracer
        self.rank_tag = rank_tag
        self.current: Action | str | None = None  # what runs now (stall messages name it)
        self.step_state: _Step | None = None  # the running or last step ([Note: plan and step])
        self.watchdog = wd.for_process()  # None outside a multi-rank MPI job
        self._pairs: dict[tuple[int, int], list[Boundary]] = {}
        for b in plan.boundaries:
            for c in b.consumers:
                self._pairs.setdefault((b.producer, c), []).append(b)
        # [Note: dynamic boundaries]: None for a plan whose boundary shapes are all static
        self.shapes = shapes
        self._header_base = tag_upper_bound(
            max((b.index for b in plan.boundaries), default=-1) + 1, plan.num_stages, self.m)
        # [Note: message plan] Everything about a message that does not change between steps
        # (its boundaries, tags, peer rank, pool keys, numpy type, whether DLPack can alias it)
        # is computed once per executor; a step only picks buffers, posts and completes requests.
        self.pool = ReceivePool(plan.boundaries, _POOL_SHAPES * sum(
            len(self._pair(*((a.stage, _peer(a)) if a.op is Op.RECV_B else (_peer(a), a.stage)),
                           a.op is Op.RECV_B))
            for a in actions if a.op in (Op.RECV_F, Op.RECV_B)), dynamic=shapes is not None)
        self._receives: list[_Receive] | None = None  # on first use: subclasses may add actions
        self._send_tags: dict[_Key, tuple[int, list[int]]] = {}
        self._dispatch: dict[Op, Callable[[Action], None]] = {
            Op.FORWARD: self._forward, Op.BACKWARD: self._backward, Op.WEIGHT: self._weight,
            Op.SEND_F: self._send_forward, Op.RECV_F: self._recv_forward,
            Op.SEND_B: self._send_backward, Op.RECV_B: self._recv_backward,
            Op.REDUCE: self._reduce, Op.STEP: self._apply,
        }

    # -- helpers -------------------------------------------------------------------------------

    def _rank(self, stage: int) -> int:
        return self.placement.rank(stage)

    def _local(self, stage: int) -> bool:
        return bool(self._rank(stage) == self.group.rank)

    def _pair(self, producer: int, consumer: int, backward: bool) -> list[Boundary]:
        bs = self._pairs.get((producer, consumer), [])
        return [b for b in bs if is_differentiable(b.dtype)] if backward else bs

    def _tag(self, b: Boundary, consumer: int, mb: int, backward: bool) -> int:
        return message_tag(b.index, consumer, mb, backward, self.plan.num_stages, self.m)

    @property
    def _now(self) -> _Step:
        """The running step."""
        return self.step_state  # type: ignore[return-value]

    def _shape(self, b: Boundary, mb: int) -> tuple[int, ...]:
        """The full shape of boundary ``b`` in microbatch ``mb`` (batch axis first)."""
        if self.shapes is None:
            return (self._now.microbatches[mb].size, *b.shape)  # type: ignore[arg-type]
        return self._now.mb_shapes[mb][b.index]

    @property
    def _pool(self) -> dict[tuple[Any, ...], np.ndarray]:
        """The receive buffers by message ([Note: receive buffers] in buffers.py)."""
        return self.pool.buffers

    def _wait(self, requests: list[Request], what: str) -> None:
        """Waits for requests, polling so that a stall is diagnosed instead of hanging.

        [Note: polling] The first 50 ms of a wait only yield the core between tests (no added
        latency: a fixed sleep here cost ~1 ms per message); longer waits back off to 1 ms
        sleeps, so an idle rank does not starve a computing one on an oversubscribed host.
        Each poll tests all requests in one call (MPI ``Testall``). A blocking ``Waitall`` after
        a short spin measured no faster here (the two ranks' 256 KB ping-pong: 282 vs 264 us a
        round trip) and could not notice a stall, so the polling stays.
        """
        if testall(requests):  # one MPI call for the common case: already there
            return
        start = time.monotonic()
        deadline = start + self.stall_timeout if self.stall_timeout > 0 else None
        if self.watchdog is not None:
            self.watchdog.waiting(what)
        while True:
            now = time.monotonic()
            if now - start < 0.05:
                os.sched_yield()
            else:
                time.sleep(min(1e-3, (now - start) / 50))
            if testall(requests):
                return
            if deadline is not None and time.monotonic() > deadline:
                message = (
                    f"{self.rank_tag} waited more than stall_timeout={self.stall_timeout}s for "
                    f"{what} (action {self.current}). A peer rank is stuck or failed; see its "
                    f"output. Raise stall_timeout in the config if steps are legitimately slow.")
                if self.watchdog is not None:
                    self.watchdog.expire(message)  # prints every rank's action, aborts the job
                raise StepError(message)

    # -- a step --------------------------------------------------------------------------------

    def run(self, microbatches: list[MicroBatch], *, mode: StepMode,
            hooks: StepHooks | None = None, head: Head | None = None) -> StepResult:
        """Runs the actions once as a step of kind ``mode``; a training step starts every
        program with it and calls ``hooks`` at REDUCE and STEP ([Note: one driver] in hooks.py).
        ``head``, if given, runs each microbatch's last stage in place of its fused loss
        ([Note: the head] in hooks.py); what it returns is kept in ``result.outputs[i]``."""
        if self.step_state is not None and self.step_state.posted:  # ended early: still posted
            self.pool.reset()
        step = self.step_state = _Step(list(microbatches), mode, hooks, head,
                                 StepResult(microbatches=list(microbatches)))
        if mode.train:
            for prog in self.programs.values():
                prog.begin_step(mode)
        if self.shapes is not None:  # every rank alike, from the inputs, before any message
            step.mb_shapes = self._resolve_shapes(microbatches)
        dog = self.watchdog
        if dog is not None:
            dog.step_begin()
        self._post_receives()
        for action in self.actions:
            self.current = action
            if dog is not None:
                dog.update(action)
            if self.tracer is not None:
                with self.tracer.event(str(action), action.op.value):
                    self._dispatch[action.op](action)
            else:
                self._dispatch[action.op](action)
        self.current = "waiting for sends"
        self._wait([r for r, _ in step.sends], "sends to complete")
        step.sends.clear()
        if dog is not None:
            dog.step_end()
        if mode.train:  # stages without REDUCE or STEP actions (collect mode) report here
            for s in self.programs:
                self._stage_result(s)
        return step.result

    def _resolve_shapes(self, microbatches: list[MicroBatch]) -> list[dict[int, tuple[int, ...]]]:
        try:
            return [self.shapes.of(mb) for mb in microbatches]  # type: ignore[union-attr]
        except StepError as e:
            raise StepError(f"{self.rank_tag} {e}".strip()) from e

    def _post_receives(self) -> None:
        if self._receives is None:
            self._receives = self._plan_receives()
        irecv, dynamic = self.group.irecv, self.shapes is not None
        for r in self._receives:
            buffers = [self.pool.buffer(k, b, self._shape(b, r.microbatch))
                       for k, b in zip(r.pool_keys, r.boundaries)]
            reqs = [irecv(wire(buf), r.src, tag) for buf, tag in zip(buffers, r.tags)]
            pending = self._now.posted[r.key] = _Pending(r.boundaries, buffers, reqs)
            if dynamic and not r.backward:
                self._post_headers(pending, r.src, r.consumer, r.microbatch)

    def _plan_receives(self) -> list[_Receive]:
        """The step's receives from other ranks, in schedule order ([Note: message plan])."""
        out = []
        for a in self.actions:
            op = a.op
            if op not in (Op.RECV_F, Op.RECV_B) or self._local(_peer(a)):
                continue
            backward = op is Op.RECV_B
            peer, mb = _peer(a), _mb(a)
            producer, consumer = (a.stage, peer) if backward else (peer, a.stage)
            bs = self._pair(producer, consumer, backward)
            out.append(_Receive(
                (op, a.stage, peer, mb), bs,
                [(op.value, a.stage, peer, mb, b.index) for b in bs],
                [self._tag(b, consumer, mb, backward) for b in bs],
                self._rank(peer), consumer, mb, backward))
        return out

    def _post_headers(self, pending: _Pending, src: int, consumer: int, mb: int) -> None:
        """Receives the shape header of each dynamic boundary ([Note: dynamic boundaries])."""
        for b in pending.boundaries:
            if is_dynamic(b.shape):
                header = np.empty(len(b.shape) + 1, dtype=np.int64)
                pending.headers.append((b, header))
                pending.header_requests.append(self.group.irecv(
                    header, src, self._header_base + self._tag(b, consumer, mb, False)))

    def _check_headers(self, pending: _Pending, a: Action) -> None:
        """The shapes the sender sent must be those this rank computed from its own batch."""
        self._wait(pending.header_requests, f"shapes of microbatch {a.microbatch} from stage {a.peer}")
        for b, header in pending.headers:
            got, want = tuple(int(d) for d in header), self._shape(b, _mb(a))
            if got != want:
                raise StepError(
                    f"{self.rank_tag} Every rank of a pipeline must see batches of the same "
                    f"shapes. Received: stage {a.peer} sent '{b.tensor}' of microbatch "
                    f"{a.microbatch} with shape {got}; this rank's inputs give {want}. Feed every "
                    f"rank the same batches (same data, order and padding; seed any shuffling).")

    def _transmit(self, backward: bool, stage: int, peer: int, mb: int, bs: list[Boundary],
                  tensors: list[tf.Tensor], consumer: int) -> None:
        """Sends ``tensors`` (activations, or gradients if ``backward``) from ``stage`` to the
        receive of stage ``peer``: in memory when ``peer`` is on this rank."""
        receive = Op.RECV_B if backward else Op.RECV_F  # the peer's action that takes them
        if self._local(peer):
            self._now.mailbox[(receive, peer, stage, mb)] = tensors
            return
        key = (receive, stage, peer, mb)
        plan = self._send_tags.get(key)  # [Note: message plan]
        if plan is None:
            plan = self._send_tags[key] = (self._rank(peer), [
                self._tag(b, consumer, mb, backward) for b in bs])
        dest, tags = plan
        dynamic = self.shapes is not None and not backward
        isend, sends, dtypes = self.group.isend, self._now.sends, self.pool.dtypes
        for b, t, tag in zip(bs, tensors, tags):
            if dynamic and is_dynamic(b.shape):
                self._send_header(b, t, peer, mb, consumer)
            buf = wire(host_view(t, dtypes[b.index]))
            sends.append((isend(buf, dest, tag), buf))

    def _send_header(self, b: Boundary, t: tf.Tensor, peer: int, mb: int, consumer: int) -> None:
        """Checks a dynamic tensor against its resolved shape and sends that shape ahead."""
        want = self._shape(b, mb)
        if tuple(t.shape) != want:
            raise StepError(
                f"{self.rank_tag} A tensor crossing stages must have the shape its layers' "
                f"compute_output_spec gives for the batch's input shapes. Received: '{b.tensor}' "
                f"of microbatch {mb} has shape {tuple(t.shape)}, expected {want}. Fix that "
                f"layer's compute_output_spec (or compute_output_shape), or partition so that "
                f"this tensor stays inside one stage.")
        header = np.asarray(want, dtype=np.int64)
        req = self.group.isend(header, self._rank(peer),
                               self._header_base + self._tag(b, consumer, mb, False))
        self._now.sends.append((req, header))

    def _collect(self, a: Action) -> tuple[list[Boundary], list[tf.Tensor]]:
        """What the receive ``a`` (RECV_F or RECV_B) takes: its boundaries and tensors."""
        peer, mb, backward = _peer(a), _mb(a), a.op is Op.RECV_B
        key = (a.op, a.stage, peer, mb)
        if self._local(peer):
            producer, consumer = (a.stage, peer) if backward else (peer, a.stage)
            return self._pair(producer, consumer, backward), self._now.mailbox.pop(key)
        pending = self._now.posted.pop(key)
        if pending.header_requests:  # before the data, which a larger message would overrun
            self._check_headers(pending, a)
        if not testall(pending.requests):  # the message text only for a wait that waits
            self._wait(pending.requests, f"{'gradients' if backward else 'activations'} "
                       f"of microbatch {mb} from stage {peer}")
        tensor = self.pool.tensor  # pool buffers are aligned: `aligned_empty`
        return pending.boundaries, [tensor(b, buf)
                                    for b, buf in zip(pending.boundaries, pending.buffers)]

    # -- handlers ------------------------------------------------------------------------------

    def _recv_forward(self, a: Action) -> None:
        bs, ts = self._collect(a)
        self._now.received.setdefault((a.stage, _mb(a)), {}).update(
            (b.index, t) for b, t in zip(bs, ts))

    def _forward(self, a: Action) -> None:
        step, i = self._now, _mb(a)
        prog = self.programs[a.stage]
        mb = step.microbatches[i]
        inputs = [mb.inputs[k] for k in prog.input_keys]
        got = step.received.pop((a.stage, i), {})
        recv = [got[b.index] for b in prog.recv]
        result, train = step.result, step.mode.train
        sends: list[tf.Tensor]
        if prog.is_last and step.head is not None:
            result.outputs[i] = step.head(LastStage(prog, i, inputs, recv))
            sends = []
        elif prog.is_last and train:
            record, outputs = prog.forward_backward_last(i, inputs, recv, mb.y,
                                                         mb.sample_weight, mb.consts)
            result.records[i] = record
            result.outputs[i] = outputs
            sends = []
        elif train:
            sends = prog.forward(i, inputs, recv, mb.consts)
            result.max_held = max(result.max_held, prog.held_microbatches())
        else:
            out = prog.evaluate(inputs, recv, consts=mb.consts)
            sends = out.sends
            if prog.is_last:
                result.outputs[i] = out.outputs
            mine = result.layer_losses
            mine[i] = mine[i] + out.layer_loss if i in mine else out.layer_loss
        step.produced[(a.stage, i)] = {b.index: t for b, t in zip(prog.send, sends)}

    def _send_forward(self, a: Action) -> None:
        peer, mb = _peer(a), _mb(a)
        bs = self._pair(a.stage, peer, False)
        out = self._now.produced[(a.stage, mb)]
        self._transmit(False, a.stage, peer, mb, bs, [out[b.index] for b in bs], peer)

    def _recv_backward(self, a: Action) -> None:
        bs, ts = self._collect(a)
        acc = self._now.grad_in.setdefault((a.stage, _mb(a)), {})
        for b, t in zip(bs, ts):
            acc[b.index] = acc[b.index] + t if b.index in acc else t

    def _backward(self, a: Action) -> None:
        step, mb = self._now, _mb(a)
        prog = self.programs[a.stage]
        step.produced.pop((a.stage, mb), None)
        got = step.grad_in.pop((a.stage, mb), {})
        dys = [got[b.index] if b.index in got else
               tf.zeros(self._shape(b, mb), dtype=tf.as_dtype(b.dtype))
               for b in prog.send]
        grads = prog.backward(mb, dys)
        step.grad_out[(a.stage, mb)] = {b.index: g for b, g in zip(prog.recv, grads)}

    def _weight(self, a: Action) -> None:
        """A zero-bubble schedule's W: the stage's deferred weight gradients ([Note: split
        stages] in tfsmp/runtime/stage.py)."""
        if self._now.mode.train:
            self.programs[a.stage].weight(_mb(a))

    def _send_backward(self, a: Action) -> None:
        peer, mb = _peer(a), _mb(a)
        bs = self._pair(peer, a.stage, True)
        out = self._now.grad_out[(a.stage, mb)]
        self._transmit(True, a.stage, peer, mb, bs, [out[b.index] for b in bs], a.stage)

    def _reduce(self, a: Action) -> None:
        step = self._now
        if step.hooks is not None and step.mode.train:
            step.hooks.reduce(a.stage, self._stage_result(a.stage))

    def _stage_result(self, stage: int) -> StageResult:
        """The stage's result, made once per step (at its REDUCE, or at STEP)."""
        stages = self._now.result.stages
        found = stages.get(stage)
        if found is None:
            found = stages[stage] = self.programs[stage].result()
        return found

    def _apply(self, a: Action) -> None:
        step = self._now
        if step.hooks is not None and step.mode.train:
            for s in self.programs:
                self._stage_result(s)
            step.hooks.apply(step.result)
