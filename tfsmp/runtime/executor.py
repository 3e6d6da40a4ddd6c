"""Runs one rank's lowered schedule: a dispatch table from action to handler.

Example::

    ex = Executor(lowered.actions[rank], programs, plan, comm.pipeline, 2, 4,
                  placement=lowered.placement)
    result = ex.run(microbatches, mode=StepMode(train=True), hooks=engine)

[Note: plan and step] An executor holds what one schedule needs on every step: the actions, the
programs, the message plan and the receive-buffer pool. What one step makes (received and
produced tensors, posted receives, pending sends, the result) lives in a `_Step` made by `run`,
so no step reads another's leftovers.

[Note: pre-posted receives] Every send is non-blocking (``Isend``), and each receive is posted
(``Irecv``) before the rank waits for it, ahead of its action ([Note: receives ahead]). Large
messages travel by MPI's rendezvous protocol, so a blocking send would stall until its peer
reached the matching receive (measured on a 2-stage prototype, 16 steps at batch 512: 2.97 s
with blocking sends and receives posted at their action, 2.04 s non-blocking and pre-posted,
1.98 s in one process). As no send blocks and every receive is posted before its wait, a schedule
whose receives are satisfiable in order cannot deadlock, which is what the schedule validator
checks.

[Note: receives ahead] A step posts, per message stream (the boundary tensors between one pair
of stages in one direction), the receive of its first microbatch at its first wait (not when
the step starts: a rank whose step starts with a send would post them before it, on every
transfer's critical path; measured in the transfer benchmark, 2026-12-06: 7 us of a
16-round-trip step's 0.85 ms at 256 KB), and once the receive of
microbatch i is in, the stream's next one is posted at the rank's next wait (the next receive
action's, before it waits, whichever stream that is), so while the rank waits for another
stream (a backward's gradients, say) the message of microbatch i + 1 can already land. A stream
has `_AHEAD` = 1 receive in flight at a time, and the buffer of microbatch i is free again by
the time i + 1 is posted whenever the action after the receive consumed its tensor, so such a
stream cycles through one buffer that stays in the CPU's caches (a stage keeping its received
activations for the backward holds their buffers, and the ring grows to what it holds:
[Note: receive buffers] in buffers.py). Posting i + 1 before waiting for i, as the runtime did
until issue 30, let nothing land sooner (a stream's messages arrive in order, i + 1 after i) but
needed a second buffer while i's tensor was still held: measured in raw mpi4py ping-pongs on
this host (2026-12-05, quiet), receiving into two alternating buffers instead of one cost
8-12 % at 4-16 MB (the buffers and the sent tensor no longer fit the shared 32 MB cache
together). Posting every receive of the step at its start would need a buffer per message.

[Note: drain split] In a schedule without W actions (1F1B, GPipe, interleaved), a stage's last
backwards are the pipeline's drain: the stage before it waits for their gradients, and on its
own rank nothing waits for their weight gradients before the step's end. So a stage that sends
gradients to another rank splits the backward of its last `RunPlan.drain` microbatches as a
zero-bubble stage splits every one ([Note: split stages] in tfsmp/runtime/stage.py): B computes
what it sends, and the executor runs their W's (in microbatch order, so every accumulator sums
the same terms in the same order) while the rank would wait for a message, or else before the
stage's REDUCE or the STEP. Measured on the peer benchmark's 2-stage 1F1B step (8 ×
Dense(1024), batch 2048, m = 8, one thread per rank): the last stage's fused forward-backward
took 64.6 ms per microbatch, its split half 44.3 ms and W 22 ms, and the first stage's
backward 39.6 ms; with its last W deferred, the first stage starts its last backward one W
earlier, and with two, the last stage's W's (44 ms) about cover that backward. A split costs
about 1.7 ms of the rank's time per microbatch (a second compiled call, the slots), so only
the drain is split; a zero-bubble stage's W's are the schedule's, and a stage that sends no
gradients, or to a stage on its own rank only, has no drain to shorten.

What it costs in memory: from B to W a drained microbatch holds its linear layers' inputs and
pre-activation gradients, less than the stage held for it before its B, but the fused last
stage held nothing between microbatches before, and now holds one or two microbatches' worth
while its last fused calls run (hundreds of MiB on a GPT-2 stage at 8 rows). So it is a
decision of the `RunPlan` (`drain`: `DRAIN` in speed mode, none in memory mode, whose backward
recomputes the forward), which the memory model prices (the activation walk holds a drained
microbatch from its B to the step's end, `RunPlan.drain_microbatches`), and which the plan's
memory check drops where the run fits its cap only without it (`StagePlan.drain_split`, so
every rank runs what rank 0 planned).

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

from tfsmp import failure
from tfsmp.comm.base import Group, Request, testall
from tfsmp.errors import StepError
from tfsmp.partitioning.plan import Boundary, StagePlan
from tfsmp.runtime import watchdog as wd
from tfsmp.runtime.buffers import (
    ReceivePool,
    aligned_empty,
    as_tensor,
    direct_type,
    held,
    host_view,
    pool_tensor,
    send_buffer,
    wire,
    wired,
)
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

    key: int  # its index among the executor's receives: its key in `_Step.posted`
    boundaries: list[Boundary]
    streams: list[tuple[Any, ...]]  # each boundary's ring in the pool: (op, stage, peer, index)
    tags: list[int]
    src: int
    consumer: int
    microbatch: int
    backward: bool
    aliased: list[bool]  # per boundary: its tensor aliases the buffer (DLPack), else a copy
    wired: bool  # some boundary's type travels as unsigned ints (`wire`: bfloat16)
    queue: list[_Receive] = field(default_factory=list, compare=False, repr=False)  # its stream's
    position: int = 0  # its index in ``queue``
    single: bool = False  # one boundary, aliased, not wired: `_post_ahead`'s common case
    text: str = ""  # what a stalled wait for it says


@dataclass(frozen=True)
class _Send:
    """One send action's messages, computed once per executor ([Note: message plan])."""

    boundaries: list[Boundary]
    indices: list[int]  # the boundaries' indices, in order
    mailbox: _Key | None  # the peer's receive key when the peer stage is on this rank
    dest: int
    tags: list[int]
    dtypes: list[np.dtype[Any]]
    wired: bool  # some boundary's type travels as unsigned ints (`wire`: bfloat16)
    headers: bool  # some boundary's shape is known only at run time ([Note: dynamic boundaries])
    peer: int
    microbatch: int
    consumer: int
    single: bool = False  # one boundary to another rank, not wired, no header: the common case


