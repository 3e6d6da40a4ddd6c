"""What a job leaves in its temp folder (tests/mpi/test_temp_files.py), chosen by argv[1].

ok:    every rank converts a function with autograph (which writes its source to a temp file),
       prints its temp folder and those files, and ends normally.
fail:  as ok, then rank 1 raises: tfsmp's failure handling ends the job, rank 0 is killed
       while it waits in a barrier.
"""

import json
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

import tfsmp

tfsmp.init({"partitions": 1})


@tf.function
def step(x: tf.Tensor) -> tf.Tensor:
    if tf.reduce_sum(x) > 0:  # control flow on a tensor: autograph converts the function
        x = x + 1.0
    return x


step(tf.ones(2))
files = sorted(m.__file__ for n, m in list(sys.modules.items())
               if n.startswith("__autograph_generated_file") and getattr(m, "__file__", None))
print("TEMP " + json.dumps({"rank": tfsmp.rank(), "dir": tempfile.gettempdir(), "files": files}),
      flush=True)
tfsmp.barrier()
if sys.argv[1] == "fail" and tfsmp.rank() == 1:
    raise RuntimeError("injected failure after converting a function")
tfsmp.barrier()
