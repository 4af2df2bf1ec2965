"""The Slurm cluster the Slurm tests run on (slurmcluster.py): real slurmctld, slurmds and munge on
the test cluster's hosts, used from node1 over SSH as from a login node."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from procs import command_name

from . import netcluster, slurmcluster
from .operator_cli import wait_until

pytestmark = pytest.mark.cluster


def _submitted(stdout: str) -> str:
    """The job id from sbatch's "Submitted batch job N" (or --parsable's "N")."""
    return stdout.split()[-1].split(";")[0]


def _script(nas: Path, name: str, body: str) -> Path:
    path = nas / name
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


def test_every_node_is_idle_in_the_one_default_partition(cluster, slurm):
    assert slurm.nodes == [h.name for h in cluster.hosts]
    assert slurm.login == "node1"
    assert slurm.node_states() == {name: "idle" for name in slurm.nodes}
    partitions = slurm.run(["sinfo", "-h", "-o", "%P %a %N"], check=True).stdout.split("\n")[:-1]
    assert partitions == [f"{slurm.partition}* up node[1-{len(slurm.nodes)}]"]
    assert slurm.jobs() == []


def test_each_node_is_known_to_slurm_at_its_own_address(cluster, slurm):
    for h in cluster.hosts:
        shown = slurm.run(["scontrol", "show", "node", "-o", h.name], check=True).stdout
        assert f"NodeAddr={h.address} " in shown and "State=IDLE " in shown


def test_srun_from_the_login_node_runs_one_task_per_node_each_on_its_own_address(cluster, slurm):
    r = cluster.ssh(slurm.login, ["srun", "-N2", "-n2", "-l", "sh", "-c",
                                  'echo "$SLURMD_NODENAME $(hostname -I)"'], timeout=60)
    assert r.returncode == 0, r.stderr
    tasks = dict(line.split(": ", 1) for line in r.stdout.splitlines())
    assert sorted(tasks) == ["0", "1"]
    seen = dict(value.split() for value in tasks.values())
    assert seen == {h.name: h.address for h in cluster.hosts[:2]}


def test_sbatch_wait_runs_a_two_node_batch_script_that_writes_its_output_to_the_nas(cluster, slurm, fresh_nas):
    """sbatch --wait runs a batch script on two nodes that writes its output to the NAS."""
    # what deploy's batch script does: the nodes' addresses from Slurm, inside the job
    script = _script(fresh_nas, "job.sh", """\
        for n in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
          echo "addr $n $(scontrol show node -o "$n" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p')"
        done
        srun -l sh -c 'echo "task $SLURMD_NODENAME $(hostname -I)"'
        """)
    r = cluster.ssh(slurm.login, ["sbatch", "--wait", "-N2", f"--output={fresh_nas}/out-%j.txt",
                                  f"--chdir={fresh_nas}", str(script)], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    job = _submitted(r.stdout)
    lines = (fresh_nas / f"out-{job}.txt").read_text().splitlines()
    two = cluster.hosts[:2]
    assert sorted(line for line in lines if line.startswith("addr ")) == [
        f"addr {h.name} {h.address}" for h in two]
    tasks = sorted(line.split(": ", 1)[1].strip() for line in lines if ": task " in line)
    assert tasks == [f"task {h.name} {h.address}" for h in two]

    def ended() -> dict[str, str] | None:
        shown = slurm.run(["scontrol", "show", "job", "-o", job], check=True).stdout
        fields = dict(f.split("=", 1) for f in shown.split() if "=" in f)
        return None if fields.get("JobState") == "COMPLETING" else fields
    # sbatch --wait returns once the job's script has ended; Slurm shows it COMPLETING until every
    # node has cleaned up after it (a clean-clone run found it so once, under load)
    fields = wait_until(ended, 30, f"job {job} to leave COMPLETING")
    assert (fields.get("JobState"), fields.get("NodeList")) == ("COMPLETED", "node[1-2]"), fields


def test_a_running_job_that_is_requeued_starts_again(cluster, slurm, fresh_nas):
    script = _script(fresh_nas, "long.sh", """\
        echo "start ${SLURM_RESTART_COUNT:-0} on $SLURMD_NODENAME"
        sleep 600
        """)
    out = fresh_nas / "long.out"
    r = cluster.ssh(slurm.login, ["sbatch", "--parsable", "-N2", "--open-mode=append",
                                  f"--output={out}", str(script)], check=True)
    job = _submitted(r.stdout)

    def starts() -> list[str]:
        return [line for line in out.read_text().splitlines()
                if line.startswith("start ")] if out.exists() else []
    wait_until(starts, 30, "the job to start")
    slurm.run(["scontrol", "requeue", job], check=True)
    wait_until(lambda: len(starts()) == 2, 90, "the requeued job to start again", interval=0.2)
    assert starts() == ["start 0 on node1", "start 1 on node1"]
    shown = slurm.run(["scontrol", "show", "job", "-o", job], check=True).stdout
    assert "Restarts=1" in shown and "JobState=RUNNING" in shown


def test_a_fresh_start_reaps_the_daemons_and_jobs_of_a_run_that_was_killed(cluster, slurm):
    r = cluster.ssh(slurm.login, ["sbatch", "--parsable", "-N2", "--output=/dev/null",
                                  "--wrap", "srun sleep 600"], check=True)
    wait_until(lambda: slurm.run(["squeue", "-h", "-o", "%T", "-j", _submitted(r.stdout)]
                                 ).stdout.strip() == "RUNNING", 30, "the job to run")

    def names() -> set[str]:
        return {comm for p in slurmcluster.marked_processes() if (comm := command_name(p))}
    # RUNNING comes before the step's srun has its `sleep` started on the nodes
    wait_until(lambda: {"munged", "slurmctld", "slurmd", "slurmstepd", "sleep"} <= names(), 30,
               "the daemons, the step daemons and the job's sleep", interval=0.2)
    before = slurmcluster.marked_processes()  # daemons, step daemons, the job's processes
    # a later session's start, while the processes of this one are still there (as after kill -9)
    later = slurmcluster.SlurmCluster(cluster)
    try:
        later.start()
        assert not [p for p in before if netcluster._pid_alive(p)]
        assert later.jobs() == [] and later.node_states() == {n: "idle" for n in later.nodes}
        later.stop()
        assert slurmcluster.marked_processes() == []
        assert not slurmcluster.SLURM_ROOT.exists() and not slurmcluster.SLURM_SPOOL.exists()
    finally:
        later.stop()
        slurm.start()  # the session's own, for the tests after this one
