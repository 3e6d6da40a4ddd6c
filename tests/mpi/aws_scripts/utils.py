# ruff: noqa
# Verbatim from https://github.com/aws/deep-learning-containers
#   path:   test/sagemaker_tests/tensorflow/tensorflow2_training/resources/smmodelparallel/utils.py
#   commit: 6712253d3befd950f09b0a6a9eb7a8f4f0868945 (2025-07-03; unchanged since 2021)
# No change: the DLC scripts `from utils import log_result` (this file).
# Run by tests/mpi/test_aws_scripts.py through aws_smp_runner.py.
# ---- verbatim below ----
# Standard Library
import inspect
import os


def log_result(label, res):
    frame = inspect.stack()[1]
    module = inspect.getmodule(frame[0])
    filename = os.path.basename(module.__file__)
    filename = filename.split(".")[0]

    print("[SMP_METRIC]__" + filename + "__" + str(label) + "__" + str(res) + "\n")
