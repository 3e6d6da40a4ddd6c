"""Whether a run fits its memory cap, decided before any rank allocates: the plan to run, or why not.

Pure: imports neither TensorFlow nor Keras.

Example::

    decision = check_memory(graph, settings, cap=2.5 * 2**30, plan_for=make_plan)
    if not decision.fits:
        raise ConfigError(decision.message())      # says what would fit
    decision.plan, decision.settings, decision.changes   # what to run, and what was changed

[Note: the launcher obeys the model] A rank that needs more than its cap is killed by the
kernel in the middle of a step (``tfsmp run --memory-per-rank``), or TensorFlow runs out of
device memory on a GPU; either way the job dies after every rank has imported, traced and
allocated. So the memory model ([Note: memory model] in memory.py) decides first, where the
model is known: in ``tfsmp run --model`` before mpirun starts, and on world rank 0 in
``DistributedModel``'s first use before any rank takes its stages. In order:

1. the plan the configuration asks for (under ``optimize: memory`` already the best compute
   split within the cap, [Note: memory plans]) fits: it runs, unchanged;
2. under ``optimize: speed``, recomputation (``optimize: memory``: only the stages' inputs are
   held between forward and backward, and the plan becomes the best compute split within the
   cap) gives the same gradients ([Note: stashing] in tfsmp/runtime/stage.py); where that fits
   and the caller may change the configuration (``allow_changes``: the launcher, which passes
   the change to every rank), it runs, and the change is reported;
3. otherwise nothing runs, and one message names each rank's predicted peak against the cap
   and what would fit (`tfsmp.partitioning.memory_plan.what_fits`: more partitions,
   recomputation, more microbatches), each tried with the planner and the model.

More microbatches or partitions change what a step computes (batch statistics, the number of
processes), so they are named, never picked. The model's agreement with measured peaks is
benchmark 8 (``benchmarks/bench_memory_model.py``): a plan it predicts a few percent under the
cap may still be killed, and one a few percent over would have run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from tfsmp.graph.ir import LayerGraph
from tfsmp.partitioning.memory import MemorySettings, RankMemory, fits, predict_memory
from tfsmp.partitioning.plan import StagePlan

__all__ = ["CHECK_ENV", "MemoryDecision", "check_memory"]

GiB = 2**30
# "off" skips the check (a capacity benchmark measures what really fits, kills included)
CHECK_ENV = "TFSMP_MEMORY_CHECK"


@dataclass(frozen=True)
class MemoryDecision:
    """What the memory model decided for a run ([Note: the launcher obeys the model])."""

    fits: bool
    plan: StagePlan
    settings: MemorySettings
    ranks: tuple[RankMemory, ...]
    cap: float
    changes: tuple[str, ...] = ()  # what was changed so that it fits
    hints: tuple[str, ...] = ()    # what would fit, when nothing tried here does

    def message(self) -> str:
        """One paragraph: fits (and what changed), or what must hold, what was predicted, and
        what would fit."""
        peaks = ", ".join(_size(r.total) for r in self.ranks)
        if self.fits:
            how = f" with {'; '.join(self.changes)}" if self.changes else ""
            return (f"The plan fits {_size(self.cap)} per rank{how}: predicted peak per rank "
                    f"{peaks}.")
        s = self.settings
        over = ", ".join(f"rank {r.rank} {_size(r.total)}" for r in self.ranks
                         if r.total > self.cap)
        fix = ("Fix: " + "; or ".join(self.hints) if self.hints else
               "Fix: a larger cap or a smaller batch (nothing tried fits: more partitions, "
               "optimize 'memory', more microbatches)")
        return (f"Every rank's predicted peak memory must be within its cap ({_size(self.cap)} "
                f"per rank, --memory-per-rank / TFSMP_MEMORY_PER_RANK). Received: "
                f"partitions={s.partitions}, microbatches={s.microbatches}, "
                f"pipeline={s.pipeline!r}, optimize={s.optimize!r}, optimizer={s.optimizer or 'adam'!r}, "
                f"batch {s.batch_size} per replica: {over} (every rank: {peaks}; the memory "
                f"model, docs/memory.md). {fix}. `tfsmp plan --memory-per-rank` shows each "
                f"rank's parts.")


def _size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.0f} MiB"


def check_memory(graph: LayerGraph, settings: MemorySettings, cap: float,
                 plan_for: Callable[[MemorySettings], StagePlan], *,
                 allow_changes: bool = False,
                 what_fits: Callable[[LayerGraph, MemorySettings, float], Sequence[str]]
                 | None = None) -> MemoryDecision:
    """Decides whether the run of ``settings`` fits ``cap`` bytes per rank, and with which plan
    ([Note: the launcher obeys the model]).

    Args:
        graph: the model's layer graph, costed for the batch.
        settings: how it will run.
        cap: bytes per rank.
        plan_for: the plan the runtime makes for some settings (planner, partition file...).
        allow_changes: the caller may switch ``optimize`` to ``"memory"`` (recomputation).
        what_fits: what would fit (default `tfsmp.partitioning.memory_plan.what_fits`).
    """
    plan = plan_for(settings)
    ranks = predict_memory(plan, graph, settings)
    if fits(ranks, cap):
        return MemoryDecision(True, plan, settings, tuple(ranks), cap)
    if settings.drains():  # the runtime's own choice, no change to the configuration
        undrained = replace(settings, drain=0)  # [Note: drain split] in runtime/executor.py
        plain_plan = replace(plan_for(undrained), drain_split=False)
        plain_ranks = predict_memory(plain_plan, graph, undrained)
        if fits(plain_ranks, cap):
            return MemoryDecision(True, plain_plan, undrained, tuple(plain_ranks), cap,
                                  changes=("no drain split (the W's it defers would hold their "
                                           "linear inputs past the cap)",))
    if allow_changes and settings.optimize == "speed":
        lean = replace(settings, optimize="memory", drain=0)
        lean_plan = plan_for(lean)
        lean_ranks = predict_memory(lean_plan, graph, lean)
        if fits(lean_ranks, cap):
            return MemoryDecision(True, lean_plan, lean, tuple(lean_ranks), cap,
                                  changes=("optimize='memory' (recomputation: the same "
                                           "gradients, stages hold only their inputs)",))
    if what_fits is None:
        from tfsmp.partitioning.memory_plan import what_fits as default

        what_fits = default
    return MemoryDecision(False, plan, settings, tuple(ranks), cap,
                          hints=tuple(what_fits(graph, settings, cap)))
