"""SMP-style entry point of the estimator's two-host job: what each rank sees, then equality cases.

Every rank prints one `CASE {...}` line `sm_view` (its host, SM_* variables, its host's
resourceconfig.json), then the cases of tests/mpi/scripts/runtime_cases.py named in TFSMP_TEST_SPECS
(found through TFSMP_TEST_SCRIPTS or the hyperparameter test_scripts, since the job runs a copy
of this directory). Used by the estimator's and the SageMaker toolkit's multi-host tests.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import tfsmp as smp


def sm_view() -> dict[str, object]:
    from mpi4py import MPI

    smp.init()  # SM_HP_MP_PARAMETERS, as on SageMaker
    base = os.environ.get("SAGEMAKER_BASE_DIR", "/opt/ml")  # unset in a container
    with open(os.path.join(base, "input", "config", "resourceconfig.json")) as f:
        resource = {k: v for k, v in json.load(f).items()
                    if k in ("current_host", "hosts", "network_interface_name")}
    env = os.environ
    return {
        "ok": True, "hostname": socket.gethostname(), "processor": MPI.Get_processor_name(),
        "mpi_library": MPI.Get_library_version().split(",")[0],
        "mp_rank": smp.mp_rank(), "dp_rank": smp.dp_rank(), "local_rank": smp.local_rank(),
        "partitions": smp.mp_size(),
        "sm_hosts": json.loads(env["SM_HOSTS"]), "sm_current_host": env["SM_CURRENT_HOST"],
        "base": base, "model_dir": env["SM_MODEL_DIR"], "resource": resource,
        "training_env_host": json.loads(env["SM_TRAINING_ENV"])["current_host"],
        "channel": env.get("SM_CHANNEL_TRAINING"),
        "channel_files": sorted(os.listdir(env["SM_CHANNEL_TRAINING"])),
        "mp_parameters": env.get("SM_HP_MP_PARAMETERS"), "shim": env.get("LD_PRELOAD", "").endswith(".so"),
        "hp": env.get("SM_HP_EPOCHS"), "argv": sys.argv[1:3], "cwd": os.getcwd(),
    }


def main() -> None:
    env = os.environ
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    out = sm_view()
    out.update(case="sm_view", rank=rank, error=None)
    # Compact: Open MPI 4's --tag-output splits lines longer than 1024 bytes.
    print("CASE " + json.dumps(out, separators=(",", ":")), flush=True)
    # The model artifact: each host writes a marker into its own model directory.
    with open(os.path.join(os.environ["SM_MODEL_DIR"], f"rank{rank}.txt"), "w") as f:
        f.write(socket.gethostname())
    # The estimator's environment= gives these; under the toolkit, hyperparameters (SM_HP_*),
    # since it exports only its own variables to the ranks of other hosts.
    sys.path.insert(0, env.get("TFSMP_TEST_SCRIPTS") or env["SM_HP_TEST_SCRIPTS"])
    import runtime_cases

    specs = env.get("TFSMP_TEST_SPECS") or env.get("SM_HP_TEST_SPECS", "")
    runtime_cases.main([s for s in specs.split(",") if s])


if __name__ == "__main__":
    main()
