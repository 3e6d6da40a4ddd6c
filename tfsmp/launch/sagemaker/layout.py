"""A job directory laid out like a training container's /opt/ml."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["JobPaths"]


@dataclass(frozen=True)
class JobPaths:
    """A job directory laid out like a training container's /opt/ml (`SAGEMAKER_BASE_DIR`).

    Example::

        JobPaths("/tmp/tfsmp-jobs/my-job").channel("training")
        # '/tmp/tfsmp-jobs/my-job/input/data/training'
    """

    base: str

    def _join(self, *parts: str) -> str:
        return "/".join([self.base.rstrip("/"), *parts])

    @property
    def code(self) -> str:
        return self._join("code")

    @property
    def model(self) -> str:
        return self._join("model")

    @property
    def input(self) -> str:
        return self._join("input")

    @property
    def input_config(self) -> str:
        return self._join("input", "config")

    @property
    def input_data(self) -> str:
        return self._join("input", "data")

    @property
    def output(self) -> str:
        return self._join("output")

    @property
    def output_data(self) -> str:
        return self._join("output", "data")

    @property
    def output_intermediate(self) -> str:
        return self._join("output", "intermediate")

    @property
    def checkpoints(self) -> str:
        return self._join("checkpoints")

    @property
    def hostfile(self) -> str:
        return self._join("hostfile")

    def channel(self, name: str) -> str:
        return self._join("input", "data", name)
