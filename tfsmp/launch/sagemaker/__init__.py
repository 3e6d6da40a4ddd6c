"""SageMaker's launch contract, pure: SDK validation, hyperparameters, job environment, mpirun command.

Example::

    dist = resolve_distribution(
        {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {"partitions": 2}}},
         "mpi": {"enabled": True, "processes_per_host": 4}},
        instance_count=1, resources=instance_resources("local", local_gpus=0, local_cpus=8))
    dist.processes_per_host, dist.config.partitions          # (4, 2)

Three sources are mirrored here (see docs/estimator.md): the SageMaker Python SDK's
`validate_smdistributed` / `get_mp_parameters` / `_distribution_configuration` (what an estimator
checks and turns into hyperparameters), the training toolkit's `Environment.to_env_vars` and
`mapping.to_cmd_args` (what the script sees), and the toolkit's `MasterRunner._create_command`
(the mpirun line), adapted to Open MPI 5 and to hosts emulated on one machine. Nothing here imports
TensorFlow or MPI, reads the environment or touches files: `tfsmp.estimator` gathers those facts.

One concept per module: `instances.py` (what an instance type reports), `distribution.py` (the
`distribution=` dict), `hyperparameters.py` (encoding, splitting, argv and `SM_*` mapping),
`layout.py` (the job's /opt/ml), `environment.py` (the config files and `SM_*` variables a
container gives), `hosts.py` (host names, across machines or emulated, the hostfile),
`mpi_options.py` (custom mpirun flags), `command.py` (the mpirun line) and `run_options.py`
(`tfsmp run --distribution`).
"""

from tfsmp.launch.sagemaker.command import (
    JOB_VARIABLES,
    exported_names,
    format_command,
    toolkit_mpirun_command,
)
from tfsmp.launch.sagemaker.distribution import (
    SMDISTRIBUTED_SUPPORTED_STRATEGIES,
    Distribution,
    get_mp_parameters,
    resolve_distribution,
    validate_smdistributed,
)
from tfsmp.launch.sagemaker.environment import input_data_config, job_env, resource_config
from tfsmp.launch.sagemaker.hosts import (
    HOSTS_SETTING,
    host_names,
    hostfile_text,
    runs_across_hosts,
)
from tfsmp.launch.sagemaker.hyperparameters import (
    distribution_hyperparameters,
    encode_hyperparameters,
    split_hyperparameters,
    to_cmd_args,
    to_env_vars,
)
from tfsmp.launch.sagemaker.instances import (
    EFA_NCCL_INSTANCES,
    EFA_RDMA_INSTANCES,
    INSTANCE_RESOURCES,
    Resources,
    instance_resources,
)
from tfsmp.launch.sagemaker.layout import JobPaths
from tfsmp.launch.sagemaker.mpi_options import merge_mpi_options
from tfsmp.launch.sagemaker.run_options import RunOptions, run_options

__all__ = [
    "EFA_NCCL_INSTANCES",
    "EFA_RDMA_INSTANCES",
    "HOSTS_SETTING",
    "INSTANCE_RESOURCES",
    "JOB_VARIABLES",
    "SMDISTRIBUTED_SUPPORTED_STRATEGIES",
    "Distribution",
    "JobPaths",
    "Resources",
    "RunOptions",
    "distribution_hyperparameters",
    "encode_hyperparameters",
    "exported_names",
    "format_command",
    "get_mp_parameters",
    "host_names",
    "hostfile_text",
    "input_data_config",
    "instance_resources",
    "job_env",
    "merge_mpi_options",
    "resolve_distribution",
    "resource_config",
    "run_options",
    "runs_across_hosts",
    "split_hyperparameters",
    "to_cmd_args",
    "to_env_vars",
    "toolkit_mpirun_command",
    "validate_smdistributed",
]
