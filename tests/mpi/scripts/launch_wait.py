"""A tiny job for tests/mpi/test_launcher_signals.py: no TensorFlow, so it starts in a second.

    python launch_wait.py MODE DIR MARKER

Each rank writes DIR/ready-<rank> once it waits, then, by MODE:
  sleep     sleeps (a stop signal's default action ends it)
  preempt   listens for a preemption (tfsmp.runtime.preemption, as fit with a backup callback
            does); when asked, writes DIR/backup-<rank> and exits 75
  stubborn  ignores SIGUSR1 and SIGTERM (a rank stuck where no signal helps)
  init, init-preempt   tfsmp.init() first (which watches a horovodrun launcher), then as
            sleep / preempt
  orphan    starts a child that sleeps (same MARKER in its argv), then exits 0
MARKER only makes every process of the job findable by its command line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

mode, out, marker = sys.argv[1], sys.argv[2], sys.argv[3]
rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
if mode == "orphan":
    # (its output elsewhere: mpirun waits for the end of a rank's output before it exits)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", marker],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    open(os.path.join(out, f"ready-{rank}"), "w").close()
    sys.exit(0)
if mode.startswith("init"):  # tfsmp.init() as a training script runs it (no TensorFlow)
    import tfsmp

    tfsmp.init()
if mode.endswith("preempt"):
    from tfsmp.runtime import preemption

    preemption.install()
if mode == "stubborn":
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(os.path.join(out, f"ready-{rank}"), "w").close()
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    if mode.endswith("preempt") and preemption.requested():
        open(os.path.join(out, f"backup-{rank}"), "w").close()
        preemption.exit_for_relaunch()  # exit 75
    time.sleep(0.05)
