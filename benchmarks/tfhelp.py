"""Rank-side helpers of the benchmarks: threads, models, step timing, quiet waits, memory.

Example::

    setup_threads()                                   # TFSMP_BENCH_THREADS (set by `launch`)
    model = dense_stack(width=1024, depth=8)
    times = fit_step_times(model, x, y, batch_size=256, steps=4)   # seconds of 4 steady steps
    sleepy_barrier()                                  # wait for the other ranks without spinning
"""

from __future__ import annotations

import itertools
import os
import resource
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "batch_step_time",
    "concurrency_efficiency",
    "dense_stack",
    "fit_step_clocks",
    "fit_step_times",
    "make_data",
    "peak_rss_bytes",
    "reinit",
    "setup_threads",
    "sleepy_barrier",
    "world",
]


def setup_threads() -> int:
    """Caps TensorFlow's thread pools at ``TFSMP_BENCH_THREADS`` (before any TF op runs)."""
    import tensorflow as tf

    threads = int(os.environ.get("TFSMP_BENCH_THREADS", "1"))
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    return threads


def world() -> Any:
    """mpi4py's COMM_WORLD."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def sleepy_barrier(poll: float = 0.002) -> None:
    """A barrier that sleeps between polls, so a waiting rank leaves its core to the others
    (MPI's blocking barrier spins, which would slow a baseline running on the other rank)."""
    req = world().Ibarrier()
    while not req.Test():
        time.sleep(poll)


def slowest_rank(times: Sequence[float]) -> list[float]:
    """Per step, the slowest rank's time of ``times`` (this rank's, one per step).

    [Note: the slowest rank's step] A pipeline step is over when its last rank is: each rank
    times its own steps, and after them (outside the timed region) the ranks take the maximum
    per step, so every rank returns the same list. Until 2026-12-05 the multi-rank benchmarks
    counted rank 0's clock alone, which misses work a later rank does after rank 0 is done:
    tfsmp's last stage runs its drain W's and its update after sending rank 0 its last
    gradients (1-5 ms after rank 0 ends, in a traced GPipe step), and a scratch variant that
    moved the last stage's weight gradients into its update measured 10 % faster on rank 0's
    clock while its last rank ended 180 ms after rank 0. Every rank must call it."""
    from mpi4py import MPI

    mine = np.asarray(list(times), dtype=np.float64)
    out = np.empty_like(mine)
    world().Allreduce(mine, out, op=MPI.MAX)
    return [float(t) for t in out]


def dense_stack(width: int = 1024, depth: int = 8, seed: int = 0, name: str = "dense_stack"
                ) -> Any:
    """``Input(width)`` then ``depth`` Dense(width) layers (relu except the last): equal,
    weight-dominated layers, so any plan into stages dividing ``depth`` is balanced."""
    import keras

    x = keras.Input((width,), name="x")
    h = x
    for i in range(depth):
        h = keras.layers.Dense(
            width, activation="relu" if i < depth - 1 else None, name=f"dense{i}",
            kernel_initializer=keras.initializers.GlorotUniform(seed=seed * 1000 + i),
            bias_initializer="zeros")(h)
    return keras.Model(x, h, name=name)


def make_data(rows: int, width: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random float32 inputs and targets of ``rows`` × ``width``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, width), dtype=np.float32)
    y = rng.standard_normal((rows, width), dtype=np.float32) * 0.1
    return x, y


def _step_timer() -> Any:
    import keras

    class StepTimer(keras.callbacks.Callback):  # type: ignore[misc]
        """Records the wall-clock and process CPU time at the end of every training batch."""

        def __init__(self) -> None:
            super().__init__()
            self.ends: list[float] = []
            self.cpu_ends: list[float] = []

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.ends.append(time.perf_counter())
            self.cpu_ends.append(time.process_time())

    return StepTimer()


def fit_step_times(model: Any, x: np.ndarray, y: np.ndarray, batch_size: int, steps: int
                   ) -> list[float]:
    """Seconds of ``steps`` steady-state `fit` steps: one ``fit`` call of ``steps + 1`` batches;
    a step's time is the interval between consecutive batch ends, so the call's own set-up
    (data adapter, callbacks) and the first batch are excluded."""
    return fit_step_clocks(model, x, y, batch_size, steps)[0]


def fit_step_clocks(model: Any, x: np.ndarray, y: np.ndarray, batch_size: int, steps: int
                    ) -> tuple[list[float], list[float]]:
    """`fit_step_times` and the same steps' process CPU seconds (every thread's: TensorFlow's
    pools included), which other jobs on the machine disturb far less than wall-clock time."""
    timer = _step_timer()
    model.fit(x[: (steps + 1) * batch_size], y[: (steps + 1) * batch_size], batch_size=batch_size,
              epochs=1, steps_per_epoch=steps + 1, shuffle=False, verbose=0, callbacks=[timer])
    return ([b - a for a, b in itertools.pairwise(timer.ends)],
            [b - a for a, b in itertools.pairwise(timer.cpu_ends)])


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports kilobytes)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reinit(config: dict[str, Any]) -> Any:
    """`tfsmp.shutdown()` then `tfsmp.init(config)`: one process measures several configs."""
    import tfsmp

    tfsmp.shutdown()
    tfsmp.init(config)
    return tfsmp


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def concurrency_efficiency(model: Any, x: np.ndarray, y: np.ndarray, rounds: int) -> float | None:
    """η, how much of two cores two single-thread processes get here right now: per round, rank
    0 runs one `train_on_batch` step of ``model`` alone, then every rank runs one step of its own
    copy at once. Returns (on rank 0) the median over rounds of the solo step time over the mean
    concurrent one (1.0 = two free cores; 0.5 = the two processes shared one core); other ranks
    return None."""
    from statistics import median

    comm = world()
    ratios = []
    for _ in range(rounds):
        sleepy_barrier()
        solo = batch_step_time(model, x, y) if comm.Get_rank() == 0 else 0.0
        sleepy_barrier()
        times = comm.gather(batch_step_time(model, x, y), root=0)
        if times is not None:
            ratios.append(solo / (sum(times) / len(times)))
    sleepy_barrier()
    return float(median(ratios)) if ratios else None


def batch_step_time(model: Any, x: Any, y: Any) -> float:
    """Seconds of one `train_on_batch` step on the whole of ``x``, ``y``: the finest grain at
    which two arms can alternate (a `fit` call spends its first batch on set-up)."""
    start = time.perf_counter()
    model.train_on_batch(x, y)
    return time.perf_counter() - start


def built_stack(smp: Any, width: int, depth: int, x: Any, y: Any) -> Any:
    """A `DistributedModel` of ``dense_stack(width, depth)`` (SGD, MSE), stepped twice on ``x``,
    ``y`` so that it is built, traced and has its executors: one arm of a side-by-side job."""
    import keras

    model = smp.DistributedModel(lambda: dense_stack(width, depth))
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.01), loss="mse")
    for _ in range(2):
        model.train_on_batch(x, y)
    return model


def alternate(models: dict[str, Any], x: Any, y: Any, rounds: int) -> dict[str, list[float]]:
    """Per round, each model's fastest of 2 `train_on_batch` steps, timed as the slowest rank's
    ([Note: the slowest rank's step]); which model goes first alternates by round."""
    times: dict[str, list[float]] = {name: [] for name in models}
    pair = list(models.items())
    for r in range(rounds):
        for name, model in pair if r % 2 == 0 else pair[::-1]:
            sleepy_barrier()
            times[name].append(min(slowest_rank([batch_step_time(model, x, y)
                                                 for _ in range(2)])))
    return times
