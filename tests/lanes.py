"""The lanes of ``make test`` (``pytest -n 2``, pytest-xdist; ``-n 3`` on request): the tests under
tests/cluster/ in one worker, or with ``-n 3`` in two workers, each on a cluster of its own
(netcluster.Site 0 and 1: names, addresses and paths of its own), in collection order, and every
other test in the last worker. A cluster test mostly waits (on
timeouts, on its nodes), so the other lanes' tests use the cores meanwhile. The second cluster lane
takes ``SECOND_CLUSTER_TESTS``; with fewer workers the cluster's tests are one lane again, on one
cluster.

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
SECOND_CLUSTER_TESTS = ("tests/cluster/test_faults.py", "tests/cluster/test_stall.py", "tests/cluster/test_refusals.py")
"""Cluster tests that run on a second cluster of their own (netcluster.Site 1), in a lane beside the
first cluster's, under ``-n 3``: tests that mostly wait (a lost node's timeouts, a hang's detection)
and use none of the parts built on the first cluster (Slurm, the registry, the containerd node)."""


LOCAL_NICE = 5
"""The other lane's niceness, under ``-n``: a weight of 335 to each of its processes against 1024 for
a container's cgroup of cluster processes (Linux's CFS)."""


def lane(nodeid: str) -> str:
    if nodeid.startswith(SECOND_CLUSTER_TESTS):
        return "cluster2"
    return "cluster" if nodeid.startswith(CLUSTER_TESTS) else "local"


def scope(nodeid: str, workers: int) -> str:
    """Its lane with ``workers`` workers: the second cluster lane joins the first where too few."""
    name = lane(nodeid)
    return "cluster" if name == "cluster2" and workers < 3 else name


def site_of(item: pytest.Item) -> int | None:
    """The site (tests/cluster/netcluster.Site) of the cluster this test drives, None for a test of
    the other lane; without ``-n`` every cluster test is on site 0."""
    workers = getattr(item.config, "workerinput", {}).get("workercount", 0)
    name = scope(item.nodeid, workers)
    return None if name == "local" else 1 if name == "cluster2" else 0


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures: the cluster's reads cluster_site
def pytest_runtest_setup(item: pytest.Item) -> None:
    config = item.config
    if not hasattr(config, "workerinput"):
        return
    site = site_of(item)
    if site is None and not getattr(config, "_lanes_niced", False):
        config._lanes_niced = True
        os.nice(LOCAL_NICE)
    if site is not None and not hasattr(config, "_lanes_site"):
        config._lanes_site = site


def cluster_site(config: pytest.Config) -> int:
    """Which site (tests/cluster/netcluster.Site) this process's cluster is on: 1 in the second
    cluster lane of ``-n 3`` or more, else 0."""
    return getattr(config, "_lanes_site", 0)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: xdist may be absent
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope(nodeid, self.numnodes)

    return Lanes(config, log)
