"""Rank 0 sleeps for ever in `wait_for_ever`, rank 1 in a barrier: a job that only a timeout ends."""

import time

from mpi4py import MPI


def wait_for_ever() -> None:
    time.sleep(3600)


if __name__ == "__main__":
    print("ready", flush=True)
    if MPI.COMM_WORLD.Get_rank() == 0:
        wait_for_ever()
    MPI.COMM_WORLD.Barrier()