@dataclass
class _Pending:
    boundaries: list[Boundary]
    buffers: list[np.ndarray]
    requests: list[Request]
    tensors: list[tf.Tensor | None]  # made when posted where DLPack aliases ([Note: early tensors])
    copied: bool  # some boundary's type is copied into its tensor once received
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
    posted: dict[int, _Pending] = field(default_factory=dict)  # by `_Receive.key`
    ahead: dict[int, int] = field(default_factory=dict)  # id(stream queue) -> receives posted
    due: list[_Receive] = field(default_factory=list)  # next wait's posts: [Note: receives ahead]
    mailbox: dict[_Key, list[tf.Tensor]] = field(default_factory=dict)
    received: dict[tuple[int, int], dict[int, tf.Tensor]] = field(default_factory=dict)
    produced: dict[tuple[int, int], dict[int, tf.Tensor]] = field(default_factory=dict)
    grad_in: dict[tuple[int, int], dict[int, tf.Tensor]] = field(default_factory=dict)
    grad_out: dict[tuple[int, int], dict[int, tf.Tensor]] = field(default_factory=dict)
    sends: list[Request] = field(default_factory=list)  # this step's sends, in flight or done
    sent: list[Any] = field(default_factory=list)  # what they send (arrays, tensors), alive until done
    deferred: list[tuple[int, int]] = field(default_factory=list)  # [Note: drain split]


