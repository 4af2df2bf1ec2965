"""`ddp-deploy export k8s`: the manifests are data; the kubernetes client's models check their fields."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from kubernetes.client import ApiClient

from deploy.engines import k8s
from deploy.errors import InputError
from deploy.inventory import loads
from fakes import install_command
from local_job import inventory
from agent.contract import module_argv

ROOT = Path(__file__).resolve().parent.parent

HOSTILE_ARGS = ["--dataset", "synthetic", "--config", "it's $(rm -rf /); $$HOME $(DDP_DATA_DIR) `id` $"]
ENV = {"NCCL_DEBUG": "INFO", "NOTE": "cost $(POD_IP) $$"}


def fleet(*, changed: dict | None = None, job: str = "demo", train: dict | None = None) -> dict:
    """The 3-node GPU fleet these manifests are made for (tests/local_job.py): ``changed``, a
    node's fields changed; ``train``, its fields replaced."""
    nodes = [{"name": "a", "address": "198.18.0.11", "gpus": 2, "interface": "eth1", "env": {"NCCL_IB_HCA": "mlx5_0"}},
             {"name": "b", "address": "198.18.0.12", "gpus": 2}, {"name": "c", "address": "198.18.0.13", "gpus": 2}]
    return inventory([{**n, **(changed or {}).get(n["name"], {})} for n in nodes], job=job,
                     job_fields={"max_restarts": 2}, rendezvous={"node": "b", "port": 29500, "join_timeout": 120},
                     train={"args": HOSTILE_ARGS, "env": ENV, "secrets": {"WANDB_API_KEY": {"env": "OPERATOR_WANDB"}},
                            **(train or {})})


FLEET = json.dumps(fleet())
SLURM = json.dumps(inventory([], job="big", job_fields={"runtime": "host"}, nas="/shared",
                             slurm={"login": {"address": "10.0.0.5"}, "nodes": 4, "gpus_per_node": 8},
                             train={"python": "/shared/venv/bin/python"}))
CPU_NODES = [{"name": "a", "address": "10.0.0.1", "procs": 2}, {"name": "b", "address": "10.0.0.2", "procs": 2}]
CPU = json.dumps(inventory(CPU_NODES, job="small"))


def _inv(text=FLEET, **changes):
    return loads(json.dumps(fleet(**changes)) if changes else text)


class _Response:
    """What ApiClient.deserialize reads before kubernetes 37: a response, its body as ``data``."""

    def __init__(self, body: str) -> None:
        self.data = body


def _valid(doc: dict, model: str) -> None:
    """``doc`` as the kubernetes client's ``model`` reads it, and back: a misspelled or misplaced
    field is dropped on the way (or a required one refused), so the two differ."""
    client = ApiClient()
    body = json.dumps(doc)
    if "content_type" in inspect.signature(client.deserialize).parameters:  # kubernetes >= 37: the body itself
        obj = client.deserialize(body, model, "application/json")
    else:
        obj = client.deserialize(_Response(body), model)
    assert client.sanitize_for_serialization(obj) == doc


def _by_kind(docs: list[dict]) -> dict[str, dict]:
    return {d["kind"]: d for d in docs}


def _pod(docs: list[dict]) -> dict:
    return _by_kind(docs)["Job"]["spec"]["template"]["spec"]


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def _expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's expansion of command, args and env values (Kubernetes'
    third_party/forked/golang/expansion): $(NAME) from the container's variables, left as it is
    when unknown; $$ is $; any other $ stays."""
    out, i = [], 0
    while i < len(text):
        if text[i] != "$" or i + 1 == len(text):
            out.append(text[i])
            i += 1
        elif text[i + 1] == "$":
            out.append("$")
            i += 2
        elif text[i + 1] == "(" and ")" in text[i + 2:]:
            end = text.index(")", i + 2)
            name = text[i + 2:end]
            out.append(env.get(name, f"$({name})"))
            i = end + 1
        else:
            out.append(text[i:i + 2])
            i += 2
    return "".join(out)


def _run_pod(container: dict, env: dict[str, str], tmp_path, monkeypatch) -> list[str]:
    """What the pod's container executes, its ``python`` replaced by one that prints its argv."""
    install_command(tmp_path, monkeypatch, "python", "#!/bin/sh\nfor a in \"$@\"; do printf '%s\\0' \"$a\"; done\n")
    argv = [_expand(a, env) for a in [*container["command"], *container["args"]]]
    done = subprocess.run(argv, capture_output=True, check=True)
    return done.stdout.decode().split("\0")[:-1]


