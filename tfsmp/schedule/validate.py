"""The schedule validator: ordering, pairing, buffers and a deadlock dry run, with the grid on failure.

Example::

    validate(lower(generate("interleaved", 4, 8), None, 4))          # passes silently
    validate(broken)    # ScheduleError: ... then the rank × step grid, failing step marked

Checks, in order: every action on the rank of its stage (by the `Placement`, default stage ``s``
on rank ``s % p``); every (stage, microbatch) has exactly one forward and one backward, forward
first; a stage with W actions has exactly one W per microbatch, after its B ([Note: weight
actions]); sends and receives pair up one to one with the same (sender stage, receiver stage,
microbatch, direction) and in the same order on both sides, each after/before the compute it
belongs to; REDUCE after its stage's last backward (last W when it has Ws) and STEP after
everything of its rank; then the dry run of [Note: deadlock model]; then buffers.

[Note: deadlock model] The runtime pre-posts all receives of a step and never blocks in a send,
so the dry run lets sends complete at once and blocks a rank at a receive until the matching
send has run. A compute-only schedule is dry-run through its data dependencies instead: a
forward waits for its producers' forwards, a backward for its consumers' backwards (links from
``links``, default the chain), a W for its own B. W moves no message, so in a lowered schedule
it never waits.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NoReturn

from tfsmp.errors import ScheduleError
from tfsmp.schedule.actions import (
    Action,
    MessageKey,
    Op,
    Schedule,
    message_key,
    release_op,
    weight_stages,
)
from tfsmp.schedule.links import Links, as_links
from tfsmp.schedule.placement import Placement
from tfsmp.schedule.render import render_ascii

__all__ = ["peak_activations", "peak_in_flight", "validate"]

_CONTEXT = 12  # steps shown around a failure in large grids
_FULL_GRID_STEPS = 60

_Pos = tuple[int, int]  # (rank, step)
_WHAT = {"F": "activations", "B": "gradients"}


def validate(schedule: Schedule, *, links: Links | None = None,
             max_activations: int | None = None, placement: Placement | None = None) -> None:
    """Checks a compute-only or lowered schedule; returns None when it is valid.

    Args:
        schedule: ``{rank: [Action, ...]}`` for ranks ``0..p-1``.
        links: the stage graph (a `StagePlan` or `StageLinks`). Lowered schedules are checked
            against it when given; compute-only ones are dry-run along it (default: the chain).
        max_activations: if set, no rank may hold more (stage, microbatch) activation sets at
            once (forward run, backward not yet; W not yet in a stage with W actions).
        placement: which rank runs each stage; default stage ``s`` on rank ``s % p`` over the
            schedule's stages.

    Raises:
        ScheduleError: naming the rule, with the grid and the failing steps marked.
    """
    _Checker(schedule, links, max_activations, placement).run()


def peak_activations(schedule: Schedule) -> list[int]:
    """Per rank, the most (stage, microbatch) activation sets held at once: F run, and B not yet
    (W not yet in a stage with W actions, whose W still reads them)."""
    split = weight_stages(schedule)
    peaks = []
    for rank in sorted(schedule):
        held = peak = 0
        for a in schedule[rank]:
            if a.op is Op.FORWARD:
                held += 1
            elif a.is_compute and a.op is release_op(a.stage, split):
                held -= 1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per rank, the most distinct microbatches in flight at once: first F run, and last B not
    yet (last W in stages with W actions)."""
    split = weight_stages(schedule)
    peaks = []
    for rank in sorted(schedule):
        held: dict[int | None, int] = {}
        peak = 0
        for a in schedule[rank]:
            if a.op is Op.FORWARD:
                held[a.microbatch] = held.get(a.microbatch, 0) + 1
            elif (a.is_compute and a.op is release_op(a.stage, split)
                  and held.get(a.microbatch)):
                held[a.microbatch] -= 1
                if not held[a.microbatch]:
                    del held[a.microbatch]
            peak = max(peak, len(held))
        peaks.append(peak)
    return peaks


