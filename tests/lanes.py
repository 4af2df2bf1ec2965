"""The two lanes of ``make test`` (``pytest -n 2``, pytest-xdist): every test under tests/cluster/ in
one worker, in collection order, since a machine holds one test cluster at a time (its names and
addresses are fixed), and every other test in the other. A cluster test mostly waits (on timeouts,
on its nodes), so the other lane's tests use the cores meanwhile.

xdist's own ``--dist loadgroup`` would do this with marks, but it names a group by rewriting the
test's node id, which pytest 9.2 no longer reads: here the scheduler groups by path instead.
Without ``-n`` nothing changes.
"""

from __future__ import annotations

import pytest

CLUSTER_TESTS = "tests/cluster/"


def lane(nodeid: str) -> str:
    return "cluster" if nodeid.startswith(CLUSTER_TESTS) else "local"


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: xdist may be absent
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane(nodeid)

    return Lanes(config, log)