def _opt(argv, flag):
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("text", [FLEET, SLURM, CPU])
@pytest.mark.parametrize("pvc", [None, "shared-nfs"])
def test_the_service_and_job_are_valid_kubernetes_objects(text, pvc):
    docs = k8s.manifests(_inv(text), namespace="ml", pvc=pvc)
    assert [d["kind"] for d in docs] == ["Service", "Job"]
    _valid(docs[0], "V1Service")
    _valid(docs[1], "V1Job")


def test_a_misspelled_field_would_fail_the_check():
    doc = k8s.manifests(_inv())[1]
    doc["spec"]["template"]["spec"]["restartPolicyy"] = "Never"
    with pytest.raises(AssertionError):
        _valid(doc, "V1Job")


def test_pytorchjob_is_master_and_workers_with_valid_pod_templates():
    docs = k8s.manifests(_inv(), kind="pytorchjob", pvc="shared-nfs")
    assert len(docs) == 1
    job = docs[0]
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == ("kubeflow.org/v1", "PyTorchJob", "demo")
    assert set(job["spec"]) == {"nprocPerNode", "runPolicy", "pytorchReplicaSpecs"}
    assert job["spec"]["nprocPerNode"] == "2" and job["spec"]["runPolicy"] == {"backoffLimit": 6}
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert {role: r["replicas"] for role, r in replicas.items()} == {"Master": 1, "Worker": 2}
    for r in replicas.values():
        assert set(r) == {"replicas", "restartPolicy", "template"} and r["restartPolicy"] == "OnFailure"
        _valid(r["template"], "V1PodTemplateSpec")
        (box,) = r["template"]["spec"]["containers"]
        # The operator reads MASTER_PORT from this container and port, by these names.
        assert box["name"] == "pytorch" and box["ports"] == [{"name": "pytorchjob-port", "containerPort": 29500,
                                                                "protocol": "TCP"}]
        assert _opt(box["args"], "--rdzv-endpoint") == "demo-master-0:29500"
    assert replicas["Master"]["template"] == replicas["Worker"]["template"]


def test_a_single_node_pytorchjob_has_no_workers():
    job = k8s.manifests(_inv(json.dumps(inventory(CPU_NODES[:1], job="small"))), kind="pytorchjob")[0]
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Master"]


def test_the_rendezvous_endpoint_is_pod_zeros_dns_name_on_the_headless_service():
    service, job = k8s.manifests(_inv())
    pod = job["spec"]["template"]
    (box,) = pod["spec"]["containers"]
    assert _opt(box["args"], "--rdzv-endpoint") == "demo-0.demo:29500"
    assert pod["spec"]["subdomain"] == service["metadata"]["name"] == "demo"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["port"] == 29500
    assert job["spec"]["completionMode"] == "Indexed"


def test_only_index_zero_hosts_the_rendezvous_when_the_pods_run(tmp_path, monkeypatch):
    (box,) = _pod(k8s.manifests(_inv()))["containers"]
    runs = {i: _run_pod(box, {"JOB_COMPLETION_INDEX": str(i), "POD_IP": f"10.244.0.{i + 5}"}, tmp_path, monkeypatch)
            for i in range(3)}
    for i, argv in runs.items():
        assert argv[:3] == module_argv("agent.launch")  # never a trainer/ package of the workdir
        assert _opt(argv, "--node-rank") == str(i)
        assert _opt(argv, "--local-addr") == f"10.244.0.{i + 5}"
        assert _opt(argv, "--rdzv-endpoint") == "demo-0.demo:29500"
    assert [_opt(argv, "--rdzv-conf") for argv in runs.values()] == [
        "is_host=1,join_timeout=120,read_timeout=60", "join_timeout=120,read_timeout=60",
        "join_timeout=120,read_timeout=60"]


