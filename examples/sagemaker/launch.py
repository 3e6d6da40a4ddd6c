"""The AWS page's TensorFlow launcher, with its imports changed to tfsmp.estimator: runs the job here.

    python examples/sagemaker/launch.py                      # the page's values: 8 ranks
    python examples/sagemaker/launch.py --processes-per-host 4 --instance-type local

On the page the imports read ``import sagemaker`` / ``from sagemaker.tensorflow import TensorFlow``
and the data comes from ``s3://my_bucket/my_training_data/``; here it is a local directory that
this script fills with a small synthetic classification set. See docs/estimator.md.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np

from tfsmp.estimator import TensorFlow, get_execution_role  # was: from sagemaker.tensorflow ...

HERE = os.path.dirname(os.path.abspath(__file__))

# -- as on the AWS page ------------------------------------------------------------------------
smp_options: dict[str, Any] = {
    "enabled": True,              # Required
    "parameters": {
        "partitions": 2,          # Required
        "microbatches": 4,
        "placement_strategy": "spread",
        "pipeline": "interleaved",
        "optimize": "speed",
        "horovod": True,          # Use this for hybrid model and data parallelism
    },
}

mpi_options: dict[str, Any] = {
    "enabled": True,              # Required
    "processes_per_host": 8,      # Required
    # "custom_mpi_options" : "--mca btl_vader_single_copy_mechanism none"
}
# -----------------------------------------------------------------------------------------------


def make_data(directory: str, samples: int = 2048, features: int = 32, classes: int = 10) -> None:
    """A learnable synthetic set: labels from a fixed random linear map of the features."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((samples, features)).astype("float32")
    y = np.argmax(x @ rng.standard_normal((features, classes)), axis=1)
    np.savez(os.path.join(directory, "train.npz"), x=x, y=y)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--instance-type", default="ml.p3.16xlarge")
    p.add_argument("--instance-count", type=int, default=1)
    p.add_argument("--processes-per-host", type=int, default=mpi_options["processes_per_host"])
    p.add_argument("--no-horovod", action="store_true", help="reduce over MPI instead")
    p.add_argument("--data", default=os.path.join(HERE, "data"))
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    mpi_options["processes_per_host"] = args.processes_per_host
    if args.no_horovod:
        smp_options["parameters"]["horovod"] = False
    if not os.path.exists(os.path.join(args.data, "train.npz")):
        make_data(args.data)

    smd_mp_estimator = TensorFlow(
        entry_point="train.py",   # Specify your train script
        source_dir=HERE,
        role=get_execution_role(),
        instance_count=args.instance_count,
        instance_type=args.instance_type,
        # The page's framework_version="2.6.3", py_version="py38" name a SageMaker image; the job
        # runs in this Python environment, whose versions they default to.
        distribution={
            "smdistributed": {"modelparallel": smp_options},
            "mpi": mpi_options,
        },
        base_job_name="SMD-MP-demo",
        hyperparameters={"epochs": args.epochs},
        # The ranks share this machine's cores: one thread each keeps them from fighting.
        environment={"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
                     "TF_NUM_INTEROP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    smd_mp_estimator.fit({"training": args.data})  # the page: fit('s3://my_bucket/...')
    print("model artifacts:", smd_mp_estimator.model_data)


if __name__ == "__main__":
    main()
