"""The lanes of ``make test`` (``pytest -n 3``, pytest-xdist; ``-n 2`` on request): the tests under
tests/cluster/ in two workers, each on a cluster of its own (netcluster.Site 0 and 1: names,
addresses and paths of its own), in collection order; every other test goes, one at a time, to
whichever worker has run out of work: the third from the start, each cluster worker once its
lane is done. A cluster test mostly waits (on timeouts, on its nodes), so the other tests use the
cores meanwhile, and the run ends when the last test does, not when the longest lane would. The
second cluster lane takes ``SECOND_CLUSTER_TESTS``; with fewer workers the cluster's tests are one
lane again, on one cluster, and so they are where the disk cannot hold two clusters at once
(``disk_for_two_clusters``: the run's header says so).

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
import shutil
from pathlib import Path

import pytest

from budget import DISK_PATH as DISK  # where the clusters keep their state (/var/tmp)

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


CLUSTER_DISK_GB = 11.0
"""What one cluster lane may hold on /var/tmp's filesystem at once, the other tests beside it, in GB
(10^9 bytes): its nodes' image stores, the image chain's spool file on each node (the whole stream,
1.2 GB), the operator's saved images, a test's own image cache; with room for a run that builds
the clusters' cache beside them (bench/RESULTS.md, "Disk")."""
CACHE_DISK_GB = 8.5
"""What the clusters' cache (netcluster.CACHE_DIR: the base image, the operators' stores, the nodes'
store that each node's starts as a copy of, the containerd node's) takes where it is still to be
built, in GB."""


def disk_for_two_clusters(free_bytes: int | None = None) -> tuple[bool, str]:
    """Whether the disk holds two cluster lanes at once (``$DDP_TEST_CLUSTER_DISK_GB`` overrides
    CLUSTER_DISK_GB), and why not. Decided once, in xdist's controller, before any cluster is up."""
    need_one = float(os.environ.get("DDP_TEST_CLUSTER_DISK_GB") or CLUSTER_DISK_GB)
    if free_bytes is None:
        free_bytes = shutil.disk_usage(DISK).free
    need = 2 * need_one + (0.0 if _cache_built() else CACHE_DISK_GB)
    if free_bytes / 1e9 >= need:
        return True, ""
    return False, (f"the cluster tests run in one lane on one cluster: {DISK}'s filesystem has "
                   f"{free_bytes / 1e9:.1f} GB free, two clusters side by side need {need:.0f} "
                   "(tools/suite/lanes.py CLUSTER_DISK_GB); free space there for the faster run")


def _cache_built() -> bool:
    try:
        from cluster.netcluster import base_image_cache_path
    except ImportError:  # not this repository's tests (test_lanes' own)
        return True
    return base_image_cache_path().exists()


def scope(nodeid: str, workers: int, two_clusters: bool = True) -> str:
    """Its lane with ``workers`` workers: the second cluster lane joins the first where too few, or
    where the disk holds one cluster only."""
    name = lane(nodeid)
    return "cluster" if name == "cluster2" and (workers < 3 or not two_clusters) else name


def site_of(item: pytest.Item) -> int | None:
    """The site (tests/cluster/netcluster.Site) of the cluster this test drives, None for a test of
    the other lane; without ``-n`` every cluster test is on site 0."""
    given = getattr(item.config, "workerinput", {})
    name = scope(item.nodeid, given.get("workercount", 0), given.get(TWO_CLUSTERS, True))
    return None if name == "local" else 1 if name == "cluster2" else 0


TWO_CLUSTERS = "ddp_two_clusters"


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    config._lanes_two_clusters, config._lanes_why_one = disk_for_two_clusters()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """The controller's decision, in each worker's ``workerinput``: every process agrees on it."""
    node.workerinput[TWO_CLUSTERS] = getattr(node.config, "_lanes_two_clusters", True)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Which lanes, and why one (the disk free is live_report's first line)."""
    if not hasattr(config, "_lanes_two_clusters"):
        return []
    return [config._lanes_why_one or "the cluster tests run in two lanes, on two clusters side by side"]


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
            name = scope(nodeid, self.numnodes, getattr(config, "_lanes_two_clusters", True))
            if name != "local":
                return name
            module = nodeid.split("::", 1)[0]
            return module if shares_module_fixtures(config.rootpath / module) else nodeid

    return Lanes(config, log)
