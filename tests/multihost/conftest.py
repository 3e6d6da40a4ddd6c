"""The `hosts` fixture: two emulated hosts, algo-1 and algo-2, for the whole session.

Skipped, with the reason, where hosts cannot be emulated (not root, no CAP_NET_ADMIN, no
`ip netns`); CI runs as root and runs these tests.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.multihost import netns

HOSTS = ["algo-1", "algo-2"]


@pytest.fixture(scope="session")
def hosts() -> Iterator[netns.Cluster]:
    """algo-1 (10.77.0.11) and algo-2 (10.77.0.12) on one bridge; removed after the session."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(f"cannot emulate hosts: {reason}")
    with netns.session():  # another session on this machine waits for this one
        cluster = netns.up(HOSTS)
        try:
            yield cluster
        finally:
            netns.down()
