"""The job as Kubernetes manifests (``ddp-deploy export k8s``): inventory in, plain dicts out.

The same job as on a fleet or on Slurm: one pod per node, each running the image's launcher
(``python -m agent.launch``, torchrun) with a c10d rendezvous hosted by the pod of node index 0,
the program's flags with the storage's container paths, the environment of the contract
(docs/CONTRACTS.md), secrets by reference only. Two kinds, one class each:

- ``job``: a headless Service and an Indexed ``batch/v1`` Job. Pod ``<job>-<index>`` on the
  Service's subdomain is reachable as ``<job>-<index>.<job>``: the rendezvous endpoint is pod 0's
  name, and the node index is the pod's completion index.
- ``pytorchjob``: Kubeflow's PyTorchJob (Master 1, Worker N-1); see :class:`PyTorchJob`.

Nothing here talks to a cluster; neither torch nor the kubernetes package is imported (the tests
validate the output against the kubernetes client's models).
"""

from __future__ import annotations

import re
import shlex

import yaml

from agent.contract import LAUNCH_MODULE, RUN_MODULE

from ..errors import InputError
from ..inventory import Inventory
from ..job.payload import payload
from ..job.plan import contract_env, rdzv_conf, tool_flags, torchrun_procs
from ..job.runtime import STOP_GRACE_S
from ..job.secretenv import source

IMAGE_GID = 1000
"""The image's user is uid/gid 1000 (Dockerfile): a claim's files are made writable for it."""

POD_INTERFACE = "eth0"
"""A pod's network interface (the CNI's), the one the other pods reach."""

POD_IP = "POD_IP"
"""The pod's address (downward API), for ``--local-addr``: the c10d store and the workers' store
listen there."""

RESTART_POLICY = "OnFailure"
"""A pod whose launcher died comes back in place, as a fleet's container does under Docker's
``--restart on-failure``: same address, same DNS name (pod 0 keeps the endpoint), the image
already there, so it rejoins the next rendezvous round fastest. torchrun restarts the workers
inside it (--max-restarts) before that."""

# $1 = the node's index (0 hosts the rendezvous), $2 = --rdzv-conf without is_host, then the
# launcher's other arguments. torchrun cannot tell from pod 0's DNS name that it is pod 0 (the
# name may not resolve yet when the pod starts), so is_host=1 is given to index 0 alone, as on a
# fleet. Execs what the image's ENTRYPOINT runs.
LAUNCH = ('node=$1; conf=$2; shift 2; [ "$node" = 0 ] && conf="is_host=1,$conf"; '
          f'exec python -c {shlex.quote(RUN_MODULE)} {LAUNCH_MODULE} --rdzv-conf "$conf" --node-rank "$node" "$@"')

_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")


def literal(text: str) -> str:
    """``text`` as Kubernetes passes it on: the kubelet expands ``$(NAME)`` in command, args and
    env values and reads ``$$`` as ``$``, so those are escaped; the program gets its arguments
    exactly as hosts.yaml gives them, as on a fleet."""
    return re.sub(r"\$(?=[$(])", "$$", text)


def _ref(name: str) -> str:
    """A value the kubelet fills in from the container's variable ``name``."""
    return f"$({name})"


