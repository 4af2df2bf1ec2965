"""The two lanes of ``make test`` (``pytest -n 2``, pytest-xdist): every test under tests/cluster/ in
one worker, in collection order, since a machine holds one test cluster at a time (its names and
addresses are fixed), and every other test in the other. A cluster test mostly waits (on timeouts,
on its nodes), so the other lane's tests use the cores meanwhile.

xdist's own ``--dist loadgroup`` would do this with marks, but it names a group by rewriting the
test's node id, which pytest 9.2 no longer reads: here the scheduler groups by path instead.
Without ``-n`` nothing changes.

The other lane runs at a lower priority (``LOCAL_NICE``), set in its worker before its first test
and inherited by every process it starts. A cluster job's processes, each node's in a container's
cgroup, weigh no more to the kernel than a single process of the other lane would at the same
priority: under that lane's training the cluster lane ran 45% slower than alone in a clean-clone
run. Reniced, the other lane uses what the cluster lane leaves, and still all of the cores while a
cluster test waits.
"""

from __future__ import annotations

import os

import pytest

CLUSTER_TESTS = "tests/cluster/"


LOCAL_NICE = 5
"""The other lane's niceness, under ``-n``: a weight of 335 to each of its processes against 1024 for
a container's cgroup of cluster processes (Linux's CFS)."""


def lane(nodeid: str) -> str:
    return "cluster" if nodeid.startswith(CLUSTER_TESTS) else "local"


def pytest_runtest_setup(item: pytest.Item) -> None:
    config = item.config
    if hasattr(config, "workerinput") and lane(item.nodeid) == "local" and not getattr(config, "_lanes_niced", False):
        config._lanes_niced = True
        os.nice(LOCAL_NICE)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: xdist may be absent
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane(nodeid)

    return Lanes(config, log)
