"""Launching: the `tfsmp` CLI, the mpirun command builder and the SageMaker estimator emulation."""
