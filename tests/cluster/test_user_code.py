"""The user's own code on the 3-node cluster through the CLI, in both code modes: built into a
project image (docker/Dockerfile.project on the trainer image), and synced as a snapshot to the
NAS and mounted read-only. Each example trains on every node, shows its metrics in `status`, is
stopped and launched again and resumes from its checkpoint; a one-file edit sends one file. The
synced script also saves a file where it stands, as a tutorial does: each node's lands in its own
working directory on the NAS, kept across launches, never in the code snapshot.

Each example in one mode, the two modes between them: the package (``-m regress.train``) built into
an image, the script (charlm's ``train.py``) synced. The train section's script or module reaches
the launcher the same way in either mode (deploy/job/payload.py), both examples' entries run under
torchrun in tests/test_examples.py, and each more pairing would cost a 3-node job's two launches."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from .operator_cli import REPO, ddp, ok

pytestmark = pytest.mark.cluster

EXAMPLES = {  # example -> (train section naming its program, flags for one short epoch)
    "charlm": ({"script": "train.py"}, ["--steps-per-epoch", "4"]),
    "regress": ({"module": "regress.train"}, ["--samples", "768"]),
}


@pytest.fixture(scope="module")
def trainer_image(cluster):
    """ddp-trainer:test in the operator's daemon: the base every project image starts from."""
    cluster_hosts = cluster.hosts_config()
    subprocess.run(["docker", "-H", cluster.operator_docker_host, "build", "-q", "--build-arg",
                    f"BASE_IMAGE={cluster_hosts['image']['build_args']['BASE_IMAGE']}", "-t", "ddp-trainer:test",
                    str(REPO)], check=True, capture_output=True, timeout=900)
    return "ddp-trainer:test"


def _hosts(cluster, tmp_path, name, epochs, **sections):
    program, flags = EXAMPLES[name]
    train = {**program, "args": [*flags, "--epochs", str(epochs)]}
    train.update(sections.pop("train", {}))
    return cluster.write_hosts_yaml(tmp_path / "hosts.yaml", runtime="docker", interface="eth0", procs=1,
                                    train=train, **sections)


def _metrics(cluster, hosts) -> dict:
    states = json.loads(ok(ddp(cluster, hosts, "status", "--json")).stdout)
    assert [s["state"] for s in states] == ["exited(0)"] * 3, states
    line = states[0]["metrics"]
    assert line.startswith("METRICS "), states
    return json.loads(line[len("METRICS "):])


def _train_then_resume(cluster, tmp_path, name, fresh_nas, **sections):
    hosts = _hosts(cluster, tmp_path, name, 1, **sections)
    first = ok(ddp(cluster, hosts, "launch", "--wait", "--timeout", "600", timeout=660))
    assert re.search(r"started ddp-test run [0-9]{8}-[0-9]{6}-[0-9a-f]{4} on 3 nodes \(3 processes\)", first.stdout)
    assert _metrics(cluster, hosts)["kind"] == "eval"
    # when the first step came, said and kept in the run's record on the NAS (written there as the tool's user)
    said = re.search(r"^first step after (\d+\.\d) s \((\S+): ", first.stdout, re.M)
    assert said and said[2] in {h.name for h in cluster.hosts}, first.stdout
    kept = json.loads(ok(ddp(cluster, hosts, "runs", "--json")).stdout)[-1]["record"]["first_step"]
    assert (kept["after_s"], kept["node"]) == (float(said[1]), said[2])
    ok(ddp(cluster, hosts, "stop"))

    hosts = _hosts(cluster, tmp_path, name, 2, **sections)
    again = ok(ddp(cluster, hosts, "launch", "--wait", "--timeout", "600", timeout=660))
    logs = ok(ddp(cluster, hosts, "logs")).stdout
    assert "resuming from" in logs  # the first launch's checkpoint on the NAS
    assert _metrics(cluster, hosts)["epoch"] == 1
    ok(ddp(cluster, hosts, "stop"))
    return first, again


