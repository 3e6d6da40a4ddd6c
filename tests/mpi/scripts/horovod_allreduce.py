"""With horovod: True, tfsmp initializes Horovod on the data-parallel group; prints one JSON line.

Config (SM_HP_MP_PARAMETERS): {"partitions": 2, "horovod": true}; 4 ranks, cluster placement,
so stage 0 is held by ranks [0, 2] and stage 1 by [1, 3].
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import tfsmp as smp

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

config = smp.init()
import horovod.tensorflow as hvd  # noqa: E402 - tfsmp.init() must run hvd.init() first

value = float(smp.rank() + 1)
summed = hvd.allreduce(tf.constant([value, 10 * value]), op=hvd.Sum, name="user_sum")
grouped = hvd.grouped_allreduce([tf.constant([value]), tf.constant([[value, value]])],
                                op=hvd.Sum, name="user_grouped")
buf = np.full(3, value)
smp.state().horovod.allreduce_(buf)
print(json.dumps({
    "rank": smp.rank(), "dp_rank": smp.dp_rank(), "dp_size": smp.dp_size(),
    "dp_group": smp.get_dp_group(), "hvd_rank": hvd.rank(), "hvd_size": hvd.size(),
    "horovod": config.horovod, "sum": summed.numpy().tolist(),
    "grouped": [t.numpy().tolist() for t in grouped], "reducer": buf.tolist(),
}), flush=True)
smp.shutdown()