_POOL_SHAPES = 4  # distinct shapes per stream whose rings a dynamic-shape executor keeps
_AHEAD = 1  # receives of a stream in flight at once ([Note: receives ahead])
_FILLED = (Op.RECV_F, Op.RECV_B, Op.REDUCE, Op.STEP)  # what deferred W's may run before
_YIELD = 0.05  # seconds a wait yields the core between tests before it sleeps ([Note: polling])


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
        drain: int = 0,
    ) -> None:
        """``drain``: the run's `RunPlan.drain` ([Note: drain split]; 0: none)."""
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
        # the same step where one runs: an attribute, not a property (read a dozen times a message)
        self._now: _Step
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
        # is computed once per executor; a step only picks buffers, posts and completes requests
        # (a message of one boundary, the common case, without the lists' loops: `single`).
        streams = {(a.op is Op.RECV_B, a.stage, _peer(a)) for a in actions
                   if a.op in (Op.RECV_F, Op.RECV_B)}
        self.pool = ReceivePool(plan.boundaries, _POOL_SHAPES * sum(
            len(self._pair(*((stage, peer) if backward else (peer, stage)), backward))
            for backward, stage, peer in streams), dynamic=shapes is not None)
        self._receives: dict[int, _Receive] | None = None  # on first use: subclasses may add
        self._queues: list[list[_Receive]] = []  # receives per stream, in schedule order
        self._by_action: dict[int, _Receive] = {}  # id(receive action) -> its plan
        self._sends: dict[int, _Send] = {}  # id(send action) -> its plan
        # the group's calls without per-call checks: a message's buffer (a pool ring's, or a
        # sent tensor's contiguous view) and peer rank come from its plan ([Note: message plan])
        self._isend, self._irecv = group.p2p()
        self._dispatch: dict[Op, Callable[[Action], None]] = {
            Op.FORWARD: self._forward, Op.BACKWARD: self._backward, Op.WEIGHT: self._weight,
            Op.SEND_F: self._send_forward, Op.RECV_F: self._recv_forward,
            Op.SEND_B: self._send_backward, Op.RECV_B: self._recv_backward,
            Op.REDUCE: self._reduce, Op.STEP: self._apply,
        }
        self._bound: tuple[list[Action] | None, list[tuple[Action, Callable[[Action], None]]]] = (
            None, [])  # `_handlers`: (the actions, each with its handler)
        self.drain = drain
        self._drain: dict[int, frozenset[int]] | None = None  # on first use ([Note: drain split])

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

    def _shape(self, b: Boundary, mb: int) -> tuple[int, ...]:
        """The full shape of boundary ``b`` in microbatch ``mb`` (batch axis first)."""
        if self.shapes is None:
            return (self._now.microbatches[mb].size, *b.shape)  # type: ignore[arg-type]
        return self._now.mb_shapes[mb][b.index]

    @property
    def _pool(self) -> list[np.ndarray]:
        """Every receive buffer ([Note: receive buffers] in buffers.py)."""
        return self.pool.buffers()

    def _wait(self, requests: list[Request], what: str) -> None:
        """Waits for requests, polling so that a stall is diagnosed instead of hanging.

        [Note: polling] Each poll tests all requests in one call (MPI ``Testall``; a single
        request, the common case, through its own ``test``, a call less per poll). For its first
        `Group.spin` seconds a wait polls without pause, as MPI's own blocking wait does; then,
        up to 50 ms, it yields the core between tests, and longer waits back off to 1 ms
        sleeps, so an idle rank does not starve a computing one on an oversubscribed host.
        The spin is 10 ms for a rank pinned to cores of its own, 100 us (`SHARED_SPIN`) for an
        unpinned one on a host with a core per compute thread of every rank (one-thread ranks,
        as the benchmarks run), and 0 otherwise (`tfsmp.comm.mpi.spin_seconds`). Measured on this 2-core host while other jobs kept it
        busy (load 10-12), the transfer benchmark's 2 ranks: pinned to a core each, yielding
        between tests made a 256 KB ping-pong 6-25x slower than spinning (the scheduler runs
        another process before the next test); unpinned (``--bind-to none``, as tfsmp's
        launcher and the benchmarks run), spinning 10 ms was 1.2-40x slower than yielding at
        every size from 256 KB to 16 MB, the two ranks taking turns on one core. A 100 us spin
        bounds what a wait can take from a peer on its core, and still catches a message
        already on its way: with four busy processes beside the 2 ranks (2026-12-06), a 256 KB
        round trip took 59.5 us after it against 197 us yielding from the first test, and the
        same on a quiet host (55-56 us both). A blocking
        ``Waitall`` would save no time over the spin and could neither back off nor let the
        watchdog's table show the wait. The watchdog hears of a wait only once it leaves the
        yield phase: the executor times its stalls itself, a table of a 50 ms wait would say
        nothing a stall's table does not, and writing the status record (a few microseconds)
        in every wait that is over within a message's time would cost more than the wait. A
        receive's ``what`` is made once per plan (`_Receive.text`), not per wait.
        """
        # one boundary per message is the common case: its request's own test, one call less
        test = requests[0].test if len(requests) == 1 else lambda: testall(requests)
        if test():  # one MPI call for the common case: already there
            return
        start = time.monotonic()
        spin_until = start + self.group.spin
        while time.monotonic() < spin_until:
            if test():
                return
        yield_until = start + _YIELD
        while True:
            os.sched_yield()
            if test():
                return
            if time.monotonic() > yield_until:
                break
        self._wait_long(requests, what, start)

    def _wait_long(self, requests: list[Request], text: str, start: float) -> None:
        """`_wait` past its yield phase: tells the watchdog, sleeps between tests, and raises
        (or has the watchdog abort the job) past `stall_timeout`."""
        deadline = start + self.stall_timeout if self.stall_timeout > 0 else None
        if self.watchdog is not None:
            self.watchdog.waiting(text)
        while True:
            now = time.monotonic()
            time.sleep(min(1e-3, (now - start) / 50))
            if testall(requests):
                return
            if deadline is not None and time.monotonic() > deadline:
                message = (
                    f"{self.rank_tag} waited more than stall_timeout={self.stall_timeout}s for "
                    f"{text} (action {self.current}). A peer rank is stuck or failed; see its "
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
        step = self.step_state = self._now = _Step(
            list(microbatches), mode, hooks, head, StepResult(microbatches=list(microbatches)))
        if mode.train:
            drain = self._drain_plan() if not mode.collect else {}
            for s, prog in self.programs.items():
                prog.begin_step(mode)
                prog.drain = drain.get(s, frozenset())
        if self.shapes is not None:  # every rank alike, from the inputs, before any message
            step.mb_shapes = self._resolve_shapes(microbatches)
        dog = self.watchdog
        if dog is not None:
            dog.step_begin()
        try:
            self._run_actions(step, dog)
        except Exception as e:  # [Note: a step that fails partway] in tfsmp/failure.py
            failure.end_partway(e, "training step" if mode.train else "forward step")
            raise
        if dog is not None:
            dog.step_end()
        if mode.train:  # stages without REDUCE or STEP actions (collect mode) report here
            for s in self.programs:
                self._stage_result(s)
        return step.result

    def _run_actions(self, step: _Step, dog: wd.Watchdog | None) -> None:
        """Posts the step's first receives, runs its actions and waits for its sends."""
        self._post_receives()
        tracer = self.tracer
        for action, handler in self._handlers():
            if step.deferred and action.op in _FILLED:
                self._fill(action)
            self.current = action
            if dog is not None:
                dog.update(action)
            if tracer is not None:
                with tracer.event(str(action), action.op.value):
                    handler(action)
            else:
                handler(action)
        self.current = "waiting for sends"
        if step.sends:
            self._wait(step.sends, "sends to complete")
            step.sends.clear()
            step.sent.clear()

    def _handlers(self) -> list[tuple[Action, Callable[[Action], None]]]:
        """Each action with its handler, looked up once per executor (after the receives are
        planned): an `Op` hashes in Python, which a dispatch per action would pay each step, and
        a message of one boundary gets a handler of its own ([Note: message handlers])."""
        if self._bound[0] is not self.actions:
            self._bound = (self.actions, [(a, self._handler(a)) for a in self.actions])
        return self._bound[1]

    def _handler(self, a: Action) -> Callable[[Action], None]:
        """``a``'s handler: the dispatch table's, or for a message of one boundary to or from
        another rank, one made for it.

        [Note: message handlers] Between a message's arrival and the next send the executor's
        own Python is on the critical path of every transfer, twice per round trip (measured in
        the transfer benchmark's 256 KB ping-pong, 2026-12-06: 3.3 us from a receive's wait
        returning to the next ``Isend`` on each rank, against 1.2 us for a raw non-blocking
        ping-pong). So each send or receive of one boundary tensor (not wired, static shapes:
        `_Send.single`, `_Receive.single`) gets a closure holding everything its message plan
        fixes (keys, peer, tag, type), which does what `_send_forward`/`_send_backward` and
        `_collect` with `_recv_forward`/`_recv_backward` do for it, without their lookups and
        calls. A subclass that overrides one of those handlers keeps it (the tests' transfer
        executors do)."""
        op = a.op
        if op is Op.SEND_F or op is Op.SEND_B:
            backward = op is Op.SEND_B
            if self._inherited("_send_backward" if backward else "_send_forward"):
                s = self._send_plan(a)
                if s.single:
                    return self._single_send(s, a.stage, backward)
        elif op is Op.RECV_F or op is Op.RECV_B:
            backward = op is Op.RECV_B
            r = self._by_action.get(id(a))
            if (r is not None and r.single and self.shapes is None
                    and self._inherited("_recv_backward" if backward else "_recv_forward")):
                return self._single_receive(r, a.stage, backward)
        return self._dispatch[op]

    def _inherited(self, handler: str) -> bool:
        """Whether this executor's class runs `Executor`'s own ``handler`` (no override)."""
        return getattr(type(self), handler) is getattr(Executor, handler)

    def _single_send(self, s: _Send, stage: int, backward: bool) -> Callable[[Action], None]:
        """The handler of a send of one boundary to another rank ([Note: message handlers]):
        `_transmit`'s common case."""
        key, index, dest, tag, dtype = (stage, s.microbatch), s.indices[0], s.dest, s.tags[0], s.dtypes[0]
        isend, enum = self._isend, direct_type(dtype)

        def send(a: Action) -> None:
            step = self._now
            buf = send_buffer((step.grad_out if backward else step.produced)[key][index], dtype,
                              enum)  # the tensor itself: [Note: direct sends] in buffers.py
            step.sends.append(isend(buf, dest, tag))
            step.sent.append(buf)

        return send

    def _single_receive(self, r: _Receive, stage: int, backward: bool
                        ) -> Callable[[Action], None]:
        """The handler of a receive of one boundary from another rank ([Note: message
        handlers]): `_collect`'s common case, then `_recv_forward`'s or `_recv_backward`'s."""
        key, index, text, slot = r.key, r.boundaries[0].index, r.text, (stage, r.microbatch)
        after = r.queue[r.position + 1] if r.position + 1 < len(r.queue) else None
        wait = self._wait

        def receive(a: Action) -> None:
            step = self._now
            if step.due:
                self._post_due()
            pending = step.posted.pop(key, None)
            if pending is None:  # posted above in a step that runs its receives in order
                self._post_ahead(r)
                pending = step.posted.pop(key)
            if after is not None:  # posted at the next wait, not this one's
                step.due.append(after)
            requests = pending.requests
            if not requests[0].test():
                wait(requests, text)
            t = pending.tensors[0]
            into = step.grad_in if backward else step.received
            got = into.get(slot)
            if got is None:
                into[slot] = {index: t}
            elif backward and index in got:  # gradients from several consumers add up
                got[index] = got[index] + t
            else:
                got[index] = t

        return receive

    def _drain_plan(self) -> dict[int, frozenset[int]]:
        """Per stage of this rank that has no W actions but sends gradients to another rank:
        its last ``drain`` backwards' microbatches ([Note: drain split])."""
        if self._drain is not None:
            return self._drain
        if not self.drain:  # none (``mbs[-0:]`` below would be every backward)
            self._drain = {}
            return self._drain
        split = {a.stage for a in self.actions if a.op is Op.WEIGHT}
        remote = {a.stage for a in self.actions
                  if a.op is Op.SEND_B and not self._local(_peer(a))}
        order: dict[int, list[int]] = {}
        for a in self.actions:
            if a.op is Op.BACKWARD and a.stage in remote and a.stage not in split:
                order.setdefault(a.stage, []).append(_mb(a))
        self._drain = {s: frozenset(mbs[-self.drain:]) for s, mbs in order.items()}
        return self._drain

    def _fill(self, a: Action) -> None:
        """Before ``a``, runs deferred W's ([Note: drain split]): while the receive ``a`` has
        not arrived; before a REDUCE, its stage's; before the STEP, all."""
        deferred = self._now.deferred
        if a.op is Op.STEP or a.op is Op.REDUCE:
            for s, mb in [d for d in deferred if a.op is Op.STEP or d[0] == a.stage]:
                deferred.remove((s, mb))
                self._run_deferred(s, mb)
            return
        r = self._by_action.get(id(a))
        if r is None:  # in memory: nothing to wait for
            return
        self._post_due()  # ``a``'s own receive may be among them ([Note: receives ahead])
        pending = self._now.posted.get(r.key)
        if pending is None:
            return
        while deferred and not testall(pending.requests):
            self._run_deferred(*deferred.pop(0))

    def _run_deferred(self, stage: int, mb: int) -> None:
        """A deferred W ([Note: drain split]), traced as the W action it stands for."""
        prog = self.programs[stage]
        if self.tracer is None:
            prog.weight(mb)
            return
        with self.tracer.event(str(Action(stage, Op.WEIGHT, mb)), Op.WEIGHT.value):
            prog.weight(mb)

    def _resolve_shapes(self, microbatches: list[MicroBatch]) -> list[dict[int, tuple[int, ...]]]:
        try:
            return [self.shapes.of(mb) for mb in microbatches]  # type: ignore[union-attr]
        except StepError as e:
            raise StepError(f"{self.rank_tag} {e}".strip()) from e

    def _post_receives(self) -> None:
        """Makes the first receive of every stream due at the step's first wait ([Note:
        receives ahead])."""
        if self._receives is None:
            self._receives = self._plan_receives()
        self.pool.begin_step()
        self._now.due.extend(queue[0] for queue in self._queues)

    def _post_due(self) -> None:
        """Posts the receives due at this wait: each stream's next, once its previous is in
        ([Note: receives ahead])."""
        due = self._now.due
        if due:
            for q in due:
                self._post_ahead(q)
            due.clear()

    def _post_ahead(self, r: _Receive) -> None:
        """Posts the receives of ``r``'s stream up to `_AHEAD` - 1 past ``r``."""
        queue, ahead = r.queue, self._now.ahead
        done = ahead.get(id(queue), 0)
        end = min(len(queue), r.position + _AHEAD)
        if done >= end:
            return
        ahead[id(queue)] = end
        irecv, dynamic, posted = self._irecv, self.shapes is not None, self._now.posted
        buffer = self.pool.buffer
        for q in queue[done:end]:
            if q.single and not dynamic:  # without the lists' loops: a microsecond a message
                b = q.boundaries[0]
                buf = buffer(q.streams[0], b, self._shape(b, q.microbatch))
                posted[q.key] = _Pending(q.boundaries, [buf], [irecv(buf, q.src, q.tags[0])],
                                         [pool_tensor(buf, True)], False)
                continue
            buffers = [buffer(k, b, self._shape(b, q.microbatch))
                       for k, b in zip(q.streams, q.boundaries)]
            reqs = [irecv(wire(buf) if q.wired else buf, q.src, tag)
                    for buf, tag in zip(buffers, q.tags)]
            tensors = [pool_tensor(buf, True) if alias else None  # [Note: early tensors]
                       for buf, alias in zip(buffers, q.aliased)]
            pending = posted[q.key] = _Pending(q.boundaries, buffers, reqs, tensors,
                                               not all(q.aliased))
            if dynamic and not q.backward:
                self._post_headers(pending, q.src, q.consumer, q.microbatch)

    def _plan_receives(self) -> dict[int, _Receive]:
        """The step's receives from other ranks, by key, each in its stream's queue in schedule
        order ([Note: message plan])."""
        out: dict[int, _Receive] = {}
        queues: dict[tuple[Op, int, int], list[_Receive]] = {}
        for a in self.actions:
            op = a.op
            if op not in (Op.RECV_F, Op.RECV_B) or self._local(_peer(a)):
                continue
            backward = op is Op.RECV_B
            peer, mb = _peer(a), _mb(a)
            producer, consumer = (a.stage, peer) if backward else (peer, a.stage)
            bs = self._pair(producer, consumer, backward)
            queue = queues.setdefault((op, a.stage, peer), [])
            r = _Receive(
                len(out), bs,
                [(op.value, a.stage, peer, b.index) for b in bs],
                [self._tag(b, consumer, mb, backward) for b in bs],
                self._rank(peer), consumer, mb, backward,
                [self.pool.dlpack[b.index] for b in bs],
                any(wired(self.pool.dtypes[b.index]) for b in bs), queue, len(queue),
                len(bs) == 1 and self.pool.dlpack[bs[0].index]
                and not wired(self.pool.dtypes[bs[0].index]),
                f"{'gradients' if backward else 'activations'} of microbatch {mb} from stage {peer}")
            queue.append(r)
            out[r.key] = self._by_action[id(a)] = r
        self._queues = list(queues.values())
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

    def _send_plan(self, a: Action) -> _Send:
        """What the send ``a`` (SEND_F or SEND_B) sends, and where ([Note: message plan])."""
        found = self._sends.get(id(a))
        if found is None:
            backward, peer, mb = a.op is Op.SEND_B, _peer(a), _mb(a)
            producer, consumer = (peer, a.stage) if backward else (a.stage, peer)
            bs = self._pair(producer, consumer, backward)
            receive = Op.RECV_B if backward else Op.RECV_F  # the peer's action that takes them
            mailbox = (receive, peer, a.stage, mb) if self._local(peer) else None
            is_wired = any(wired(self.pool.dtypes[b.index]) for b in bs)
            headers = (self.shapes is not None and not backward
                       and any(is_dynamic(b.shape) for b in bs))
            found = self._sends[id(a)] = _Send(
                bs, [b.index for b in bs], mailbox, self._rank(peer),
                [self._tag(b, consumer, mb, backward) for b in bs],
                [self.pool.dtypes[b.index] for b in bs], is_wired, headers, peer, mb, consumer,
                len(bs) == 1 and not is_wired and mailbox is None and not headers)
        return found

    def _transmit(self, s: _Send, out: dict[int, tf.Tensor]) -> None:
        """Sends the tensors of ``out`` (activations or gradients, by boundary) as ``s`` says: in
        memory when the peer stage is on this rank, else each straight from the tensor's memory
        (`send_buffer`, `host_view`)."""
        if s.single:  # one boundary, sent as it is: the common case, without the lists
            dtype = s.dtypes[0]
            buf = send_buffer(out[s.indices[0]], dtype, direct_type(dtype))
            self._now.sends.append(self._isend(buf, s.dest, s.tags[0]))
            self._now.sent.append(buf)
            return
        tensors = [out[i] for i in s.indices]
        if s.mailbox is not None:
            self._now.mailbox[s.mailbox] = tensors
            return
        if s.headers:
            for b, t in zip(s.boundaries, tensors):
                if is_dynamic(b.shape):
                    self._send_header(b, t, s.peer, s.microbatch, s.consumer)
        isend, sends, sent, dest = self._isend, self._now.sends, self._now.sent, s.dest
        for t, tag, dtype in zip(tensors, s.tags, s.dtypes):
            buf = wire(host_view(t, dtype)) if s.wired else host_view(t, dtype)
            sends.append(isend(buf, dest, tag))
            sent.append(buf)

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
        self._now.sends.append(req)
        self._now.sent.append(header)

    def _collect(self, a: Action) -> tuple[list[Boundary], list[tf.Tensor]]:
        """What the receive ``a`` (RECV_F or RECV_B) takes: its boundaries and tensors.

        [Note: early tensors] The tensor of a received buffer is made when its receive is
        posted, not when the message is in: a DLPack tensor aliases the buffer without reading
        it, and nothing reads it before this returns, so the conversion (about a microsecond)
        happens while the rank waits rather than between a message's arrival and what the
        rank does next. Types DLPack cannot carry are copied here, once received."""
        r = self._by_action.get(id(a))
        if r is None:  # the peer stage is on this rank: handed over in memory
            peer, backward = _peer(a), a.op is Op.RECV_B
            producer, consumer = (a.stage, peer) if backward else (peer, a.stage)
            return (self._pair(producer, consumer, backward),
                    self._now.mailbox.pop((a.op, a.stage, peer, _mb(a))))
        step = self._now
        if step.due:
            self._post_due()
        pending = step.posted.pop(r.key, None)
        if pending is None:  # posted above in a step that runs its receives in order
            self._post_ahead(r)
            pending = step.posted.pop(r.key)
        if pending.header_requests:  # before the data, which a larger message would overrun
            self._check_headers(pending, a)
        if r.position + 1 < len(r.queue):  # posted at the next wait, not this one's
            step.due.append(r.queue[r.position + 1])
        self._wait(pending.requests, r.text)
        if not pending.copied:
            return pending.boundaries, pending.tensors
        tensor = self.pool.tensor  # pool buffers are aligned: `aligned_empty`
        return pending.boundaries, [tensor(b, buf) if t is None else t for b, buf, t
                                    in zip(pending.boundaries, pending.buffers, pending.tensors)]

    # -- handlers ------------------------------------------------------------------------------

    def _recv_forward(self, a: Action) -> None:
        bs, ts = self._collect(a)
        got = self._now.received.setdefault((a.stage, _mb(a)), {})
        for b, t in zip(bs, ts):
            got[b.index] = t

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
            custom = prog.objective is not None and prog.objective.custom is not None
            record, outputs = prog.forward_backward_last(
                i, inputs, recv, mb.y, mb.sample_weight, mb.consts,
                [mb.inputs[k] for k in prog.traced.input_keys] if custom else None)
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
        s = self._sends.get(id(a)) or self._send_plan(a)
        self._transmit(s, self._now.produced[(a.stage, s.microbatch)])

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
        if prog.has_weight_work(mb):  # [Note: drain split]
            step.deferred.append((a.stage, mb))

    def _weight(self, a: Action) -> None:
        """A zero-bubble schedule's W: the stage's deferred weight gradients ([Note: split
        stages] in tfsmp/runtime/stage.py)."""
        if self._now.mode.train:
            self.programs[a.stage].weight(_mb(a))

    def _send_backward(self, a: Action) -> None:
        s = self._sends.get(id(a)) or self._send_plan(a)
        self._transmit(s, self._now.grad_out[(a.stage, s.microbatch)])

    def _reduce(self, a: Action) -> None:
        step = self._now
        if step.hooks is not None and step.mode.train:
            step.hooks.reduce(a.stage, self._stage_result(a.stage))

    def _stage_result(self, stage: int) -> StageResult:
        """The stage's result, made once per step (at its REDUCE, or at STEP)."""
        step = self._now
        if step.deferred:  # [Note: drain split]: a step without REDUCE or STEP actions
            for s, mb in [d for d in step.deferred if d[0] == stage]:
                step.deferred.remove((s, mb))
                self._run_deferred(s, mb)
        stages = step.result.stages
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