@pytest.mark.parametrize("name", ["regress"])
def test_an_example_built_into_a_project_image_trains_on_three_nodes_and_resumes(
        cluster, fresh_nas, trainer_image, tmp_path, name):
    image = {"name": f"{name}:test", "context": str(REPO / "examples" / name),
             "dockerfile": str(REPO / "docker/Dockerfile.project"), "build_args": {"TRAINER_IMAGE": trainer_image}}
    hosts = _hosts(cluster, tmp_path, name, 1, image=image)
    deployed = ok(ddp(cluster, hosts, "deploy", timeout=900))
    assert all(f"{h.name}: shipped" in deployed.stdout for h in cluster.hosts)
    ok(ddp(cluster, hosts, "check"))
    first, _ = _train_then_resume(cluster, tmp_path, name, fresh_nas, image=image)
    assert "code sent" not in first.stdout  # the code is in the image


# A tutorial's save where it stands, by each node's local rank 0 ("its own copy"), at every launch.
SAVES_WHERE_IT_STANDS = """
if __name__ == "__main__" and os.environ["LOCAL_RANK"] == "0":
    with open("model.pth", "a") as saved:
        saved.write(os.environ["DDP_NODE_NAME"] + "\\n")
"""


def _saved_where_they_stand(fresh_nas, nodes, launches):
    """Each node's working directory on the NAS (agent/workdir.py): its own model.pth, one line per
    launch, beside links to the code as the container sees it (the snapshot at /workspace)."""
    for node in nodes:
        work = fresh_nas / "ckpt/work" / node
        assert (work / "model.pth").read_text() == f"{node}\n" * launches
        assert os.readlink(work / "train.py") == "/workspace/train.py"
        assert (work / "data").is_dir() and not (work / "data").is_symlink()
    assert not list((fresh_nas / "ckpt/.ddp-deploy/code/snapshots").glob("*/model.pth"))  # never in the code


@pytest.mark.parametrize("name", ["charlm"])
def test_a_synced_example_trains_on_three_nodes_resumes_and_an_edit_sends_one_file(
        cluster, fresh_nas, trainer_image, tmp_path, name):
    """An example synced as a snapshot trains on three nodes and resumes, and an edit sends one file."""
    project = tmp_path / name
    shutil.copytree(REPO / "examples" / name, project, ignore=shutil.ignore_patterns("runs", "__pycache__"))
    with open(project / "train.py", "a") as script:
        script.write(SAVES_WHERE_IT_STANDS)
    ok(ddp(cluster, cluster.write_hosts_yaml(tmp_path / "deploy.yaml", runtime="docker"), "deploy", timeout=900))
    code = {"train": {"code": str(project)}}
    first, again = _train_then_resume(cluster, tmp_path, name, fresh_nas, **code)
    first_node, *others = [h.name for h in cluster.hosts]
    assert f"{first_node}: code sent" in first.stdout  # one copy, on the shared NAS...
    assert all(f"{n}: code snapshot" in first.stdout and "present" in first.stdout for n in others)  # ...seen by all
    assert all(f"{n}: code snapshot" in again.stdout for n in [first_node, *others])  # unchanged: nothing sent
    _saved_where_they_stand(fresh_nas, [first_node, *others], 2)

    edited = next(project.rglob("train.py"))
    edited.write_text(edited.read_text() + "\n# edited\n")
    hosts = _hosts(cluster, tmp_path, name, 2, **code)
    launched = ok(ddp(cluster, hosts, "launch", "--wait", "--timeout", "600", timeout=660))
    assert f"{first_node}: code sent 1 file (" in launched.stdout
    snapshots = sorted((fresh_nas / "ckpt/.ddp-deploy/code/snapshots").iterdir())
    assert len(snapshots) == 2
    _saved_where_they_stand(fresh_nas, [first_node, *others], 3)  # kept across the new snapshot
    ok(ddp(cluster, hosts, "stop"))
