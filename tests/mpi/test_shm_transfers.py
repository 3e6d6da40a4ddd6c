"""Same-host boundary transfers through shared memory ([Note: shared-memory transfers] in
tfsmp/comm/shm.py), in one 2-rank job (`tests/mpi/scripts/shm_cases.py`): what arrives equals what
was sent for several shapes and types; a received tensor aliases the sender's slot, so a later
message must not overwrite it while it is held, and a slot whose tensor was dropped is reused (the
ring stays at two slots); a region with no slot left sends by MPI and the receiver still gets
the data; ``TFSMP_SHM_TRANSFERS=0`` maps nothing. Pipelined training through these channels equals
plain Keras in `tests/mpi/test_runtime_equality.py`, whose jobs send every message this way.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.mpihelp import SCRIPTS, run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.timeout(180)
def test_shared_memory_transfers_deliver_hold_reuse_and_fall_back() -> None:
    res = run_mpi(2, [SCRIPTS / "shm_cases.py", "off", "basic", "held", "small_region"],
                  mpi4py_module=False, timeout=150)
    assert res.returncode == 0, res.describe()
    cases = [json.loads(t) for t in re.findall(r"CASE (\{.*\})$", res.stdout, re.M)]
    names = [c["case"] for c in cases]
    assert len(names) == 12 + 4, names  # 4 shapes x 3 types, then off, held (2), small region
    assert "off" in names and "small_region: a full region sends by MPI" in names, names
    bad = [c for c in cases if not c["ok"]]
    assert not bad, bad