@dataclass
class _Checker:
    schedule: Schedule
    links: Links | None
    max_activations: int | None
    given_placement: Placement | None = None

    def run(self) -> None:
        self.p = self._check_ranks()
        self.placement = self._placement()
        self._check_placement()
        self.split = weight_stages(self.schedule)
        self.forward_at, self.backward_at = self._check_compute()
        self.num_stages = 1 + max((s for s, _ in self.forward_at), default=-1)
        self.num_microbatches = 1 + max((i for _, i in self.forward_at), default=-1)
        self.last_backward: dict[int, int] = {}  # stage -> step of its last B, or last W
        for (stage, _), (_, step) in (*self.backward_at.items(), *self.weight_at.items()):
            self.last_backward[stage] = max(step, self.last_backward.get(stage, -1))
        self.lowered = any(a.is_comm for acts in self.schedule.values() for a in acts)
        graph = as_links(self.links, max(1, self.num_stages))
        self.producers = {s: graph.peers_backward(s) for s in range(self.num_stages)}
        self.consumers = {s: graph.peers_forward(s) for s in range(self.num_stages)}
        if self.lowered:
            self._check_messages()
        self._check_reduce_and_step()
        self._dry_run()
        self._check_buffers()

    # -- reporting ---------------------------------------------------------------------------

    def fail(self, headline: str, marks: dict[_Pos, str]) -> NoReturn:
        steps = max((len(a) for a in self.schedule.values()), default=0)
        context = _CONTEXT if steps > _FULL_GRID_STEPS and marks else None
        grid = render_ascii(self.schedule, marks=marks, context=context)
        raise ScheduleError(f"{headline}\n{grid}")

    # -- structure -----------------------------------------------------------------------------

    def _check_ranks(self) -> int:
        p = len(self.schedule)
        if p < 1 or sorted(self.schedule) != list(range(p)):
            raise ScheduleError(
                f"A schedule maps ranks 0..p-1 to their actions. Received: ranks "
                f"{sorted(self.schedule)}")
        return p

    def _placement(self) -> Placement:
        stages = 1 + max((a.stage for acts in self.schedule.values() for a in acts), default=0)
        if self.given_placement is None:
            return Placement(self.p, stages)
        if self.given_placement.num_ranks != self.p:
            raise ScheduleError(
                f"The placement must be for the schedule's ranks. Received: placement "
                f"num_ranks={self.given_placement.num_ranks}, schedule ranks 0..{self.p - 1}.")
        return self.given_placement

    def _check_placement(self) -> None:
        where = self.placement
        for rank, actions in self.schedule.items():
            for step, a in enumerate(actions):
                if a.stage >= where.num_stages:
                    self.fail(
                        f"Stages of this placement lie in 0..{where.num_stages - 1}. Received: "
                        f"{a} on rank {rank} (step {step}).", {(rank, step): "no such stage"})
                if where.rank(a.stage) != rank:
                    self.fail(
                        f"{where.rule()}. Received: {a} on rank {rank} (step {step}); move it "
                        f"to rank {where.rank(a.stage)}.",
                        {(rank, step): f"stage {a.stage} belongs to rank {where.rank(a.stage)}"})

    def _check_compute(self) -> tuple[dict[tuple[int, int], _Pos], dict[tuple[int, int], _Pos]]:
        at: dict[Op, dict[tuple[int, int], _Pos]] = {
            Op.FORWARD: {}, Op.BACKWARD: {}, Op.WEIGHT: {}}
        for rank, actions in self.schedule.items():
            for step, a in enumerate(actions):
                if not a.is_compute or a.microbatch is None:
                    continue
                key = (a.stage, a.microbatch)
                if key in at[a.op]:
                    first = at[a.op][key][1]
                    self.fail(
                        f"Each stage runs each microbatch's {a.op.name.lower()} once. Received: "
                        f"{a} at rank {rank}, steps {first} and {step}.",
                        {(rank, first): "first", (rank, step): "again"})
                at[a.op][key] = (rank, step)
        forward, backward = at[Op.FORWARD], at[Op.BACKWARD]
        self._check_complete(forward, backward)
        for key, pos in backward.items():
            if pos[1] < forward[key][1]:
                self.fail(
                    f"A stage runs a microbatch's forward before its backward. Received: "
                    f"{Action(key[0], Op.BACKWARD, key[1])} at step {pos[1]} before "
                    f"{Action(key[0], Op.FORWARD, key[1])} at step {forward[key][1]} on rank "
                    f"{pos[0]}.", {pos: "backward before its forward", forward[key]: "forward"})
        self.weight_at = at[Op.WEIGHT]
        self._check_weights(backward)
        return forward, backward

    def _check_weights(self, backward: dict[tuple[int, int], _Pos]) -> None:
        """[Note: weight actions]: all or none of a stage's microbatches have a W, after its B."""
        mbs = 1 + max((i for _, i in backward), default=-1)
        for s in sorted(self.split):
            for i in range(mbs):
                if (s, i) not in self.weight_at:
                    pos = backward.get((s, i))
                    self.fail(
                        f"A stage with W actions runs the W of every microbatch 0..{mbs - 1} "
                        f"(its B computes only input gradients). Received: no "
                        f"{Action(s, Op.WEIGHT, i)} on rank {self.placement.rank(s)}.",
                        {pos: f"no {Action(s, Op.WEIGHT, i)}"} if pos else {})
        for key, pos in self.weight_at.items():
            b = backward.get(key)
            if b is None or pos[1] < b[1]:
                self.fail(
                    f"A stage runs a microbatch's W after its B. Received: "
                    f"{Action(key[0], Op.WEIGHT, key[1])} at step {pos[1]} on rank {pos[0]}, "
                    f"{'with no B' if b is None else f'before its B at step {b[1]}'}.",
                    {pos: "W before its B", **({b: "B"} if b else {})})

    def _check_complete(self, forward: dict[tuple[int, int], _Pos],
                        backward: dict[tuple[int, int], _Pos]) -> None:
        keys = set(forward) | set(backward)
        stages = 1 + max((s for s, _ in keys), default=-1)
        mbs = 1 + max((i for _, i in keys), default=-1)
        for s in range(stages):
            for i in range(mbs):
                for op, table, other in ((Op.FORWARD, forward, backward),
                                         (Op.BACKWARD, backward, forward)):
                    if (s, i) not in table:
                        pos = other.get((s, i))
                        self.fail(
                            f"Every stage runs a forward and a backward of every microbatch "
                            f"0..{mbs - 1} (stages 0..{stages - 1}). Received: no "
                            f"{Action(s, op, i)} on rank {self.placement.rank(s)}.",
                            {pos: f"no {Action(s, op, i)}"} if pos else {})

    # -- messages ------------------------------------------------------------------------------

    def _check_messages(self) -> None:
        sends, recvs = self._collect_messages()
        for pair in sorted(set(sends) | set(recvs)):
            self._check_pair(pair, sends.get(pair, []), recvs.get(pair, []))
        self._check_local_order(sends, recvs)
        self._check_links(sends)

    def _collect_messages(self) -> tuple[dict[tuple[int, int, str], list[tuple[int, _Pos]]],
                                         dict[tuple[int, int, str], list[tuple[int, _Pos]]]]:
        """Per (sender stage, receiver stage, direction): (microbatch, position) in order."""
        sends: dict[tuple[int, int, str], list[tuple[int, _Pos]]] = {}
        recvs: dict[tuple[int, int, str], list[tuple[int, _Pos]]] = {}
        for rank, actions in self.schedule.items():
            for step, a in enumerate(actions):
                if not a.is_comm or a.peer is None or a.microbatch is None:
                    continue
                direction = "F" if a.op in (Op.SEND_F, Op.RECV_F) else "B"
                self._check_direction(a, direction, (rank, step))
                if a.op in (Op.SEND_F, Op.SEND_B):
                    sends.setdefault((a.stage, a.peer, direction), []).append(
                        (a.microbatch, (rank, step)))
                else:
                    recvs.setdefault((a.peer, a.stage, direction), []).append(
                        (a.microbatch, (rank, step)))
        return sends, recvs

    def _check_direction(self, a: Action, direction: str, pos: _Pos) -> None:
        producer, consumer = _link_of(a)
        mbs = self.num_microbatches
        if not 0 <= producer < consumer < self.num_stages or not 0 <= (a.microbatch or 0) < mbs:
            what = _WHAT[direction]
            self.fail(
                f"Activations flow to later stages and gradients to earlier ones, between stages "
                f"0..{self.num_stages - 1}, for microbatches 0..{mbs - 1}. Received: {a} ({what} "
                f"of the link {producer} -> {consumer}).", {pos: "no such message"})

    def _check_pair(self, pair: tuple[int, int, str], sends: list[tuple[int, _Pos]],
                    recvs: list[tuple[int, _Pos]]) -> None:
        src, dst, direction = pair
        what = _WHAT[direction]
        for k in range(max(len(sends), len(recvs))):
            s = sends[k] if k < len(sends) else None
            r = recvs[k] if k < len(recvs) else None
            if s is not None and r is not None and s[0] == r[0]:
                continue
            marks = {x[1]: "unmatched" for x in (s, r) if x is not None}
            self.fail(
                f"Every send needs one receive of the same microbatch, in the same order on both "
                f"stages. Received: stage {src} sends {what} of microbatches "
                f"{[i for i, _ in sends]} to stage {dst}, which receives "
                f"{[i for i, _ in recvs]}; they first differ at message {k}. Receive in the order "
                f"the peer sends.", marks)

    def _check_local_order(self, sends: dict[tuple[int, int, str], list[tuple[int, _Pos]]],
                           recvs: dict[tuple[int, int, str], list[tuple[int, _Pos]]]) -> None:
        """Receives come before the compute that reads them, sends after the one that writes."""
        for (src, _, direction), items in sends.items():
            table = self.forward_at if direction == "F" else self.backward_at
            for i, pos in items:
                self._order(table[(src, i)], pos, "sends what it computed only after computing it")
        for (_, dst, direction), items in recvs.items():
            table = self.forward_at if direction == "F" else self.backward_at
            for i, pos in items:
                self._order(pos, table[(dst, i)], "receives what it computes with before computing")

    def _order(self, first: _Pos, then: _Pos, rule: str) -> None:
        if first[1] >= then[1]:
            a = self.schedule[first[0]][first[1]]
            b = self.schedule[then[0]][then[1]]
            self.fail(f"A stage {rule}. Received: {b} at step {then[1]}, not after {a} at step "
                      f"{first[1]}, on rank {first[0]}.", {first: "must come first", then: "too early"})

    def _check_links(self, sends: dict[tuple[int, int, str], list[tuple[int, _Pos]]]) -> None:
        """Every linked pair exchanges activations and gradients for every microbatch."""
        if self.links is None:
            linked = {(s, d) if k == "F" else (d, s) for s, d, k in sends}
        else:
            linked = {(s, c) for s, consumers in self.consumers.items() for c in consumers}
            extra = {(s, d) if k == "F" else (d, s) for s, d, k in sends} - linked
            if extra:
                s, d = min(extra)
                self.fail(f"Stages exchange tensors only along the plan's links. Received: "
                          f"messages between stages {s} and {d}, which the plan does not link.", {})
        mbs = self.num_microbatches
        for producer, consumer in sorted(linked):
            for direction, sender, receiver, table in (
                    ("F", producer, consumer, self.forward_at),
                    ("B", consumer, producer, self.backward_at)):
                got = {i for i, _ in sends.get((sender, receiver, direction), [])}
                missing = sorted(set(range(mbs)) - got)
                if missing:
                    pos = table[(sender, missing[0])]
                    self.fail(
                        f"Linked stages exchange activations and gradients of every microbatch. "
                        f"Received: stage {sender} sends no {_WHAT[direction]} of microbatch "
                        f"{missing[0]} to stage {receiver}.",
                        {pos: f"no send to stage {receiver}"})

    # -- reduction and step ------------------------------------------------------------------

    def _check_reduce_and_step(self) -> None:
        buckets: dict[int, list[int | None]] = {}
        for rank, actions in self.schedule.items():
            last_work = 0
            for step, a in enumerate(actions):
                if a.op is Op.REDUCE:
                    buckets.setdefault(a.stage, []).append(a.microbatch)
                    self._reduce_after_backward(a, (rank, step))
                if a.op is not Op.STEP and not a.is_comm:
                    last_work = step
            steps = [k for k, a in enumerate(actions) if a.op is Op.STEP]
            if len(steps) > 1 or (steps and steps[0] < last_work):
                self.fail(f"A rank takes one optimizer STEP, after all its compute and "
                          f"reductions. Received: STEP at steps {steps} of rank {rank}.",
                          {(rank, k): "STEP" for k in steps})
        if buckets:
            self._check_buckets(buckets)

    def _reduce_after_backward(self, a: Action, pos: _Pos) -> None:
        if self.last_backward.get(a.stage, pos[1] + 1) > pos[1]:
            rule = ("A stage with W actions reduces its gradients after its last W"
                    if a.stage in self.split else "A stage reduces its gradients after its last "
                    "backward")
            self.fail(f"{rule}. Received: {a} at step {pos[1]} of rank {pos[0]}.",
                      {pos: "too early"})

    def _check_buckets(self, buckets: dict[int, list[int | None]]) -> None:
        expected = sorted(buckets[min(buckets)], key=lambda b: -1 if b is None else b)
        for s in range(self.num_stages):
            got = sorted(buckets.get(s, []), key=lambda b: -1 if b is None else b)
            valid = expected == [None] or expected == list(range(len(expected)))
            if got != expected or not valid:
                raise ScheduleError(
                    f"Every stage reduces the same gradient buckets once each (REDUCE, or "
                    f"REDUCE0..REDUCE{{K-1}}). Received: stage {s} has "
                    f"{['REDUCE' if b is None else f'REDUCE{b}' for b in got]}, stage "
                    f"{min(buckets)} has {['REDUCE' if b is None else f'REDUCE{b}' for b in expected]}")

    # -- dry run -------------------------------------------------------------------------------

    def _dry_run(self) -> None:
        """Runs every rank as far as it can; see [Note: deadlock model]."""
        pc = dict.fromkeys(self.schedule, 0)
        done: set[tuple[str, int, int]] = set()   # ("F"/"B", stage, mb) computed
        sent: set[MessageKey] = set()
        progressed = True
        while progressed:
            progressed = False
            for rank, actions in self.schedule.items():
                while pc[rank] < len(actions) and self._ready(actions[pc[rank]], done, sent):
                    self._execute(actions[pc[rank]], done, sent)
                    pc[rank] += 1
                    progressed = True
        stuck = {r: pc[r] for r in self.schedule if pc[r] < len(self.schedule[r])}
        if stuck:
            self._report_deadlock(stuck, done, sent)

    def _ready(self, a: Action, done: set[tuple[str, int, int]], sent: set[MessageKey]) -> bool:
        if a.op in (Op.RECV_F, Op.RECV_B):
            return message_key(a) in sent
        if self.lowered or not a.is_compute or a.microbatch is None:
            return True
        return all(dep in done for dep in self._compute_deps(a))

    def _compute_deps(self, a: Action) -> Iterable[tuple[str, int, int]]:
        i = a.microbatch if a.microbatch is not None else 0
        if a.op is Op.FORWARD:
            return [("F", q, i) for q in self.producers[a.stage]]
        if a.op is Op.WEIGHT:
            return [("B", a.stage, i)]
        return [("B", c, i) for c in self.consumers[a.stage]]

    @staticmethod
    def _execute(a: Action, done: set[tuple[str, int, int]], sent: set[MessageKey]) -> None:
        if a.is_compute and a.microbatch is not None:
            done.add((a.op.value, a.stage, a.microbatch))
        elif a.op in (Op.SEND_F, Op.SEND_B):
            sent.add(message_key(a))

    def _report_deadlock(self, stuck: dict[int, int], done: set[tuple[str, int, int]],
                         sent: set[MessageKey]) -> None:
        waits = []
        for rank, step in sorted(stuck.items()):
            a = self.schedule[rank][step]
            if a.is_comm:
                peer = (self.placement.rank(a.peer)
                        if a.peer is not None and a.peer < self.placement.num_stages else "?")
                waits.append(f"rank {rank} waits at step {step} in {a} for stage {a.peer} "
                             f"(rank {peer}) to send it")
            else:
                missing = [str(Action(s, Op(k), i)) for k, s, i in self._compute_deps(a)
                           if (k, s, i) not in done]
                waits.append(f"rank {rank} waits at step {step} in {a} for {', '.join(missing)}")
        finished = sorted(set(self.schedule) - set(stuck))
        tail = f"; ranks {finished} finished" if finished else ""
        self.fail(
            f"The schedule deadlocks (sends never block, receives wait for their send): "
            f"{'; '.join(waits)}{tail}. Reorder the actions so that every receive's send can "
            f"happen first.", {(r, s): "waits" for r, s in stuck.items()})

    # -- buffers -------------------------------------------------------------------------------

    def _check_buffers(self) -> None:
        if self.max_activations is None:
            return
        for rank in sorted(self.schedule):
            held = 0
            for step, a in enumerate(self.schedule[rank]):
                if a.op is Op.FORWARD:
                    held += 1
                elif a.is_compute and a.op is release_op(a.stage, self.split):
                    held -= 1
                if held > self.max_activations:
                    self.fail(
                        f"A rank holds at most max_activations={self.max_activations} activation "
                        f"sets (forward run, backward not yet). Received: rank {rank} holds "
                        f"{held} at step {step}. Lower active_microbatches or raise the limit.",
                        {(rank, step): f"{held} held"})


def _link_of(a: Action) -> tuple[int, int]:
    """(producer stage, consumer stage) of the link a send or receive uses."""
    peer = a.peer if a.peer is not None else -1
    return (a.stage, peer) if a.op in (Op.SEND_F, Op.RECV_B) else (peer, a.stage)