def _field_env(name: str, path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _env(name: str, value: str) -> dict:
    return {"name": name, "value": literal(value)}


class Kind:
    """What differs between the two kinds of manifests: names, how a pod knows its node index,
    and the objects around the pod template."""

    name = ""
    container = "trainer"
    port_name = "rendezvous"
    node_index = ""
    """The pod's node index as the kubelet expands it in args (0 hosts the rendezvous)."""
    pod_vars: tuple[str, ...] = ()
    """Variables of the pod that the launcher's arguments use: train.env must not shadow them."""

    def longest_suffix(self, nodes: int) -> str:
        """The longest that Kubernetes appends to the job's name in a pod's DNS name (63 at most)."""
        raise NotImplementedError

    def endpoint(self, inv: Inventory) -> str:
        raise NotImplementedError

    def index_env(self) -> list[dict]:
        """Variables the pod declares so that ``node_index`` expands."""
        return []

    def pod_fields(self, inv: Inventory) -> dict:
        return {}

    def documents(self, inv: Inventory, namespace: str | None, pvc: str | None, image: str) -> list[dict]:
        """The objects to apply, each built apart (no dict shared between them)."""
        raise NotImplementedError


class IndexedJob(Kind):
    """A headless Service and an Indexed Job: pod ``<job>-<i>``, on the Service's subdomain, is
    ``<job>-<i>.<job>`` to the others. The Service publishes a pod's address before it is ready,
    so pod 0's name resolves as soon as it has an address (no readiness probe to wait for)."""

    name = "job"
    node_index = _ref("JOB_COMPLETION_INDEX")
    pod_vars = (POD_IP, "JOB_COMPLETION_INDEX")

    def longest_suffix(self, nodes):
        return f"-{nodes - 1}"

    def endpoint(self, inv):
        return f"{inv.job.name}-0.{inv.job.name}:{inv.rendezvous.port}"

    def index_env(self):
        """What Kubernetes itself adds to an Indexed Job's containers (and then skips), declared so
        that ``$(JOB_COMPLETION_INDEX)`` in args expands whatever the cluster's version."""
        return [_field_env("JOB_COMPLETION_INDEX", "metadata.annotations['batch.kubernetes.io/job-completion-index']")]

    def pod_fields(self, inv):
        return {"subdomain": inv.job.name}

    def documents(self, inv, namespace, pvc, image):
        nodes = inv.shape[0]
        service = {
            "apiVersion": "v1", "kind": "Service", "metadata": metadata(inv, namespace),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": selector(inv),
                     "ports": [{"name": self.port_name, "port": inv.rendezvous.port,
                                "targetPort": inv.rendezvous.port, "protocol": "TCP"}]},
        }
        job = {
            "apiVersion": "batch/v1", "kind": "Job", "metadata": metadata(inv, namespace),
            "spec": {"completionMode": "Indexed", "completions": nodes, "parallelism": nodes,
                     "backoffLimit": backoff_limit(inv), "template": pod_template(inv, self, pvc, image)},
        }
        return [service, job]


class PyTorchJob(Kind):
    """Kubeflow's PyTorchJob (``kubeflow.org/v1``): Master 1 and Worker N-1, one pod template.

    The training operator gives each pod a headless Service of its own (``<job>-master-0``,
    ``<job>-worker-<i>``) and sets MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK and torchrun's
    ``PET_*`` defaults for a static rendezvous. Our launcher uses the c10d rendezvous instead,
    as on a fleet: the torchrun options are given explicitly (they win over ``PET_*``), with the
    master's Service as the endpoint (``<job>-master-0:<port>``). The node index is the
    operator's RANK (Master 0, Worker i: i+1), so only the master hosts the store. The operator
    needs the container named ``pytorch`` and its port named ``pytorchjob-port`` (MASTER_PORT):
    that is the rendezvous port here. Torchrun sets its workers' MASTER_ADDR/PORT, RANK and
    WORLD_SIZE itself, over the operator's."""

    name = "pytorchjob"
    container = "pytorch"
    port_name = "pytorchjob-port"
    node_index = _ref("RANK")
    pod_vars = (POD_IP, "RANK")

    def longest_suffix(self, nodes):
        return max("-master-0", f"-worker-{max(nodes - 2, 0)}", key=len)

    def endpoint(self, inv):
        return f"{inv.job.name}-master-0:{inv.rendezvous.port}"

    def documents(self, inv, namespace, pvc, image):
        nodes, procs, _ = inv.shape
        counts = {"Master": 1, "Worker": nodes - 1}
        replicas = {role: {"replicas": n, "restartPolicy": RESTART_POLICY,
                           "template": pod_template(inv, self, pvc, image)} for role, n in counts.items() if n}
        return [{
            "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": metadata(inv, namespace),
            "spec": {"nprocPerNode": torchrun_procs(inv, procs), "runPolicy": {"backoffLimit": backoff_limit(inv)},
                     "pytorchReplicaSpecs": replicas},
        }]


KINDS = {k.name: k for k in (IndexedJob(), PyTorchJob())}


