"""The optimizer's side of a rank's step: which variables it updates, direct updates or accumulators, the apply.

Example::

    updates = Updates(programs, ties, run, pipe_rank=0, group=comm.pipeline, xla=False,
                      rank_tag="[rank 0]", counted=lambda variables: [True] * len(variables))
    updates.set(optimizer)                  # builds it, decides direct updates ([Note: direct update])
    updates.apply(grads_by_stage, factor)   # optimizer.apply_gradients of the step's gradients
    updates.finalize()                      # the end of fit (use_ema)

With sharded optimizer state ([Note: optimizer shards] in tfsmp/partitioning/shards.py), ``owned``
names the variables this replica's optimizer builds slots for and updates; after each update
the owners' new values go to the other replicas ([Note: weight exchange] in sharding.py), and
``global_clipnorm`` sums the owned gradients' squared norms over every rank of the job
(``clip_group``), so the norm still covers every gradient once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from tfsmp.errors import StepError
from tfsmp.runtime.memory import DirectUpdate, is_multi_optimizer
from tfsmp.runtime.optimizer_options import OptimizerBridge
from tfsmp.runtime.sharding import WeightExchange

if TYPE_CHECKING:
    from tfsmp.runtime.gradients import GradientState
    from tfsmp.runtime.stage import StageProgram
    from tfsmp.runtime.ties import TiedCopies
    from tfsmp.schedule.run_plan import RunPlan

__all__ = ["Updates"]


class Updates:
    """The optimizer of this rank's variables. See the module docstring."""

    def __init__(self, programs: Mapping[int, StageProgram], ties: TiedCopies, run: RunPlan, *,
                 pipe_rank: int, group: Any, xla: bool, rank_tag: str,
                 counted: Callable[[list[Any]], list[bool]], owned: set[int] | None = None,
                 exchange_group: Any = None, clip_group: Any = None,
                 watch: Callable[[str], Any] | None = None,
                 everywhere: Callable[[], list[Any]] = list) -> None:
        self.programs = programs
        self.everywhere = everywhere  # the whole model's trainable variables, every rank's
        self._elsewhere: list[Any] = []  # [Note: sub-optimizers elsewhere]
        # (variable, stage, index) of each trainable variable of this rank once ([Note: tied
        # reduction] in ties.py: a variable on two local stages is updated from its first)
        self.unique = ties.unique()
        self.possible = run.direct_possible(pipe_rank)  # may stages update in their backward?
        self.direct_allowed = run.updates_directly
        # [Note: weights at the step's end] in stage.py: the same, for several microbatches
        self.late_possible = run.late_possible(pipe_rank)
        self.microbatches = run.num_microbatches
        self.pipe_rank = pipe_rank
        self.group = group
        self.xla = xla
        self.rank_tag = rank_tag
        self.counted = counted  # per variable: whether this rank counts it once in the job
        self.optimizer: Any = None
        self.bridge: OptimizerBridge | None = None
        self._direct = False  # stages update inside their backward ([Note: direct update])
        self.late = False  # linear layers' gradients computed in the update at the step's end
        self._late_update: DirectUpdate | None = None
        # sharded optimizer state: positions in `unique` this replica owns (None: all of them)
        self.mine: list[int] | None = None
        self.exchange: WeightExchange | None = None
        self.clip_group = group
        self.data_group = exchange_group  # this rank's data-parallel replicas
        self.replicas = exchange_group.size if exchange_group is not None else 1
        if owned is not None and exchange_group is not None and exchange_group.size > 1:
            self.mine = [j for j, (v, _, _) in enumerate(self.unique) if id(v) in owned]
            if len(self.mine) != len(owned):
                raise StepError(
                    f"{rank_tag} Every variable whose optimizer state this replica owns must be "
                    f"one the rank updates. Received: {len(owned)} owned, {len(self.mine)} of "
                    f"them among the rank's {len(self.unique)} trainable variables. This is a "
                    f"tfsmp bug; set shard_optimizer_state=False meanwhile.")
            self.exchange = WeightExchange(self.variables, [id(v) in owned for v in self.variables],
                                           exchange_group, watch)
            self.clip_group = clip_group if clip_group is not None else group

    @property
    def direct(self) -> bool:
        """Whether the stages update inside their backward ([Note: direct update]): where a
        stage took late weights instead ([Note: late before direct] in stage.py), not."""
        return self._direct and not any(p.late for p in self.programs.values())

    @property
    def by_variable(self) -> bool:
        """Whether the run and the optimizer allow updating variable by variable as gradients
        arrive (`RunPlan.updates_directly`), whether the stages then chose direct updates or
        late weights ([Note: one-call direct update] in fused_step.py)."""
        return self._direct

    @property
    def variables(self) -> list[Any]:
        return [v for v, _, _ in self.unique]

    @property
    def optimizer_variables(self) -> list[Any]:
        """What this rank's optimizer updates: `variables`, or the ones its replica owns."""
        if self.mine is None:
            return self.variables
        return [self.unique[j][0] for j in self.mine]

    def set(self, optimizer: Any) -> None:
        """Steps with ``optimizer`` from now on (None: an SMP script applies its own)."""
        self.optimizer = optimizer
        self.bridge = None
        if optimizer is None:
            self._set_direct(False)
            return
        mine = self.optimizer_variables
        if not optimizer.built:
            optimizer.build(mine)
        self._elsewhere = _subs_elsewhere(getattr(optimizer, "inner_optimizer", optimizer),
                                          self.everywhere, mine)
        self.bridge = OptimizerBridge(optimizer, mine, self.counted(mine), self.clip_group,
                                      xla=self.xla, rank_tag=self.rank_tag)
        # [Note: direct update]: an optimizer with nothing beyond Keras's own apply that
        # updates variable by variable; otherwise the stages accumulate
        self._set_direct(self.direct_allowed(
            self.pipe_rank, self.bridge.plain and DirectUpdate.possible(optimizer)))

    def _set_direct(self, direct: bool) -> None:
        if self.possible:
            for prog in self.programs.values():
                prog.set_update(DirectUpdate(self.optimizer) if direct else None)
        self._direct = direct
        late = (self.late_possible and self.bridge is not None and self.bridge.plain
                and DirectUpdate.possible_late(self.optimizer))
        if self.late_possible:
            for prog in self.programs.values():
                # across replicas a step's rows are every replica's ([Note: late weights
                # across replicas] in stage.py)
                prog.set_late(late, self.microbatches * self.replicas)
        self.late = late
        self._late_update = DirectUpdate(self.optimizer) if late else None

    def settle_late_without_rows(self) -> None:
        """A step in which some replica has no rows, before the stages decided on weights at
        the step's end: every replica takes accumulators for good. The decision is made at a
        stage's first forward, which a replica without rows does not run, so it could not know
        which variables the others accumulate and their reductions would not match (a batch
        smaller than the replica count, first thing in a job, hung). Every rank sees the same
        step shape, so every replica settles alike."""
        if self.late and self.replicas > 1 and any(p.late_undecided for p in self.programs.values()):
            for prog in self.programs.values():
                prog.set_late(False, self.microbatches * self.replicas)
            self.late, self._late_update = False, None

    def apply(self, grads: Mapping[int, GradientState], factor: float, strict: bool = True
              ) -> None:
        """optimizer.apply_gradients of this step's gradients (read from the step's result,
        [Note: results own their gradients] in gradients.py), each times ``factor``;
        ``strict``: a non-finite gradient met in a late update raises (else it is applied, as
        Keras applies it)."""
        mine = list(range(len(self.unique))) if self.mine is None else self.mine
        if self.late and all(p.late for p in self.programs.values()):
            # [Note: weights at the step's end] in stage.py; across replicas, every replica
            # takes part in gathering the rows, owners or not ([Note: late weights across
            # replicas])
            self._apply_late(factor, strict)
            if not mine and self.optimizer is not None:
                self.optimizer.iterations.assign_add(1)
            self._exchange()
            return
        if not mine and self.optimizer is not None:
            # a rank (or replica) with nothing to update counts the step too: callbacks there
            # read the optimizer's iterations (and learning-rate schedules) as on every other
            # rank; and it adds nothing to the global norm's sum, which the others wait for
            if self.bridge is not None:
                self.bridge.join_global_norm()
            self.optimizer.iterations.assign_add(1)
            self._count_elsewhere()
            self._exchange()
            return
        if self.bridge is None:
            return
        sparse: dict[str, tuple[tf.Tensor, tf.Tensor]] = {}
        for n, j in enumerate(mine):
            _, s, i = self.unique[j]
            found = grads[s].sparse.get(i)
            if found is not None:
                sparse[str(n)] = found
        self.bridge.apply([grads[self.unique[j][1]].accumulators[self.unique[j][2]] for j in mine],
                          sparse, factor)
        self._count_elsewhere()
        self._exchange()

    def _count_elsewhere(self) -> None:
        """[Note: sub-optimizers elsewhere]: an applied step counts on them too."""
        for sub in self._elsewhere:
            sub.iterations.assign_add(1)

    def _exchange(self) -> None:
        """[Note: weight exchange] in sharding.py: the owners' new values to every replica."""
        if self.exchange is not None:
            self.exchange.exchange()

    def _apply_late(self, factor: float, strict: bool) -> None:
        update = self._late_update or DirectUpdate(self.optimizer)
        group = self.data_group if self.replicas > 1 else None
        owned = None if self.mine is None else {id(v) for v in self.optimizer_variables}
        finite = all([p.apply_late(update, factor, group, owned)
                      for p in self.programs.values()])
        if strict and not finite:
            raise StepError(
                f"{self.rank_tag} Non-finite weight gradients on this rank; they are computed "
                f"during the update ([Note: weights at the step's end]), so variables with "
                f"finite gradients were updated. Lower the learning rate, check the data, or "
                f"set nonfinite='skip' to skip such updates on every rank.")

    def skipped(self) -> bool:
        """A skipped step: the loss-scale optimizer lowers its scale (True), else nothing."""
        return self.bridge is not None and self.bridge.on_nonfinite()

    def finalize(self) -> None:
        """What Keras does at the end of ``fit``: the optimizer's final variable values (its
        exponential moving averages, with ``use_ema``) on every rank's own variables."""
        if self.optimizer is not None and self.unique:
            if self.optimizer_variables:
                self.optimizer.finalize_variable_values(self.optimizer_variables)
            self._exchange()


