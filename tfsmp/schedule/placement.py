"""Stage placement: which pipeline rank runs each stage (model chunk), for every pipeline.

Example::

    Placement(4, 8).rank(5)                             # 1: interleaved, stage s on rank s % p
    v = Placement.for_pipeline("zb-v", num_ranks=4, virtual_stages=2)
    v.rank(7), v.stages(0), v.last_rank                 # 0, [0, 7], 0

[Note: placement] This module is the one owner of stage -> rank placement; generators,
lowering, validation, simulation, pictures and the runtime ask a `Placement`.

* ``interleaved`` (Megatron's): stage ``s`` on rank ``s % p``, so rank ``r`` holds the chunks
  ``r, r + p, r + 2p, ...``. Every pipeline except ``zb-v`` uses it (``v = 1``: one stage each).
* ``v`` (ZB-V, 2 chunks per rank, ``2p`` stages): stage ``s`` on rank ``s`` for ``s < p`` and on
  rank ``2p - 1 - s`` for ``s >= p``. The model goes down the ranks and back up, so rank 0
  holds the first and the last stage and the middle pair ``p-1, p`` shares rank ``p-1``::

      stage: 0 1 2 3 4 5 6 7        (p = 4)
      rank:  0 1 2 3 3 2 1 0
"""

from __future__ import annotations

from dataclasses import dataclass

from tfsmp.errors import ScheduleError

__all__ = ["KINDS", "Placement", "check_virtual_stages"]

KINDS = ("interleaved", "v")


def check_virtual_stages(pipeline: str, virtual_stages: int) -> None:
    """Raises unless ``pipeline`` is registered and ``virtual_stages`` is one it can run ([Note:
    pipeline registry] in registry.py: a record's ``chunks``).

    Raises:
        ScheduleError: an unknown pipeline, or a chunk count other than the one it needs.
    """
    from tfsmp.schedule.registry import get

    need = get(pipeline).chunks
    if need is not None and virtual_stages != need:
        raise ScheduleError(
            f"pipeline={pipeline!r} needs virtual_stages={need} ("
            f"{'one stage' if need == 1 else f'{need} model chunks'} per rank). "
            f"Received: virtual_stages={virtual_stages!r}. Set virtual_stages={need}.")


def __getattr__(name: str) -> tuple[str, ...]:
    """``PIPELINES``: the registered pipelines' names ([Note: pipeline registry])."""
    if name == "PIPELINES":
        from tfsmp.schedule.registry import names

        return names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class Placement:
    """Stage -> pipeline rank, see [Note: placement].

    Example::

        Placement(2, 4).stages(1)              # [1, 3]
        Placement(2, 4, "v").stages(1)         # [1, 2]
    """

    num_ranks: int
    num_stages: int
    kind: str = "interleaved"

    def __post_init__(self) -> None:
        for name in ("num_ranks", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ScheduleError(
                    f"A Placement needs a positive integer {name}. Received: {name}={value!r}")
        if self.kind not in KINDS:
            raise ScheduleError(
                f"Placement kind must be one of {list(KINDS)}. Received: kind={self.kind!r}")
        if self.kind == "v" and self.num_stages != 2 * self.num_ranks:
            raise ScheduleError(
                f"The V placement holds 2 chunks per rank: num_stages = 2 x num_ranks. "
                f"Received: num_ranks={self.num_ranks}, num_stages={self.num_stages}. "
                f"Partition into {2 * self.num_ranks} stages.")

    @classmethod
    def for_pipeline(cls, pipeline: str, num_ranks: int, virtual_stages: int = 1) -> Placement:
        """The placement of ``pipeline``'s ``num_ranks · virtual_stages`` stages.

        Raises:
            ScheduleError: see `check_virtual_stages`, or a count that is not a positive integer.
        """
        if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or (
                virtual_stages < 1):
            raise ScheduleError(f"virtual_stages must be a positive integer. "
                                f"Received: virtual_stages={virtual_stages!r}")
        check_virtual_stages(pipeline, virtual_stages)
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
            raise ScheduleError(
                f"num_ranks must be a positive integer. Received: num_ranks={num_ranks!r}")
        from tfsmp.schedule.registry import get

        return cls(num_ranks, num_ranks * virtual_stages, get(pipeline).placement)

    def rank(self, stage: int) -> int:
        """The pipeline rank that runs ``stage``.

        Raises:
            ScheduleError: ``stage`` is not in ``[0, num_stages)``.
        """
        if not 0 <= stage < self.num_stages:
            raise ScheduleError(
                f"A stage of this placement lies in [0, {self.num_stages}). "
                f"Received: stage={stage}")
        p = self.num_ranks
        if self.kind == "v":
            return stage if stage < p else 2 * p - 1 - stage
        return stage % p

    def stages(self, rank: int) -> list[int]:
        """The stages ``rank`` runs, ascending.

        Raises:
            ScheduleError: ``rank`` is not in ``[0, num_ranks)``.
        """
        p = self.num_ranks
        if not 0 <= rank < p:
            raise ScheduleError(f"A rank of this placement lies in [0, {p}). Received: rank={rank}")
        if self.kind == "v":
            return [rank, 2 * p - 1 - rank]
        return list(range(rank, self.num_stages, p))

    @property
    def last_rank(self) -> int:
        """The rank of the last stage (which computes the loss)."""
        return self.rank(self.num_stages - 1)

    @property
    def chunks_per_rank(self) -> int:
        """The most stages any rank runs."""
        return max(len(self.stages(r)) for r in range(self.num_ranks))

    def rule(self) -> str:
        """The placement rule as a sentence head, for error messages."""
        p = self.num_ranks
        if self.kind == "v":
            return f"In the V placement stage s runs on rank s for s < {p} and on rank {2 * p - 1} - s after"
        return f"Stage s runs on rank s % {p}"

    def describe(self) -> str:
        """``"rank 0: stages 0, 7; rank 1: stages 1, 6; ..."``: for messages and pictures."""
        return "; ".join(f"rank {r}: stages {', '.join(map(str, self.stages(r)))}"
                         for r in range(self.num_ranks))
