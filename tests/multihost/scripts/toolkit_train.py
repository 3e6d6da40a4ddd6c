"""The container's `train` command (`sagemaker_training.cli.train:main`) on an emulated host.

Run with the interpreter of tests/multihost/ompi4.py's environment, inside a mount namespace whose
/opt/ml is the job directory (the toolkit's gethostname shim, LD_PRELOADed into every rank, reads
the fixed path /opt/ml/input/config/resourceconfig.json). Changed, and only these, because the
emulated hosts have no sshd (Open MPI reaches them through the harness's ssh stand-in):
- `_start_sshd_daemon`: a no-op (it would start /usr/sbin/sshd);
- `_can_connect`: True (it opens an ssh session with paramiko to each worker);
- `_write_status_file`: True (it writes the worker's "finished" file over ssh);
- the module's `time.sleep`: capped at 1 s (the master sleeps 30 s after the job for workers).
"""

from __future__ import annotations

import time
import types

from sagemaker_training import mpi
from sagemaker_training.cli import train

mpi._start_sshd_daemon = lambda: None
mpi._can_connect = lambda host, port=22: True
mpi._write_status_file = lambda host, status_file: True
mpi.time = types.SimpleNamespace(sleep=lambda s: time.sleep(min(s, 1)), time=time.time)

if __name__ == "__main__":
    train.main()
