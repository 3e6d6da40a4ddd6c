"""Schedule actions: small immutable values with a text form that parses back (``"1F3"``).

Example::

    a = Action(1, Op.FORWARD, 3)
    str(a)                                  # "1F3": stage 1, forward, microbatch 3
    Action.parse("2RECV_F3<1")              # stage 2 receives microbatch 3's activations from 1
    Action.parse("1W3")                     # stage 1 computes microbatch 3's weight gradients
    schedule = {0: [Action.parse("0F0"), Action.parse("0B0")]}
    parse_schedule(format_schedule(schedule)) == schedule

A `Schedule` maps each pipeline rank to its actions in the order it runs them. Which rank runs
a stage is a `tfsmp.schedule.placement.Placement` (default: stage ``s`` on rank ``s % p``,
Megatron's placement, which `rank_of_stage` and `stages_of_rank` keep for old callers).

[Note: action text] ``{stage}{op}{microbatch}`` for compute (``1F3``, ``1B3``, ``1W3``);
``{stage}SEND_F{mb}>{peer}``, ``{stage}RECV_F{mb}<{peer}`` and the ``_B`` pair for gradients, where
``peer`` is the other *stage*; ``{stage}REDUCE`` (or ``{stage}REDUCE{k}``: gradient bucket ``k``,
see [Note: reduce buckets] in `tfsmp.schedule.lowering`); ``{stage}STEP``. One send/receive
action carries every boundary tensor between its two stages; the runtime sends one buffer per
boundary, tagged with `message_tag`.

[Note: weight actions] ``1W3`` is stage 1's weight-gradient pass of microbatch 3 (zero-bubble
pipelines). In a schedule where a stage has W actions, its ``B`` computes only the gradients of
its inputs (what it sends back) and its ``W`` the gradients of its weights, later, on the same
rank; a stage without W actions runs its whole backward in ``B``. Per stage, every microbatch
has a W or none does (the validator checks it). W moves no message.

[Note: message tags] ``tag = ((boundary·S + dst_stage)·m + microbatch)·2 + backward`` with ``S``
stages and ``m`` microbatches. A boundary names its producer stage, so (boundary, destination
stage, microbatch, direction) names each message of a step exactly once, and the formula is a
bijection onto ``[0, tag_upper_bound(num_boundaries, S, m))``. The runtime checks that bound
against ``MPI_TAG_UB`` (at least 32767 by the MPI standard, 2**31 - 1 with Open MPI's ob1).
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass

from tfsmp.errors import ScheduleError

__all__ = [
    "COMM_OPS",
    "COMPUTE_OPS",
    "Action",
    "MessageKey",
    "Op",
    "Schedule",
    "format_schedule",
    "message_key",
    "message_tag",
    "parse_schedule",
    "rank_of_stage",
    "release_op",
    "stages_of_rank",
    "tag_upper_bound",
    "weight_stages",
]


@functools.total_ordering
class Op(enum.Enum):
    """What an action does. The value is its spelling in the text form."""

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    REDUCE = "REDUCE"
    STEP = "STEP"

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Op):
            return NotImplemented
        return _OP_RANK[self] < _OP_RANK[other]


_OP_RANK = {op: i for i, op in enumerate(Op)}
# Tuples, not sets: `in` on a tuple compares identity first, while hashing an Enum member
# runs Python code, and the validator and simulator test membership in hot loops.
COMPUTE_OPS = (Op.FORWARD, Op.BACKWARD, Op.WEIGHT)
COMM_OPS = (Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B)
_SENDS = (Op.SEND_F, Op.SEND_B)

_ACTION_RE = re.compile(
    r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|REDUCE|STEP|F|B|W)(\d+)?(?:([<>])(\d+))?$")


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank. See [Note: action text] for the text form.

    Example::

        Action(1, Op.SEND_F, 3, peer=2)      # "1SEND_F3>2"
        Action(0, Op.REDUCE)                 # "0REDUCE"
    """

    stage: int
    op: Op
    microbatch: int | None = None
    peer: int | None = None

    def __post_init__(self) -> None:
        problem = _shape_problem(self)
        if problem:
            raise ScheduleError(
                f"{problem}. Received: stage={self.stage}, op={self.op}, "
                f"microbatch={self.microbatch}, peer={self.peer}")

    def __str__(self) -> str:
        text = f"{self.stage}{self.op.value}"
        if self.microbatch is not None:
            text += str(self.microbatch)
        if self.peer is not None:
            text += (">" if self.op in _SENDS else "<") + str(self.peer)
        return text

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    @property
    def is_comm(self) -> bool:
        return self.op in COMM_OPS

    @classmethod
    def parse(cls, text: str) -> Action:
        """Reads the text form back, e.g. ``"1F3"``, ``"2RECV_F3<1"``, ``"0REDUCE"``.

        Raises:
            ScheduleError: the text is not an action.
        """
        match = _ACTION_RE.match(text.strip())
        if not match:
            raise ScheduleError(
                f"An action reads like '1F3', '1B3', '1W3', '1SEND_F3>2', '2RECV_F3<1', '2SEND_B3>1', "
                f"'1RECV_B3<2', '1REDUCE' or '1STEP'. Received: text={text!r}")
        stage, op_text, mb, arrow, peer = match.groups()
        op = Op(op_text)
        if arrow is not None and (arrow == ">") != (op in _SENDS):
            raise ScheduleError(
                f"Sends point to their peer with '>' and receives with '<'. Received: text={text!r}")
        return cls(int(stage), op, None if mb is None else int(mb),
                   None if peer is None else int(peer))


