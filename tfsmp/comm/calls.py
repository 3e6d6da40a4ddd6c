"""Collective calls as the watchdog sees them: who calls what (labels), and who never arrived.

Example::

    with collective_label("DistributedModel.get_weights"):
        parts = comm.pipeline.allgather_obj(mine)     # watched: see tfsmp.comm.watchdog

    # a rank whose collective waits past stall_timeout explains it from every rank's record:
    explain(call, me=0, statuses={0: ..., 1: ...}, stall_timeout=600.0)

[Note: collective labels] The comm seam knows the collective (``allgather_obj`` on the world
group, call #12) but not why it runs; the user knows the API they called
(``model.get_weights()``). Entry points that issue collectives wrap them in
``collective_label("DistributedModel.get_weights")``; labels nest, the outermost names the
user's API (``api``), the innermost, if another, what tfsmp does inside it (``what``, e.g.
"the per-step preemption check"). The labels of a thread are a plain list: entering and leaving
one costs a list append and pop.

[Note: who arrived] Every group counts its collective calls, on every rank alike, since MPI
requires every member to call a group's collectives in the same order. Each rank's status record
(tfsmp.comm.watchdog) holds its count per group and the call it is in. For a call ``#n`` of group
``g`` a member has *arrived* if its count for ``g`` is past ``n``, or is ``n`` and it is inside
that same call (or has left it: a broadcast's root may); it called *something else* if it is
inside call ``#n`` of ``g`` under another name or operation; otherwise it has *not arrived*, and
its process state says why: stopped (SIGSTOP, a debugger), gone, finished its script, inside
another group's collective, or computing.

[Note: the same call] MPI matches a group's collectives by their order alone: two ranks at the
same call number in different APIs (a script that catches one rank's error and calls `fit`
again, whose callbacks' agreement then meets the other ranks' per-step batch agreement) are
matched, and each gets the other's object, a confusing failure at best and a wrong value at
worst. So every object collective (``allgather_obj``, ``bcast_obj``) sends its `signature` (the
operation and this thread's labels) with its object, and `same_call` compares what arrives with
this rank's own: a difference raises a `CommError` naming both calls, on every rank that sees
it (for a broadcast, the receivers), before any rank uses the object. A signature is a tuple of
three short strings, pickled with the object (under a microsecond); the buffer collectives
(``allreduce_``, ``barrier``) carry no object and are not checked.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["GROUP_NAMES", "Call", "arrival", "collective_label", "describe", "explain", "labels",
           "same_call", "signature"]

# Group index -> name; the order of `Comm.groups()`, then Horovod's communicator.
GROUP_NAMES = ("world", "pipeline", "data", "user_world", "user_pipeline", "user_data",
               "horovod", "other")
OTHER_GROUP = len(GROUP_NAMES) - 1

# What a collective does to "every rank", for the sentence that names the user's API.
_VERBS = {
    "allgather_obj": "gathers from", "bcast_obj": "broadcasts to", "barrier": "waits for",
    "allreduce_": "sums over", "allreduce_obj": "reduces over",
    "grouped_allreduce": "sums over",
}

_local = threading.local()


def labels() -> list[tuple[str, bool]]:
    """This thread's labels, outermost first: (text, whether it names a user-level API)."""
    stack: list[tuple[str, bool]] | None = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


@contextmanager
def collective_label(label: str, *, api: bool = True) -> Iterator[None]:
    """Names the API whose collectives run inside the block ([Note: collective labels]).

    Also a decorator: ``@collective_label("DistributedModel.save")``.

    Args:
        label: The user-level call, e.g. "DistributedModel.get_weights" (no parentheses).
        api: False for what tfsmp does inside an API ("the per-step preemption check"): the
            message then names it in parentheses and never tells the user to call it.
    """
    stack = labels()
    stack.append((label, api))
    try:
        yield
    finally:
        stack.pop()


