"""Rank-side PyTorch of the peer benchmark: the same Dense stack as `tfhelp.dense_stack`, its
stages under ``torch.distributed.pipelining`` (gloo), and one process's plain step.

Example::

    setup(threads=1)                                  # gloo process group over MPI's ranks
    arm = pipeline_arm("1F1B", width=1024, depth=8, m=8, lr=0.01)
    seconds = arm.step_time(x, y)                     # one training step: schedule + SGD step

Only this module imports torch; `benchmarks.bench_torch` imports it after checking torch is there.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import pipelining as pp

__all__ = ["SCHEDULES", "PipelineArm", "PlainArm", "pipeline_arm", "setup", "shutdown"]

# name -> (schedule class name, stages per rank, V-shaped placement)
SCHEDULES: dict[str, tuple[str, int, bool]] = {
    "GPipe": ("ScheduleGPipe", 1, False),
    "1F1B": ("Schedule1F1B", 1, False),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", 2, False),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", 2, False),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", 2, True),
}


def setup(threads: int = 1) -> None:
    """One thread per process, and a gloo process group over the MPI job's ranks (rank 0 picks
    a free loopback port and broadcasts it over MPI)."""
    from mpi4py import MPI

    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # already set in this process
        torch.set_num_interop_threads(threads)
    comm = MPI.COMM_WORLD
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _layers(width: int, depth: int, lo: int, hi: int) -> torch.nn.Sequential:
    """Layers ``lo..hi-1`` of the stack: Linear(width) with ReLU except after the last layer."""
    torch.manual_seed(lo)
    mods: list[torch.nn.Module] = []
    for i in range(lo, hi):
        mods.append(torch.nn.Linear(width, width))
        if i < depth - 1:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


@dataclass
class PipelineArm:
    """One schedule's stages on this rank, their SGD optimizers and the schedule object."""

    name: str
    schedule: Any
    optimizers: list[torch.optim.Optimizer]
    first: bool  # this rank holds stage 0 (feeds the inputs)
    last: bool   # this rank holds the last stage (feeds the targets)

    def step_time(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Seconds of one training step: the schedule's forward and backward of every
        microbatch, then each stage's optimizer step (what Keras's `train_on_batch` does)."""
        start = time.perf_counter()
        args = (x,) if self.first else ()
        kwargs: dict[str, Any] = {"target": y, "losses": []} if self.last else {}
        self.schedule.step(*args, **kwargs)
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start


def pipeline_arm(name: str, width: int, depth: int, m: int, lr: float) -> PipelineArm:
    """The torch.distributed.pipelining arm ``name`` of `SCHEDULES` on this rank."""
    cls_name, v, v_shape = SCHEDULES[name]
    rank, ranks = dist.get_rank(), dist.get_world_size()
    n = ranks * v
    per = depth // n
    if v == 1:
        mine = [rank]
    elif v_shape:
        mine = [rank, n - 1 - rank]
    else:
        mine = [rank + k * ranks for k in range(v)]
    stages, opts = [], []
    for s in mine:
        module = _layers(width, depth, s * per, (s + 1) * per)
        stages.append(pp.PipelineStage(module, s, n, torch.device("cpu")))
        opts.append(torch.optim.SGD(module.parameters(), lr=lr))
    cls = getattr(pp, cls_name)
    schedule = cls(stages[0] if v == 1 else stages, m, loss_fn=_mse)
    return PipelineArm(name, schedule, opts, 0 in mine, n - 1 in mine)


@dataclass
class PlainArm:
    """The whole stack in this process: forward, MSE, backward, SGD step."""

    model: torch.nn.Sequential
    optimizer: torch.optim.Optimizer

    @classmethod
    def build(cls, width: int, depth: int, lr: float) -> PlainArm:
        model = _layers(width, depth, 0, depth)
        return cls(model, torch.optim.SGD(model.parameters(), lr=lr))

    def step_time(self, x: torch.Tensor, y: torch.Tensor) -> float:
        start = time.perf_counter()
        loss = _mse(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start


def tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())
