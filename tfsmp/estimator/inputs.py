"""Where a job's files come from: local paths and file:// URIs, and `fit(inputs)` as channels."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tfsmp.errors import ConfigError

__all__ = ["resolve_channels"]

_CHANNEL = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def local_path(uri: Any, what: str) -> Path:
    """A local path or file:// URI as an absolute Path; s3:// and other schemes are errors."""
    if isinstance(uri, os.PathLike):
        uri = os.fspath(uri)
    if not isinstance(uri, str) or not uri:
        raise ConfigError(f"{what} must be a local path or a file:// URI. Received: {what}={uri!r}.")
    if uri.startswith("s3://"):
        raise ConfigError(
            f"{what} cannot be an S3 URI: this job runs on this machine and reads local files "
            f"only. Received: {what}={uri!r}. Copy the data here first (e.g. `aws s3 sync {uri} "
            "./data`) and pass the local path or a file:// URI.")
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    elif "://" in uri:
        raise ConfigError(f"{what} must be a local path or a file:// URI. Received: {what}={uri!r}.")
    return Path(uri).expanduser().resolve()


def existing_path(uri: Any, what: str) -> Path:
    path = local_path(uri, what)
    if not path.exists():
        raise ConfigError(f"{what} must exist. Received: {what}={uri!r} ({path} does not exist).")
    return path


def _input_uri(value: Any) -> Any:
    """The URI of an input: a str/path, or an SDK `TrainingInput` (its S3DataSource URI)."""
    config = getattr(value, "config", None)
    if isinstance(config, Mapping):
        source = config.get("DataSource", {})
        for kind in ("S3DataSource", "FileSystemDataSource"):
            if kind in source:
                return source[kind].get("S3Uri") or source[kind].get("DirectoryPath")
    return value


def resolve_channels(inputs: Any, model_uri: Any = None,
                     model_channel_name: str = "model") -> dict[str, Path]:
    """`fit(inputs)` as channel name -> local path, as the SDK names channels.

    A single input is the channel "training"; a dict names its channels; `model_uri` adds the
    model channel.

    Raises:
        ConfigError: An input is an S3 URI, does not exist, or a channel name is invalid.
    """
    if inputs is None:
        channels: dict[str, Any] = {}
    elif isinstance(inputs, Mapping):
        channels = dict(inputs)
    else:
        channels = {"training": inputs}
    if model_uri is not None:
        channels[model_channel_name] = model_uri
    resolved: dict[str, Path] = {}
    for name, value in channels.items():
        if not isinstance(name, str) or not _CHANNEL.match(name):
            raise ConfigError(f"channel names must match [A-Za-z0-9._-]{{1,64}}. Received: "
                              f"channel {name!r}.")
        resolved[name] = existing_path(_input_uri(value), f"inputs[{name!r}]")
    return resolved