@dataclass(frozen=True)
class Call:
    """One collective call of this rank (or a point-to-point receive, with ``peer``)."""

    group: int          # index into GROUP_NAMES
    op: str             # the Group method: "allgather_obj", "barrier", "recv_obj", ...
    seq: int            # this group's call count, from 1 (0 for point-to-point)
    api: str = ""       # outermost label
    what: str = ""      # innermost label, when it differs
    ranks: tuple[int, ...] = ()   # the group's world ranks
    peer: int | None = None       # world rank of a receive's source

    @property
    def group_name(self) -> str:
        return GROUP_NAMES[self.group] if 0 <= self.group < len(GROUP_NAMES) else "other"

    @staticmethod
    def of(group: Any, op: str, seq: int, peer: int | None = None) -> Call:
        stack = labels()
        api = next((text for text, is_api in stack if is_api), "")
        what = next((text for text, is_api in reversed(stack) if text != api), "")
        return Call(int(getattr(group, "index", OTHER_GROUP)), op, seq, api, what,
                    tuple(getattr(group, "ranks", ())), peer)


def signature(op: str) -> tuple[str, str, str]:
    """What identifies a collective call across ranks: its operation and labels ([Note: the
    same call]); the call number is the group's, counted alike on every rank."""
    c = Call.of(None, op, 0)
    return (op, c.api, c.what)


def same_call(group: Any, sig: tuple[str, str, str], received: Mapping[int, Any]) -> None:
    """Raises unless every received signature equals this rank's ``sig`` ([Note: the same call]).

    Args:
        group: The group of the call (its ``index``, ``ranks``, ``rank`` and ``calls``).
        sig: This rank's `signature` of the call.
        received: Group rank -> the signature that rank sent.

    Raises:
        CommError: naming this rank's call and every rank's that differs.
    """
    odd = {r: s for r, s in received.items() if s != sig}
    if not odd:
        return
    from tfsmp.errors import CommError

    index = int(getattr(group, "index", OTHER_GROUP))
    ranks = list(getattr(group, "ranks", ()))
    seq = int(getattr(group, "calls", 0))

    def world(r: int) -> int:
        return int(ranks[r]) if 0 <= r < len(ranks) else r

    me = world(int(getattr(group, "rank", 0)))
    theirs = "; ".join(
        f"world rank {world(r)} is in "
        + (describe(index, s[0], seq, s[1], s[2]) if isinstance(s, tuple) and len(s) == 3
           else f"a call that sent no signature ({s!r})")
        for r, s in sorted(odd.items()))
    raise CommError(
        f"Every rank of a group must make the same collective calls in the same order, and "
        f"call #{seq} of the {GROUP_NAMES[index] if 0 <= index < len(GROUP_NAMES) else 'other'} "
        f"group differs between ranks. Received: this rank (world rank {me}) is in "
        f"{describe(index, sig[0], seq, sig[1], sig[2])}; {theirs}. Fix: call tfsmp's "
        f"collective APIs (fit, evaluate, predict, save, get_weights, smp.broadcast, ...) on "
        f"every rank in the same order; a script that catches an error on one rank and goes on "
        f"leaves the ranks at different calls.")


def describe(group: int, op: str, seq: int, api: str, what: str) -> str:
    """``allgather_obj #12 on the world group in DistributedModel.get_weights (what)``."""
    name = GROUP_NAMES[group] if 0 <= group < len(GROUP_NAMES) else "other"
    text = f"{op} #{seq} on the {name} group" if seq else f"{op} on the {name} group"
    if api:
        text += f" in {api}"
    if what:
        text += f" ({what})"
    return text


class _Record(Protocol):
    """What `explain` reads of a rank's status (tfsmp.comm.watchdog.Status)."""

    state: str
    pid: int
    group: int
    call_seq: int
    op: str
    api: str
    what: str
    seqs: tuple[int, ...]
    process: str   # "running", "stopped", "gone", "" (unknown: another host)


def arrival(call: Call, st: _Record) -> str | None:
    """"arrived", "other" (inside this call number under another name) or None."""
    count = st.seqs[call.group] if 0 <= call.group < len(st.seqs) else 0
    if count > call.seq:
        return "arrived"
    if count < call.seq:
        return None
    inside = st.state == "waiting" and st.group == call.group and st.call_seq == call.seq
    if inside and (st.op, st.api) != (call.op, call.api):
        return "other"
    return "arrived"