def backoff_limit(inv: Inventory) -> int:
    """How many pod failures (container restarts, with OnFailure) the job survives: each node's
    ``job.max_restarts``, as on a fleet, where every node's container may come back that often.
    Kubernetes counts them for the whole job, and one lost rendezvous host fails every pod once."""
    return inv.job.max_restarts * inv.shape[0]


def secret_name(inv: Inventory) -> str:
    return f"{inv.job.name}-secrets"


def selector(inv: Inventory) -> dict[str, str]:
    return {"app.kubernetes.io/name": inv.job.name, "app.kubernetes.io/component": "trainer"}


def labels(inv: Inventory) -> dict[str, str]:
    return {**selector(inv), "app.kubernetes.io/managed-by": "ddp-deploy"}


def metadata(inv: Inventory, namespace: str | None) -> dict:
    return {"name": inv.job.name, **({"namespace": namespace} if namespace else {}), "labels": labels(inv)}


def manifests(inv: Inventory, *, kind: str = "job", namespace: str | None = None, pvc: str | None = None,
              image: str | None = None) -> list[dict]:
    """The job's Kubernetes objects, in the order to apply them. Raises InputError (exit 2) for
    what pods cannot run: ``train.code``, nodes of different shapes, names Kubernetes refuses."""
    if kind not in KINDS:
        raise InputError(f"unknown kind {kind!r}", field="--kind", hint=f"one of {', '.join(KINDS)}")
    target = KINDS[kind]
    refuse_what_pods_cannot_run(inv, target, namespace, pvc)
    return target.documents(inv, namespace, pvc, image or inv.image.name)


def refuse_what_pods_cannot_run(inv: Inventory, kind: Kind, namespace: str | None, pvc: str | None) -> None:
    if inv.train.code is not None:
        raise InputError("a synced code snapshot cannot be used on Kubernetes: pods mount no snapshot",
                         field="train.code", hint="bake the code into the image (docker/Dockerfile.project "
                                                  "builds on the trainer image), push it, and remove train.code")
    shapes = {(n.nprocs, len(n.devices)) for n in inv.nodes}
    if len(shapes) > 1:
        raise InputError("nodes differ in processes or GPUs, and every pod of a job has the same template",
                         field="nodes", hint="give every node the same procs and gpus (or gpu_ids) to export it")
    for name in kind.pod_vars:
        if name in inv.train.env or name in inv.train.secrets:
            raise InputError(f"{name} is set in each pod (the launcher's arguments use it)",
                             field=f"train.env.{name}", hint="name the variable otherwise")
    longest = kind.longest_suffix(inv.shape[0])
    _dns(inv.job.name, "job.name", _DNS_LABEL, 63 - len(longest),
         f"Kubernetes names its pods' DNS names after it (<job>{longest})")
    if namespace is not None:
        _dns(namespace, "--namespace", _DNS_LABEL, 63, "a Kubernetes namespace")
    if pvc is not None:
        _dns(pvc, "--pvc", _DNS_SUBDOMAIN, 253, "a PersistentVolumeClaim's name")


def _dns(value: str, field: str, pattern: re.Pattern, most: int, why: str) -> None:
    if not pattern.fullmatch(value) or len(value) > most:
        letter = "a letter" if pattern is _DNS_LABEL else "a letter or digit"
        raise InputError(f"{value!r} is not a name Kubernetes accepts: {why}", field=field,
                         hint=f"lower-case letters, digits and '-', starting with {letter}, at most {most} characters")


def pod_template(inv: Inventory, kind: Kind, pvc: str | None, image: str) -> dict:
    """One pod per node. terminationGracePeriodSeconds: a deleted job's pods get SIGTERM and the
    same time to write the checkpoint of a planned stop as ``ddp-deploy stop`` gives them."""
    volumes, mounts = storage(inv, pvc)
    spec = {**kind.pod_fields(inv), "restartPolicy": RESTART_POLICY, "terminationGracePeriodSeconds": STOP_GRACE_S}
    if pvc is not None:  # a claim's volume is made group-writable for the image's user (hostPath ignores it)
        spec["securityContext"] = {"fsGroup": IMAGE_GID}
    spec["containers"] = [container(inv, kind, image, mounts)]
    spec["volumes"] = volumes
    return {"metadata": {"labels": labels(inv)}, "spec": spec}