def _shape_problem(a: Action) -> str:
    """Why an action's fields do not fit its op ('' when they do)."""
    if a.stage < 0:
        return "An action's stage must be >= 0"
    needs_microbatch = a.op in COMPUTE_OPS or a.op in COMM_OPS
    if needs_microbatch and (a.microbatch is None or a.microbatch < 0):
        return f"A {a.op.name} action needs a microbatch >= 0"
    if a.op in COMM_OPS:
        if a.peer is None or a.peer < 0 or a.peer == a.stage:
            return f"A {a.op.name} action needs a peer stage >= 0 other than its own stage"
    elif a.peer is not None:
        return f"Only send and receive actions have a peer, not {a.op.name}"
    if a.op is Op.REDUCE and a.microbatch is not None and a.microbatch < 0:
        return "A REDUCE bucket index must be >= 0"
    if a.op is Op.STEP and a.microbatch is not None:
        return "A STEP action has no microbatch"
    return ""


Schedule = dict[int, list[Action]]

# (sender stage, receiver stage, direction "F" or "B", microbatch)
MessageKey = tuple[int, int, str, int]


def message_key(a: Action) -> MessageKey:
    """The message a send or receive action moves; a send and its receive have equal keys."""
    direction = "F" if a.op in (Op.SEND_F, Op.RECV_F) else "B"
    peer = -1 if a.peer is None else a.peer
    mb = -1 if a.microbatch is None else a.microbatch
    return (a.stage, peer, direction, mb) if a.op in _SENDS else (peer, a.stage, direction, mb)


def format_schedule(schedule: Schedule) -> str:
    """One line per rank, ranks ascending: ``"0: 0F0 0F1 0B0 0B1"``."""
    return "\n".join(
        f"{rank}:" + "".join(f" {a}" for a in schedule[rank]) for rank in sorted(schedule))


def parse_schedule(text: str) -> Schedule:
    """Reads `format_schedule` output back. Blank lines and lines starting with ``#`` are skipped.

    Raises:
        ScheduleError: a line is not ``"<rank>: <action> ..."`` or a rank appears twice.
    """
    schedule: Schedule = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        head, sep, rest = line.partition(":")
        if not sep or not head.strip().isdigit():
            raise ScheduleError(
                f"A schedule line reads '<rank>: <action> <action> ...'. "
                f"Received: line {number}: {line!r}")
        rank = int(head)
        if rank in schedule:
            raise ScheduleError(f"Each rank has one line. Received: rank {rank} twice (line {number})")
        schedule[rank] = [Action.parse(word) for word in rest.split()]
    return schedule


def weight_stages(schedule: Schedule) -> set[int]:
    """The stages with W actions: their B leaves the weight gradients to W ([Note: weight actions])."""
    return {a.stage for actions in schedule.values() for a in actions if a.op is Op.WEIGHT}


def release_op(stage: int, split: set[int]) -> Op:
    """The action after which ``stage`` no longer holds a microbatch's activations: its W when
    it has W actions (``stage in split``, from `weight_stages`), else its B."""
    return Op.WEIGHT if stage in split else Op.BACKWARD


def rank_of_stage(stage: int, num_ranks: int) -> int:
    """The pipeline rank that runs ``stage``: ``stage % num_ranks`` (virtual stage c·p + r → r).

    The interleaved placement only; `tfsmp.schedule.placement.Placement` covers every pipeline.
    """
    if num_ranks < 1 or stage < 0:
        raise ScheduleError(
            f"rank_of_stage needs stage >= 0 and num_ranks >= 1. "
            f"Received: stage={stage}, num_ranks={num_ranks}")
    return stage % num_ranks


def stages_of_rank(rank: int, num_ranks: int, num_stages: int) -> list[int]:
    """The stages a rank runs, ascending: ``rank, rank + p, rank + 2p, ...``."""
    return list(range(rank, num_stages, num_ranks))


def message_tag(boundary_index: int, dst_stage: int, microbatch: int, backward: bool,
                num_stages: int, num_microbatches: int) -> int:
    """The MPI tag of one boundary tensor of one microbatch (see [Note: message tags]).

    Returns:
        ``((boundary_index·num_stages + dst_stage)·num_microbatches + microbatch)·2 + backward``,
        unique per message within a step and below
        ``tag_upper_bound(num_boundaries, num_stages, num_microbatches)``.

    Raises:
        ScheduleError: an argument is out of range.
    """
    if (boundary_index < 0 or not 0 <= dst_stage < num_stages
            or not 0 <= microbatch < num_microbatches):
        raise ScheduleError(
            f"message_tag needs boundary_index >= 0, 0 <= dst_stage < num_stages and "
            f"0 <= microbatch < num_microbatches. Received: boundary_index={boundary_index}, "
            f"dst_stage={dst_stage}, microbatch={microbatch}, num_stages={num_stages}, "
            f"num_microbatches={num_microbatches}")
    return ((boundary_index * num_stages + dst_stage) * num_microbatches + microbatch) * 2 + int(
        backward)


def tag_upper_bound(num_boundaries: int, num_stages: int, num_microbatches: int) -> int:
    """One more than the largest tag `message_tag` can return: ``2·B·S·m``."""
    return 2 * num_boundaries * num_stages * num_microbatches