def test_only_the_pytorchjob_master_hosts_the_rendezvous(tmp_path, monkeypatch):
    replicas = k8s.manifests(_inv(), kind="pytorchjob")[0]["spec"]["pytorchReplicaSpecs"]
    box = replicas["Worker"]["template"]["spec"]["containers"][0]
    # The training operator sets RANK: the master 0, worker i i+1.
    confs = [_opt(_run_pod(box, {"RANK": str(r), "POD_IP": "10.244.0.9"}, tmp_path, monkeypatch), "--rdzv-conf")
             for r in range(3)]
    assert [c.startswith("is_host=1,") for c in confs] == [True, False, False]


def test_the_program_gets_its_arguments_as_hosts_yaml_gives_them(tmp_path, monkeypatch):
    """The kubelet expands $(NAME) and $$ in args and env values: none of the inventory's text is."""
    inv = _inv()
    (box,) = _pod(k8s.manifests(inv))["containers"]
    env = {"JOB_COMPLETION_INDEX": "1", "POD_IP": "10.244.0.6", "DDP_DATA_DIR": "/data"}
    argv = _run_pod(box, env, tmp_path, monkeypatch)
    assert argv[argv.index("--"):] == ["--", "--data-dir", "/data", "--ckpt-dir", "/ckpt", "--device", "cuda",
                                       "--backend", "nccl", *inv.train.args]
    assert _expand(_env(box)["NOTE"]["value"], env) == "cost $(POD_IP) $$"


def test_a_user_module_is_named_before_the_separator(tmp_path, monkeypatch):
    inv = _inv(train={"module": "pkg.train", "args": HOSTILE_ARGS[2:]})
    (box,) = _pod(k8s.manifests(inv))["containers"]
    argv = _run_pod(box, {"JOB_COMPLETION_INDEX": "0", "POD_IP": "10.244.0.5"}, tmp_path, monkeypatch)
    assert argv[argv.index("--entry"):argv.index("--entry") + 3] == ["--entry", "pkg.train", "--"]
    assert argv[argv.index("--") + 1:] == list(inv.train.args)


def test_the_secret_is_a_reference_and_its_value_is_nowhere(monkeypatch):
    monkeypatch.setenv("OPERATOR_WANDB", "wandb-value-7f3a9c1e")
    inv = _inv()
    for kind in k8s.KINDS:
        docs = k8s.manifests(inv, kind=kind, namespace="ml")
        text = k8s.render(inv, docs)
        assert "wandb-value-7f3a9c1e" not in text
        assert 'kubectl create secret generic demo-secrets -n ml --from-literal=WANDB_API_KEY="$OPERATOR_WANDB"' in text
    (box,) = _pod(k8s.manifests(inv))["containers"]
    assert _env(box)["WANDB_API_KEY"] == {
        "name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "demo-secrets", "key": "WANDB_API_KEY"}}}


def test_a_secret_file_is_read_by_the_operators_shell_when_the_secret_is_made(tmp_path):
    inv = loads(json.dumps(fleet(train={"secrets": {"WANDB_API_KEY": {"file": "keys/wandb"}}})), base_dir=tmp_path)
    text = k8s.render(inv, k8s.manifests(inv))
    assert f"--from-literal=WANDB_API_KEY=\"$(cat {tmp_path}/keys/wandb)\"" in text


def test_the_pod_environment_is_the_contract_then_train_env():
    (box,) = _pod(k8s.manifests(_inv()))["containers"]
    env = _env(box)
    assert env["DDP_NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["JOB_COMPLETION_INDEX"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    assert {k: env[k]["value"] for k in ("DDP_DATA_DIR", "DDP_CKPT_DIR", "DDP_RUN_ID", "DDP_DEVICE", "DDP_BACKEND",
                                         "GLOO_SOCKET_IFNAME", "NCCL_DEBUG")} == {
        "DDP_DATA_DIR": "/data", "DDP_CKPT_DIR": "/ckpt", "DDP_RUN_ID": "demo", "DDP_DEVICE": "cuda",
        "DDP_BACKEND": "nccl", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "INFO"}
    names = [e["name"] for e in box["env"]]
    assert names.index("DDP_BACKEND") < names.index("NCCL_DEBUG") < names.index("WANDB_API_KEY")