def _absent(st: _Record | None) -> str:
    """Why a member is not in the call, from its record and process state."""
    if st is None:
        return "no status"
    if st.process == "stopped":
        return f"its process {st.pid} is stopped (SIGSTOP or a debugger)"
    if st.process == "gone":
        return f"its process {st.pid} is gone (killed, crashed or exited)"
    if st.state == "exited":
        return "its script ended (it waits in MPI_Finalize)"
    if st.state == "waiting" and st.group >= 0:
        return f"it waits in {describe(st.group, st.op, st.call_seq, st.api, st.what)}"
    return "it runs its own code (computing, or the script between calls)"


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def explain(call: Call, me: int, statuses: Mapping[int, _Record | None], outer: str = "") -> str:
    """Why ``call`` waits, to follow "waited more than stall_timeout=Ns " ([Note: who arrived]).

    Args:
        call: The call this rank (world rank ``me``) waits in.
        statuses: World rank -> its record (None: none readable), for the group's members.
        outer: What the caller said it waits for, if anything ("the data-parallel allreduce of
            stage 0's gradients").
    """
    where = describe(call.group, call.op, call.seq, call.api, call.what)
    lead = f"for {outer}, in {where}" if outer else f"in {where}"
    if call.peer is not None:
        st = statuses.get(call.peer)
        text = f"{lead}, for a message from rank {call.peer}: {_absent(st)}."
        return text + (_advice(call, [st], False) if st is None or st.state != "waiting" else "")
    arrived: list[int] = [me]
    other: list[int] = []
    absent: list[int] = []
    for rank in call.ranks:
        if rank == me:
            continue
        st = statuses.get(rank)
        # a stopped or dead member cannot finish the call even if it entered it
        usable = st is not None and st.process not in ("stopped", "gone")
        found = arrival(call, st) if st is not None and usable else None
        (arrived if found == "arrived" else other if found == "other" else absent).append(rank)
    text = (f"{lead}, a collective call every rank of the group ({_ranks(list(call.ranks))}) "
            f"must make. Arrived: {_ranks(sorted(arrived))}.")
    for rank in other:
        st = statuses[rank]
        if st is not None:
            text += (f" Rank {rank} called another collective there: "
                     f"{describe(call.group, st.op, call.seq, st.api, st.what)}.")
    if len(absent) == 1:
        text += f" Not arrived: rank {absent[0]} ({_absent(statuses.get(absent[0]))})."
    elif absent:
        reasons = "; ".join(f"rank {r}: {_absent(statuses.get(r))}" for r in absent)
        text += f" Not arrived: {_ranks(absent)} ({reasons})."
    return text + _advice(call, [statuses.get(r) for r in absent], bool(other))


def _advice(call: Call, absent: list[_Record | None], mismatch: bool) -> str:
    """The fix: look at a stopped or dead rank, or call a collective API on every rank."""
    processes = {st.process if st is not None else "" for st in absent}
    if absent and processes <= {"stopped", "gone"}:
        return (" A rank that stops or dies makes its peers wait: look at its host and process "
                "(`kill -CONT <pid>` resumes a stopped one).")
    slow = any(st is not None and st.process == "running" and st.state != "exited"
               and not (st.state == "waiting" and st.group >= 0) for st in absent)
    tail = " If a rank is only slow, raise stall_timeout in the config." if slow else ""
    if call.api:
        verb = _VERBS.get(call.op, "runs on")
        return (f" `{call.api}()` {verb} every rank: call it on every rank, not only where "
                f"rank == 0, and in the same order everywhere.{tail}")
    skipped = mismatch or any(st is not None and st.state == "exited" for st in absent)
    if skipped:
        return (" The call is collective: every rank of the group must make it, in the same "
                "order; a script that makes it only on some ranks (e.g. under `if rank == 0`) "
                "hangs.")
    return " Every rank of a group must make the same collective calls in the same order." + tail
