"""The lanes of ``make test`` (``pytest -n 3``, pytest-xdist; ``-n 2`` on request): the tests under
tests/cluster/ in two workers, each on a cluster of its own (netcluster.Site 0 and 1: names,
addresses and paths of its own), in collection order; every other test goes, one at a time, to
whichever worker has run out of work: the third from the start, each cluster worker once its
lane is done. A cluster test mostly waits (on timeouts, on its nodes), so the other tests use the
cores meanwhile, and the run ends when the last test does, not when the longest lane would. The
second cluster lane takes ``SECOND_CLUSTER_TESTS``; with fewer workers the cluster's tests are one
lane again, on one cluster.

xdist's own ``--dist loadgroup`` would do this with marks, but it names a group by rewriting the
test's node id, which pytest 9.2 no longer reads: here the scheduler groups by path instead.
Without ``-n`` nothing changes.

The other tests run at a lower priority (``LOCAL_NICE``), set in a worker before its first such
test and inherited by every process it starts. A cluster job's processes, each node's in a
container's cgroup, weigh no more to the kernel than a single process of the other tests would at
the same priority: under their training the cluster lane ran 45% slower than alone in a
clean-clone run. Reniced, the other tests use what the cluster lanes leave, and still all of the
cores while a cluster test waits.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import pytest

CLUSTER_TESTS = "tests/cluster/"
SECOND_CLUSTER_TESTS = ("tests/cluster/test_faults.py", "tests/cluster/test_stall.py", "tests/cluster/test_refusals.py")
"""Cluster tests that run on a second cluster of their own (netcluster.Site 1), in a lane beside the
first cluster's, under ``-n 3``: tests that mostly wait (a lost node's timeouts, a hang's detection)
and use none of the parts built on the first cluster (Slurm, the registry, the containerd node)."""


LOCAL_NICE = 5
"""The other tests' niceness, under ``-n``: a weight of 335 to each of its processes against 1024 for
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


def shares_module_fixtures(path: Path) -> bool:
    """Whether the test module at ``path`` defines a module-scoped fixture: its tests run in one
    worker, which sets the fixture up once."""
    try:
        return MODULE_FIXTURE.search(path.read_text()) is not None
    except OSError:
        return False


MODULE_FIXTURE = re.compile(r"""scope\s*=\s*["']module["']""")


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: xdist may be absent
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        """A cluster lane is one unit of work, and every other test a unit of its own (a module
        whose tests share a module-scoped fixture: one unit). xdist hands a worker its next unit when
        it has two tests or fewer left; the cluster lanes go first, each to a worker of its own."""

        def _assign_work_unit(self, node) -> None:
            for lane_name in ("cluster", "cluster2"):
                if lane_name in self.workqueue:
                    self.workqueue.move_to_end(lane_name, last=False)
                    break
            super()._assign_work_unit(node)

        @functools.cache
        def _split_scope(self, nodeid: str) -> str:
            name = scope(nodeid, self.numnodes)
            if name != "local":
                return name
            module = nodeid.split("::", 1)[0]
            return module if shares_module_fixtures(config.rootpath / module) else nodeid

    return Lanes(config, log)