def test_gloo_uses_the_pods_interface_unless_train_env_names_one():
    (box,) = _pod(k8s.manifests(_inv(train={"env": {"GLOO_SOCKET_IFNAME": "net1", "NOTE": ENV["NOTE"]}})))["containers"]
    assert [e.get("value") for e in box["env"] if e["name"] == "GLOO_SOCKET_IFNAME"] == ["net1"]


def test_per_node_settings_are_left_out_and_named_in_the_header():
    inv = _inv()
    docs = k8s.manifests(inv)
    assert "NCCL_IB_HCA" not in json.dumps(docs) and "eth1" not in json.dumps(docs)
    header = [line for line in k8s.render(inv, docs).splitlines() if line.startswith("# Not carried over")]
    assert header == ["# Not carried over: nodes[].env (a: NCCL_IB_HCA), per host on the fleet; put what every "
                      "pod needs in train.env",
                      "# Not carried over: nodes[].interface and gpu_ids (a): a pod uses eth0 and the GPUs the "
                      "device plugin gives it"]


def test_gpus_become_device_plugin_limits_and_cuda_flags():
    (box,) = _pod(k8s.manifests(_inv()))["containers"]
    assert box["resources"] == {"limits": {"nvidia.com/gpu": "2"}}
    assert (_opt(box["args"], "--device"), _opt(box["args"], "--backend")) == ("cuda", "nccl")


def test_a_cpu_job_asks_for_no_gpus_and_trains_with_gloo():
    inv = _inv(CPU)
    (box,) = _pod(k8s.manifests(inv))["containers"]
    assert "resources" not in box
    assert (_opt(box["args"], "--device"), _opt(box["args"], "--backend")) == ("cpu", "gloo")
    assert _env(box)["DDP_DEVICE"]["value"] == "cpu"
    assert "nvidia" not in k8s.render(inv, k8s.manifests(inv))


def test_a_claim_holds_data_and_checkpoints_as_sub_paths():
    pod = _pod(k8s.manifests(_inv(), pvc="shared-nfs"))
    (box,) = pod["containers"]
    assert pod["volumes"][0] == {"name": "shared", "persistentVolumeClaim": {"claimName": "shared-nfs"}}
    assert box["volumeMounts"][:2] == [{"name": "shared", "mountPath": "/data", "subPath": "data"},
                                       {"name": "shared", "mountPath": "/ckpt", "subPath": "checkpoints"}]
    assert pod["securityContext"] == {"fsGroup": 1000}
    assert not any("hostPath" in v for v in pod["volumes"])


def test_without_a_claim_the_storage_host_paths_are_mounted_as_docker_would():
    pod = _pod(k8s.manifests(_inv()))
    (box,) = pod["containers"]
    assert pod["volumes"][:2] == [{"name": "data", "hostPath": {"path": "/nas/data", "type": "Directory"}},
                                  {"name": "checkpoints", "hostPath": {"path": "/nas/ckpt", "type": "Directory"}}]
    assert box["volumeMounts"][:2] == [{"name": "data", "mountPath": "/data"},
                                       {"name": "checkpoints", "mountPath": "/ckpt"}]
    assert "securityContext" not in pod