def container(inv: Inventory, kind: Kind, image: str, mounts: list[dict]) -> dict:
    out = {"name": kind.container, "image": image, "command": ["sh", "-c", literal(LAUNCH), "sh"],
           "args": launch_args(inv, kind), "env": environment(inv, kind),
           "ports": [{"name": kind.port_name, "containerPort": inv.rendezvous.port, "protocol": "TCP"}]}
    gpus = inv.shape[2]
    if gpus:
        out["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    out["volumeMounts"] = mounts
    return out


def launch_args(inv: Inventory, kind: Kind) -> list[str]:
    """LAUNCH's arguments: the node index, --rdzv-conf, then torchrun's other options as
    plan.torchrun_options renders them (the pod's address as --local-addr), the program's
    launcher options, ``--`` and its flags with the storage's container paths."""
    nodes, procs, _ = inv.shape
    s = inv.storage
    nnodes = f"{inv.job.min_nodes}:{nodes}" if inv.elastic else str(nodes)
    torchrun = ["--nnodes", nnodes, "--nproc-per-node", torchrun_procs(inv, procs), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", kind.endpoint(inv), "--rdzv-id", inv.rdzv_id,
                "--max-restarts", str(inv.job.max_restarts)]
    program = payload(inv).program_args(s.data.container, s.checkpoints.container, tool_flags(inv))
    rest = [*torchrun, *payload(inv).launcher_options(), "--", *program]
    return [kind.node_index, literal(rdzv_conf(inv)), "--local-addr", _ref(POD_IP), *map(literal, rest)]


def environment(inv: Inventory, kind: Kind) -> list[dict]:
    """plan.node_env's contract (the node's name is the pod's), gloo on the pod's interface unless
    train.env names one (NCCL picks its own: a pod with an RDMA network has more than eth0), then
    train.env, then the secrets as references to the job's Secret. nodes[].env is per host on a
    fleet and has no pod to go to: it is left out, and the header says so."""
    s = inv.storage
    out = [_field_env(POD_IP, "status.podIP"), *kind.index_env(), _field_env("DDP_NODE_NAME", "metadata.name"),
           *(_env(k, v) for k, v in contract_env(inv, s.data.container, s.checkpoints.container).items())]
    if "GLOO_SOCKET_IFNAME" not in inv.train.env:
        out.append(_env("GLOO_SOCKET_IFNAME", POD_INTERFACE))
    out += [_env(k, v) for k, v in inv.train.env.items()]
    out += [{"name": name, "valueFrom": {"secretKeyRef": {"name": secret_name(inv), "key": name}}}
            for name in inv.train.secrets]
    return out


def storage(inv: Inventory, pvc: str | None) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts): a claim's ``data/`` and ``checkpoints/``, else the storage's host paths
    (as the docker runtime's ``-v``, so they must be the shared volume on every node); and shared
    memory in RAM at /dev/shm, which DataLoader workers and NCCL use (docker runs with --ipc host)."""
    s = inv.storage
    if pvc is not None:
        volumes = [{"name": "shared", "persistentVolumeClaim": {"claimName": pvc}}]
        mounts = [{"name": "shared", "mountPath": s.data.container, "subPath": "data"},
                  {"name": "shared", "mountPath": s.checkpoints.container, "subPath": "checkpoints"}]
    else:
        volumes = [{"name": "data", "hostPath": {"path": s.data.host, "type": "Directory"}},
                   {"name": "checkpoints", "hostPath": {"path": s.checkpoints.host, "type": "Directory"}}]
        mounts = [{"name": "data", "mountPath": s.data.container},
                  {"name": "checkpoints", "mountPath": s.checkpoints.container}]
    volumes.append({"name": "shm", "emptyDir": {"medium": "Memory"}})
    mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    return volumes, mounts


def render(inv: Inventory, docs: list[dict]) -> str:
    """``docs`` as one multi-document YAML file, after a header saying what the cluster needs."""
    header = "".join(f"# {line}".rstrip() + "\n" for line in header_lines(inv, docs))
    return header + yaml.safe_dump_all(docs, sort_keys=False, width=1 << 16)


def _pod_spec(docs: list[dict]) -> dict:
    for doc in docs:
        if doc["kind"] == "Job":
            return doc["spec"]["template"]["spec"]
        if doc["kind"] == "PyTorchJob":
            return doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    raise ValueError("no pod template among the documents")


def header_lines(inv: Inventory, docs: list[dict]) -> list[str]:
    spec = _pod_spec(docs)
    box = spec["containers"][0]
    namespace = docs[0]["metadata"].get("namespace")
    gpus = box.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    pytorchjob = any(d["kind"] == "PyTorchJob" for d in docs)
    nodes, procs, _ = inv.shape
    lines = [f"ddp-deploy export k8s: job {inv.job.name}, {nodes} node(s) x {procs} process(es)"
             + (f", {gpus} GPU(s) each" if gpus else "")
             + (" (Kubeflow PyTorchJob)" if pytorchjob else " (Indexed Job and headless Service)"),
             "Apply with `kubectl apply -f FILE`. The cluster needs:",
             f"- the image {box['image']}, pullable by every node (push it to a registry the cluster reads; "
             "--image REF)"]
    lines += _secret_lines(inv, namespace)
    lines += _storage_lines(spec)
    if gpus:
        lines.append(f"- the NVIDIA device plugin: nvidia.com/gpu, {gpus} per pod")
    if pytorchjob:
        lines.append("- Kubeflow's training operator (PyTorchJob, kubeflow.org/v1)")
    lines.append(f"- pods that reach each other on any port (the rendezvous's {inv.rendezvous.port}; gloo and NCCL "
                 "open their own)")
    lines += [f"Not carried over: {what}" for what in not_carried(inv, box["image"])]
    lines.append(f"Stopping: deleting the job sends SIGTERM; the program writes a checkpoint within "
                 f"{STOP_GRACE_S} s and a new job resumes from it.")
    return lines


def _secret_lines(inv: Inventory, namespace: str | None) -> list[str]:
    """How to create the job's Secret from where hosts.yaml says each value is, never a value. A
    file's value is read as ``$(cat FILE)``, which drops its trailing newline as launch does."""
    if not inv.train.secrets:
        return []
    sources = []
    for name, secret in inv.train.secrets.items():
        where = source(inv, name) if secret.env is not None else f"$(cat {shlex.quote(source(inv, name))})"
        sources.append(f'--from-literal={name}="{where}"')
    ns = f" -n {namespace}" if namespace else ""
    return [f"- the Secret {secret_name(inv)} (train.secrets; its values are never in this file), created first:",
            f"    kubectl create secret generic {secret_name(inv)}{ns} {' '.join(sources)}"]


def _storage_lines(spec: dict) -> list[str]:
    claims = [v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if "persistentVolumeClaim" in v]
    if claims:
        return [f"- the PersistentVolumeClaim {claims[0]}, ReadWriteMany (every pod mounts it), holding data/ "
                f"and checkpoints/ writable by gid {IMAGE_GID}"]
    paths = " and ".join(v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v)
    return [f"- {paths} on every node a pod may run on: the same shared volume (NFS), writable by uid {IMAGE_GID}"]


def not_carried(inv: Inventory, image: str) -> list[str]:
    """What hosts.yaml says that pods cannot take: the host runtime's interpreter, and the per-host
    settings of an SSH fleet (a pod lands on any node, and gets its GPUs from the device plugin)."""
    out = []
    if inv.job.runtime == "host":
        out.append(f"job.runtime host (train.python): the pods run the image {image}")
    env = [f"{n.name}: {', '.join(n.env)}" for n in inv.nodes if n.env]
    if env:
        out.append(f"nodes[].env ({'; '.join(env)}), per host on the fleet; put what every pod needs in train.env")
    hosts = [n.name for n in inv.nodes if n.interface or n.gpu_ids]
    if hosts:
        out.append(f"nodes[].interface and gpu_ids ({', '.join(hosts)}): a pod uses {POD_INTERFACE} and the GPUs "
                   "the device plugin gives it")
    return out
