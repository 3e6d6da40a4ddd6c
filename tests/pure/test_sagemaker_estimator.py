"""The estimators' arguments: what runs here, what is refused (and why), and failure reports."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest

from tfsmp.errors import ConfigError
from tfsmp.estimator import (
    LOCAL_ROLE,
    Estimator,
    TensorFlow,
    find_failure,
    get_execution_role,
    resolve_channels,
)

DIST = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {"partitions": 2}}},
        "mpi": {"enabled": True, "processes_per_host": 2}}


@pytest.fixture
def src(tmp_path: Path) -> Path:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("print('hi')\n")
    return tmp_path / "src"


def tf(src: Path, **kwargs: Any) -> TensorFlow:
    args: dict[str, Any] = dict(entry_point="train.py", source_dir=str(src), role=LOCAL_ROLE,
                                instance_count=1, instance_type="local",
                                framework_version="2.21", py_version="py311", distribution=DIST)
    args.update(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TensorFlow(**args)


def test_get_execution_role_is_local() -> None:
    assert get_execution_role() == get_execution_role(None, use_default=True) == LOCAL_ROLE


def test_a_single_input_is_the_training_channel(tmp_path: Path) -> None:
    assert resolve_channels(str(tmp_path)) == {"training": tmp_path.resolve()}
    assert resolve_channels(f"file://{tmp_path}") == {"training": tmp_path.resolve()}
    assert resolve_channels({"train": tmp_path, "test": f"file://{tmp_path}"}) == {
        "train": tmp_path.resolve(), "test": tmp_path.resolve()}
    assert resolve_channels(None, model_uri=str(tmp_path)) == {"model": tmp_path.resolve()}


def test_training_input_objects_are_read_by_their_uri(tmp_path: Path) -> None:
    class TrainingInput:  # the SDK's shape
        config = {"DataSource": {"S3DataSource": {"S3Uri": f"file://{tmp_path}"}}}

    assert resolve_channels({"training": TrainingInput()}) == {"training": tmp_path.resolve()}


def test_s3_inputs_are_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=re.escape(
            "inputs['training'] cannot be an S3 URI: this job runs on this machine and reads "
            "local files only. Received: inputs['training']='s3://my_bucket/my_training_data/'."
            " Copy the data here first (e.g. `aws s3 sync s3://my_bucket/my_training_data/ "
            "./data`)")):
        resolve_channels("s3://my_bucket/my_training_data/")


def test_missing_inputs_and_bad_channel_names_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^inputs\['training'\] must exist"):
        resolve_channels(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"^channel names must match"):
        resolve_channels({"bad name": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"must be a local path or a file:// URI"):
        resolve_channels("https://example.com/data")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"output_path": "s3://bucket/out"}, "output_path cannot be an S3 URI"),
    ({"checkpoint_s3_uri": "s3://bucket/ckpt"}, "checkpoint_s3_uri cannot be an S3 URI"),
    ({"model_dir": "s3://bucket/model"}, "model_dir cannot be an S3 URI"),
    ({"git_config": {"repo": "x"}}, "git_config cannot run on this machine"),
    ({"instance_groups": []}, "instance_groups cannot run on this machine"),
    ({"input_mode": "Pipe"}, "input_mode='Pipe' streams S3 data"),
])
def test_cloud_arguments_that_change_the_result_are_refused(src: Path, kwargs: dict[str, Any],
                                                            message: str) -> None:
    with pytest.raises(ConfigError, match=r"^" + re.escape(message)):
        tf(src, **kwargs)


def test_cloud_arguments_that_change_nothing_are_accepted(src: Path) -> None:
    est = tf(src, volume_size=100, use_spot_instances=True, max_wait=7200, subnets=["s"],
             debugger_hook_config=False, tags=[{"Key": "k", "Value": "v"}])
    assert est.instance_count == 1


def test_unknown_keyword_is_a_type_error_with_a_suggestion(src: Path) -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'volume_sise'. Did you mean "
                                        r"'volume_size'"):
        tf(src, volume_sise=10)


def test_sdk_v1_names_still_work(src: Path) -> None:
    with pytest.warns(DeprecationWarning, match=r"train_instance_count was renamed instance_count"):
        est = TensorFlow(entry_point="train.py", source_dir=str(src), role="r",
                         train_instance_count=1, train_instance_type="local",
                         framework_version="2.21", py_version="py311")
    assert (est.instance_count, est.instance_type) == (1, "local")


def test_versions_default_to_this_environments_without_a_warning(src: Path) -> None:
    """The SDK needs them to pick an image; here the image is this Python environment."""
    import sys
    from importlib import metadata

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at all
        est = TensorFlow(entry_point="train.py", source_dir=str(src), role="r",
                         instance_count=1, instance_type="local", distribution=DIST)
    assert metadata.version("tensorflow-cpu").startswith(est.framework_version + ".")
    assert est.py_version == f"py{sys.version_info.major}{sys.version_info.minor}"
    assert tf(src, framework_version=None).framework_version == est.framework_version


def test_image_uri_is_not_pulled_and_says_so(src: Path) -> None:
    with pytest.warns(UserWarning, match=r"image_uri='123.dkr.ecr.us-west-2.amazonaws.com/x:1' is "
                                         "not pulled: the job runs in this Python environment"):
        Estimator(image_uri="123.dkr.ecr.us-west-2.amazonaws.com/x:1", role="r",
                  instance_count=1, instance_type="local", entry_point="train.py",
                  source_dir=str(src))


def test_versions_of_another_image_give_one_warning_with_the_fix(src: Path) -> None:
    with pytest.warns(UserWarning) as record:
        est = TensorFlow(entry_point="train.py", source_dir=str(src), role="r", instance_count=1,
                         instance_type="local", framework_version="2.6.3", py_version="py38")
    assert len(record) == 1, [str(w.message) for w in record]
    assert re.fullmatch(
        r"The job runs in this Python environment: framework_version='2\.6\.3' \(here: 2\.\d+\), "
        r"py_version='py38' \(here: py3\d+\)\. Omit framework_version and py_version to use this "
        r"environment's, as tfsmp does by default\.", str(record[0].message))
    assert (est.framework_version, est.py_version) == ("2.6.3", "py38")  # kept, as the SDK does


def test_entry_point_must_exist_in_source_dir(src: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape(
            f'No file named "nope.py" was found in directory "{src}".')):
        tf(src, entry_point="nope.py")


def test_generic_estimator_needs_an_entry_point() -> None:
    with pytest.raises(ConfigError, match=r"^entry_point must name the training script"):
        Estimator(image_uri=None, role="r", instance_count=1, instance_type="local")


@pytest.mark.parametrize("count", [0, None, 1.0, True])
def test_instance_count_must_be_positive(src: Path, count: Any) -> None:
    with pytest.raises(ConfigError, match=r"^instance_count must be a positive integer"):
        tf(src, instance_count=count)


def test_job_names_follow_sagemakers_rule(src: Path, tmp_path: Path) -> None:
    est = tf(src, output_path=str(tmp_path))
    with pytest.raises(ConfigError, match=r"^job_name must be 1-63 letters"):
        est.mpi_command(job_name="../escape")
    assert "tensorflow-training-" in " ".join(est.mpi_command())


def test_mpi_command_needs_mpi(src: Path) -> None:
    est = tf(src, distribution=None)
    with pytest.raises(ConfigError, match=r"^mpi_command\(\) needs distribution"):
        est.mpi_command()


def test_the_aws_page_generic_estimator_form_gets_the_fix(src: Path) -> None:
    smp_options = {"enabled": True, "parameters": {"partitions": 2}}
    with pytest.raises(ConfigError, match=r"nest them, \{'smdistributed': \{'modelparallel'"):
        Estimator(entry_point="train.py", source_dir=str(src), role="r", instance_count=1,
                  instance_type="local", distribution={"smdistributed": smp_options,
                                                       "mpi": {"enabled": True}})


# -- failure reports ------------------------------------------------------------------------

def test_the_first_rank_with_a_traceback_is_the_failing_rank() -> None:
    log = [
        "[1,0]<stdout>: epoch 1",
        "[1,2]<stderr>: [rank 2 | pp_rank 1] Traceback (most recent call last):",
        '[1,2]<stderr>: [rank 2 | pp_rank 1]   File "train.py", line 3, in <module>',
        "[1,2]<stderr>: [rank 2 | pp_rank 1] ValueError: bad batch",
        "[1,0]<stderr>: Traceback (most recent call last):",
        "[1,0]<stderr>: mpi4py.MPI.Exception: MPI_ERR_OTHER",
        "prterun detected that one or more processes exited with non-zero status,",
        "   Process name: [prterun-vm-1@1,0]",
    ]
    failure = find_failure(log)
    assert (failure.rank, failure.error) == (2, "ValueError: bad batch")
    assert failure.traceback.startswith("Traceback") and 'File "train.py"' in failure.traceback


def test_without_a_traceback_the_first_rank_to_exit_is_named() -> None:
    log = ["[1,1]<stdout>: hi", "   Process name: [prterun-vm-8002@1,3]", "   Exit code:    3"]
    assert find_failure(log).rank == 3 and find_failure(log).error == ""


def test_a_tfsmp_error_after_init_is_its_one_line() -> None:
    log = ["[1,1]<stderr>: [rank 1 | pp_rank 1] StepError: fit needs a loss and an optimizer.",
           "   Process name: [prterun-vm-8002@1,1]", "   Exit code:    1"]
    assert (find_failure(log).rank, find_failure(log).error) == (
        1, "StepError: fit needs a loss and an optimizer.")


def test_untagged_logs_of_plain_jobs() -> None:
    log = ["Traceback (most recent call last):", '  File "t.py", line 1', "KeyError: 'x'"]
    assert (find_failure(log).rank, find_failure(log).error) == (None, "KeyError: 'x'")