def test_shared_memory_is_in_ram_at_dev_shm():
    pod = _pod(k8s.manifests(_inv()))
    assert {"name": "shm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]


def test_a_failed_pod_restarts_in_place_within_each_nodes_max_restarts():
    job = _by_kind(k8s.manifests(_inv()))["Job"]
    assert job["spec"]["backoffLimit"] == 2 * 3
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    assert job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 45  # the planned stop's checkpoint


def test_a_slurm_inventory_gives_the_node_count_and_processes():
    inv = _inv(SLURM)
    job = _by_kind(k8s.manifests(inv))["Job"]
    assert (job["spec"]["completions"], job["spec"]["parallelism"]) == (4, 4)
    (box,) = job["spec"]["template"]["spec"]["containers"]
    assert (_opt(box["args"], "--nnodes"), _opt(box["args"], "--nproc-per-node")) == ("4", "8")
    assert box["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert (_opt(box["args"], "--data-dir"), _opt(box["args"], "--ckpt-dir")) == ("/data", "/ckpt")
    header = k8s.render(inv, [job])
    assert "job.runtime host (train.python): the pods run the image ddp-trainer:latest" in header
    assert "4 node(s) x 8 process(es), 8 GPU(s) each" in header


def test_train_code_is_refused_naming_it():
    with pytest.raises(InputError) as e:
        k8s.manifests(_inv(train={"code": "."}))
    assert e.value.exit_code == 2
    assert str(e.value).startswith("train.code: ") and "bake the code into the image" in str(e.value)


def test_nodes_of_different_shapes_are_refused():
    with pytest.raises(InputError, match="nodes: nodes differ in processes or GPUs"):
        k8s.manifests(_inv(changed={"c": {"gpus": 1}}))


@pytest.mark.parametrize("name", ["my_job", "v1.2", "9lives", "x" * 62])
def test_a_job_name_kubernetes_cannot_use_is_refused(name):
    with pytest.raises(InputError, match="job.name: .* not a name Kubernetes accepts"):
        k8s.manifests(_inv(job=name))


def test_a_variable_the_launcher_uses_cannot_be_shadowed_by_train_env():
    with pytest.raises(InputError, match=r"train.env.POD_IP: POD_IP is set in each pod"):
        k8s.manifests(_inv(train={"env": {"POD_IP": "1.2.3.4", "NOTE": ENV["NOTE"]}}))
    k8s.manifests(_inv(train={"env": {"RANK": "0", "NOTE": ENV["NOTE"]}}), kind="job")
    with pytest.raises(InputError, match=r"train.env.RANK"):
        k8s.manifests(_inv(train={"env": {"RANK": "0", "NOTE": ENV["NOTE"]}}), kind="pytorchjob")


def test_namespace_and_labels_are_on_every_object():
    for kind in k8s.KINDS:
        for doc in k8s.manifests(_inv(), kind=kind, namespace="ml"):
            assert doc["metadata"]["namespace"] == "ml"
            assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "demo"
    assert all("namespace" not in d["metadata"] for d in k8s.manifests(_inv()))


def test_the_image_argument_replaces_image_name():
    (box,) = _pod(k8s.manifests(_inv(), image="registry.example/ddp:7"))["containers"]
    assert box["image"] == "registry.example/ddp:7"


def test_render_is_the_documents_after_a_comment_header():
    inv = _inv()
    docs = k8s.manifests(inv, pvc="shared-nfs")
    text = k8s.render(inv, docs)
    head = text[:text.index("apiVersion")].splitlines()
    assert head and all(line.startswith("#") for line in head)
    assert list(yaml.safe_load_all(text)) == docs
    assert "&id" not in text and "*id" not in text  # every object written out, none as a YAML alias
    assert "PersistentVolumeClaim shared-nfs, ReadWriteMany" in text
    assert "NVIDIA device plugin: nvidia.com/gpu, 2 per pod" in text


def test_render_names_the_kubeflow_operator_for_a_pytorchjob():
    inv = _inv()
    assert "Kubeflow's training operator" in k8s.render(inv, k8s.manifests(inv, kind="pytorchjob"))
    assert "Kubeflow" not in k8s.render(inv, k8s.manifests(inv))


def test_deploy_k8s_imports_neither_torch_nor_kubernetes():
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # any import of torch now fails
        from deploy.engines import k8s
        from deploy.inventory import loads
        inv = loads({FLEET!r})
        for kind in k8s.KINDS:
            k8s.render(inv, k8s.manifests(inv, kind=kind))
        assert "kubernetes" not in sys.modules, "kubernetes imported"
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