# [Note: sub-optimizers elsewhere] Keras's MultiOptimizer hands each variable to the
# sub-optimizer its OptimizerMap names, and a sub-optimizer counts a step (its ``iterations``,
# which its learning-rate schedule reads) whenever it updates a variable. A pipeline rank's
# MultiOptimizer is built on that rank's variables only, so a sub-optimizer whose variables
# all live on other ranks would never count there: a callback, a schedule or a saved file read
# on this rank would see 0 where plain Keras's shows the step count. Such a sub-optimizer is
# built here on no variables (so that it is built, as in plain Keras, and a callback such as
# SwapEMAWeights finds its empty averages) and counts every step this rank applies. One that
# the map names for no variable of the model stays unbuilt and at 0, as in plain Keras.
def _subs_elsewhere(optimizer: Any, everywhere: Callable[[], list[Any]],
                    mine: list[Any]) -> list[Any]:
    """The sub-optimizers of a MultiOptimizer that update some variable of the model but none of
    ``mine`` ([Note: sub-optimizers elsewhere]), built on no variables; [] for any other
    optimizer, or a map that is not an OptimizerMap (refused at partitions > 1)."""
    import keras

    mapping = getattr(optimizer, "_optimizer_map", None)
    if not is_multi_optimizer(optimizer) or not isinstance(mapping,
                                                           keras.optimizers.OptimizerMap):
        return []
    here = {id(mapping(v)) for v in mine}
    used = {id(sub): sub for sub in map(mapping, everywhere())}
    out = [sub for key, sub in used.items() if key not in here]
    for sub in out:
        if not sub.built:
            sub.build([])
    return out
