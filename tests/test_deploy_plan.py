"""The per-node commands are data: assert on them for a 3-node inventory."""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess

import pytest

from deploy.job import plan
from deploy.inventory import loads
from deploy.nodes.remote import command_line
from deploy.job.runtime import STOP_GRACE_S, heartbeat_dir
from deploy.job.scripts import HOST_START
from fakes import install_command
from local_job import inventory
from agent.contract import module_argv

NODES = ({"name": "a", "address": "198.18.0.11", "gpus": 2, "interface": "eth0"},
         {"name": "b", "address": "198.18.0.12", "gpus": 2},
         {"name": "c", "address": "198.18.0.13", "gpus": 1})
CPU_NODES = tuple({k: v for k, v in n.items() if k != "gpus"} for n in NODES)
HOSTILE_ARGS = ["--dataset", "synthetic", "--config", "it's $(rm -rf /); `id` > x"]


def three_nodes(*, nodes=NODES, changed: dict | None = None, nas="/nas", job: dict | None = None,
                train: dict | None = None, **sections) -> dict:
    """The 3-node fleet these tests plan for, as data (tests/local_job.py): ``changed``, a node's
    fields changed (``{"c": {"gpus": 2}}``); ``job`` and ``train``, their fields added."""
    listed = [{**n, **(changed or {}).get(n["name"], {})} for n in nodes]
    return inventory(listed, job="demo", nas=nas, job_fields={"max_restarts": 2, **(job or {})},
                     rendezvous={"node": "b", "port": 29500, "join_timeout": 120},
                     train={"args": HOSTILE_ARGS, **(train or {})}, **sections)


THREE_NODES = json.dumps(three_nodes())


def contract(node, data="/data", ckpt="/ckpt", device="cuda", backend="nccl"):
    """The environment every program gets (docs/own-code.md)."""
    forked = ["DDP_PREFORK=1"] if device == "cpu" else []  # workers forked from a zygote: CPU jobs alone
    # the node's GPUs, held for the job by its launcher (agent/holds.py)
    gpus = ([0, 1] if node != "c" else [0]) if device == "cuda" else []
    held = [f'DDP_HOLD={{"job": "demo", "run": "RUN_ID", "gpus": {gpus}}}']
    return [f"DDP_NODE_NAME={node}", f"DDP_DATA_DIR={data}", f"DDP_CKPT_DIR={ckpt}", "DDP_RUN_ID=demo",
            f"DDP_DEVICE={device}", f"DDP_BACKEND={backend}", "DDP_STAGES=1", "DDP_LAUNCH_ID=RUN_ID", *forked, *held]


# the job by where it lives: its directory on the shared volume, hashed (docs/CONTRACTS.md)
DEMO_WHERE = hashlib.sha256(b"/nas/ckpt/.ddp-deploy/demo").hexdigest()[:12]


def beats(node, runtime="docker"):
    """Where the started job's ranks keep their heartbeats (the node's memory, this job's and node's
    alone), and how its launcher judges and acts on a stall (agent/heartbeat/, Watchdog)."""
    return [f"DDP_HEARTBEAT_DIR=/dev/shm/ddp-heartbeat-{runtime}-demo@{node}-{DEMO_WHERE}", "DDP_ON_STALL=report",
            "DDP_STALL_TIMEOUT=auto"]


def kept_log(node, ckpt="/ckpt"):
    """The variable that makes a container's launcher copy its output to the run's directory."""
    return f"DDP_DEPLOY_LOG_DIR={ckpt}/.ddp-deploy/demo/runs/RUN_ID/{node}"


def _docker(argv):
    """A docker node's start command after the step that makes the run's directory for it."""
    argv = list(argv)
    assert argv[:2] == ["sh", "-c"] and argv[4:7] == ["1000", "/nas/ckpt", ".ddp-deploy"]
    assert argv[7:9] == ["demo", "RUN_ID"] and argv[9] in "abc"
    return argv[10:]


def _inv(**changes):
    return loads(json.dumps(three_nodes(**changes)))


def _opt(argv, flag):
    return argv[argv.index(flag) + 1]


def test_rendezvous_is_host_only_on_the_endpoint_node():
    specs = plan.launch_plan(_inv())
    confs = {s.node: _opt(s.torchrun, "--rdzv-conf") for s in specs}
    assert confs == {"a": "join_timeout=120,read_timeout=60", "b": "is_host=1,join_timeout=120,read_timeout=60",
                     "c": "join_timeout=120,read_timeout=60"}
    assert {_opt(s.torchrun, "--rdzv-endpoint") for s in specs} == {"198.18.0.12:29500"}


def test_each_node_gets_its_own_local_addr_and_inventory_order_rank():
    specs = plan.launch_plan(_inv())
    assert [_opt(s.torchrun, "--local-addr") for s in specs] == ["198.18.0.11", "198.18.0.12", "198.18.0.13"]
    assert [_opt(s.torchrun, "--node-rank") for s in specs] == ["0", "1", "2"]
    assert all(_opt(s.torchrun, "--max-restarts") == "2" for s in specs)
    assert all(_opt(s.torchrun, "--rdzv-id") == f"demo-{plan.DRY_RUN}" for s in specs)


def test_each_run_meets_in_a_rendezvous_of_its_own():
    """A node left over from an earlier run (a lost node come back) reaches the same endpoint, but
    never the round of the run launched after it."""
    ids = {_opt(plan.launch_spec(_inv(), 0, run=run).torchrun, "--rdzv-id") for run in ("20261207-0600-aaaa", "20261207-0601-bbbb")}
    assert ids == {"demo-20261207-0600-aaaa", "demo-20261207-0601-bbbb"}


def test_nnodes_is_a_fixed_range_when_procs_differ_and_plain_when_equal():
    specs = plan.launch_plan(_inv())
    assert [_opt(s.torchrun, "--nproc-per-node") for s in specs] == ["2", "2", "1"]
    assert _opt(specs[0].torchrun, "--nnodes") == "3:3"
    same = plan.launch_plan(_inv(changed={"c": {"gpus": 2}}))
    assert _opt(same[0].torchrun, "--nnodes") == "3"


def test_docker_command_for_a_gpu_node():
    spec = plan.launch_plan(_inv())[0]
    argv = _docker(spec.argv)
    assert argv[:5] == ["docker", "run", "-d", "--name", f"demo-a-{DEMO_WHERE}"]
    assert _opt(argv, "--label") == "ddp.job=demo"
    assert _opt(argv, "--network") == "host" and _opt(argv, "--ipc") == "host"
    assert _opt(argv, "--cap-add") == "SYS_PTRACE"  # `doctor` reads its workers' stacks, and only this container's
    assert _opt(argv, "--gpus") == '"device=0,1"'  # which GPUs is explicit: the first `procs` by default
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "-v"] == ["/nas/data:/data", "/nas/ckpt:/ckpt"]
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "-e"] == [kept_log("a"), *contract("a"), "GLOO_SOCKET_IFNAME=eth0",
                                                                     "NCCL_SOCKET_IFNAME=eth0", *beats("a")]
    image_at = argv.index("ddp-trainer:latest")
    sep = argv.index("--")
    assert tuple(argv[image_at + 1:sep]) == spec.torchrun
    # a GPU job trains on CUDA with NCCL or refuses to start: never on the CPU
    assert argv[sep + 1:sep + 9] == ["--data-dir", "/data", "--ckpt-dir", "/ckpt", "--device", "cuda",
                                     "--backend", "nccl"]


def test_a_killed_container_is_started_again_as_often_as_torchrun_restarts_workers():
    argv = plan.launch_plan(_inv())[0].argv
    assert _opt(argv, "--restart") == "on-failure:2"
    never = plan.launch_plan(_inv(job={"max_restarts": 0}))[0].argv
    assert "--restart" not in never




def test_cpu_node_gets_no_gpus_flag_no_interface_env_and_gloo_on_the_cpu():
    argv = list(plan.launch_plan(_inv(nodes=CPU_NODES))[2].argv)
    assert "--gpus" not in argv and "--device" not in argv[:argv.index("ddp-trainer:latest")]
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "-e"] == [kept_log("c"), *contract("c", device="cpu",
                                                                                              backend="gloo"), *beats("c")]
    assert argv[argv.index("--", argv.index("ddp-trainer:latest")) + 5:][:4] == ["--device", "cpu", "--backend", "gloo"]


def test_gpu_ids_pick_the_gpus_of_a_node_in_docker_and_on_the_host():
    inv = _inv(changed={"a": {"gpus": 8, "gpu_ids": [4, 6]}})
    assert inv.node("a").nprocs == 2
    assert _opt(plan.launch_plan(inv)[0].argv, "--gpus") == '"device=4,6"'
    host = plan.launch_plan(_inv(changed={"a": {"gpus": 8, "gpu_ids": [4, 6]}},
                                    job={"runtime": "host"}))[0].argv
    assert "CUDA_VISIBLE_DEVICES=4,6" in host and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in host


def test_environment_from_train_and_node_reaches_the_processes_node_values_winning():
    inv = _inv(train={"env": {"NCCL_IB_HCA": "mlx5_0", "NCCL_DEBUG": "WARN"}},
               changed={"b": {"env": {"NCCL_IB_HCA": "mlx5_1", "NCCL_SOCKET_IFNAME": "ib0"}}})
    a, b = plan.launch_plan(inv)[:2]
    assert dict(a.env)["NCCL_IB_HCA"] == "mlx5_0" and dict(a.env)["NCCL_DEBUG"] == "WARN"
    assert dict(b.env)["NCCL_IB_HCA"] == "mlx5_1" and dict(b.env)["NCCL_SOCKET_IFNAME"] == "ib0"
    assert "-e" in b.argv and "NCCL_IB_HCA=mlx5_1" in b.argv


def test_infiniband_devices_reach_a_gpu_container_only_where_the_node_has_them():
    specs = plan.launch_plan(_inv(), {"a": plan.NodeFacts(infiniband=True)})
    a = list(specs[0].argv)
    assert _opt(a, "--device") == "/dev/infiniband" and "IPC_LOCK" in [a[i + 1] for i, x in enumerate(a) if x == "--cap-add"]
    assert _opt(a, "--ulimit") == "memlock=-1:-1"
    assert "/dev/infiniband" not in specs[1].argv
    cpu = plan.launch_plan(_inv(nodes=CPU_NODES), {"a": plan.NodeFacts(infiniband=True)})[0].argv
    assert "/dev/infiniband" not in cpu  # gloo does not use verbs


def test_network_check_runs_the_launcher_in_the_foreground_with_its_own_rendezvous():
    """network-check runs the job's launcher in the foreground, with its own rendezvous id."""
    inv = _inv()
    cmds = plan.netcheck_plan(inv, {}, ("--size-mb", "4"))
    a = list(cmds["a"])
    assert a[4] == f"demo-a-{DEMO_WHERE}-check" and a[5:8] == ["docker", "run", "--rm"]  # after removing a leftover of that name
    assert "-d" not in a and "--restart" not in a
    assert _opt(a, "--gpus") == '"device=0,1"'
    assert _opt(a, "--rdzv-id") == "demo-netcheck" and _opt(a, "--max-restarts") == "0"
    assert _opt(a, "--entry") == "trainer.netcheck"
    assert a[a.index("--", a.index("--entry")):] == ["--", "--device", "cuda", "--backend", "nccl", "--size-mb", "4"]
    host = list(plan.netcheck_plan(_inv(job={"runtime": "host"}), {}, ())["b"])
    assert host[4] == "/nas/ckpt/work/b" and host[5] == "env" and host[host.index("python3"):][:4] == ["python3", *module_argv("agent.launch")]


def test_the_probe_runs_with_the_job_s_torch_and_gpus():
    inv = _inv()
    a = plan.probe_argv(inv, inv.node("a"))
    assert a[:3] == ("docker", "run", "--rm") and _opt(a, "--entrypoint") == "python"
    assert _opt(a, "--gpus") == '"device=0,1"' and _opt(a, "--network") == "none"
    assert a[a.index("ddp-trainer:latest") + 1:] == (*module_argv("agent.probe"), "--gpus", "2", "--procs", "2",
                                                     "--import", "trainer.__main__")
    host = _inv(job={"runtime": "host"})
    c = plan.probe_argv(host, host.node("c"))
    assert "CUDA_VISIBLE_DEVICES=0" in c and c[-9:-2] == (*module_argv("agent.probe"), "--gpus", "1", "--procs", "1")


def test_host_runtime_runs_torchrun_with_host_paths_detached():
    inv = _inv(job={"runtime": "host"})
    spec = plan.launch_plan(inv)[0]
    argv = list(spec.argv)
    assert argv[:2] == ["sh", "-c"] and argv[2] == HOST_START
    assert argv[4:7] == ["/nas/ckpt/.ddp-deploy/demo/a", "/nas/ckpt/.ddp-deploy/demo/runs/RUN_ID/a",
                         str(inv.job.max_restarts)]  # its state, the run's directory, the supervisor's budget
    assert argv[7:9] == ["sh", "-c"] and argv[10:12] == ["sh", "/nas/ckpt/work/a"]  # the node's own directory
    cmd = argv[12:]
    assert cmd[:17] == ["env", "CUDA_DEVICE_ORDER=PCI_BUS_ID", "CUDA_VISIBLE_DEVICES=0,1",
                        *contract("a", "/nas/data", "/nas/ckpt"), "GLOO_SOCKET_IFNAME=eth0", "NCCL_SOCKET_IFNAME=eth0",
                        *beats("a", "host")]
    assert cmd[17:21] == ["python3", *module_argv("agent.launch")]
    t = cmd.index("--")
    assert tuple(cmd[21:t]) == spec.torchrun
    assert cmd[t + 1:t + 5] == ["--data-dir", "/nas/data", "--ckpt-dir", "/nas/ckpt"]
    assert spec.mounts == ()


def test_hostile_but_valid_trainer_args_survive_quoting_as_one_argument():
    spec = plan.launch_plan(_inv())[0]
    hostile = "it's $(rm -rf /); `id` > x"
    assert spec.argv[-1] == hostile
    line = command_line(spec.argv)
    assert shlex.split(line) == list(spec.argv)
    # A real shell hands it back unchanged, nothing executed.
    echoed = subprocess.run(["sh", "-c", f"printf '%s' {shlex.quote(hostile)}"], capture_output=True, text=True)
    assert echoed.stdout == hostile


def test_stop_status_logs_target_the_job_container():
    inv = _inv()
    a = inv.node("a")
    ours = f"demo-a-{DEMO_WHERE}"
    assert plan.stop_argv(inv, a)[4:6] == (ours, "0")
    assert plan.stop_argv(inv, a, STOP_GRACE_S)[4:6] == (ours, str(STOP_GRACE_S))
    assert plan.status_argv(inv, a)[4:] == (ours, f"/dev/shm/ddp-heartbeat-docker-demo@a-{DEMO_WHERE}",
                                            "/nas/ckpt/.ddp-deploy/demo", "a", "1000")
    logs = plan.logs_argv(inv, a, tail=5, follow=True)
    assert logs[4:] == ("docker", "logs", "--tail", "5", "--follow", ours)
    assert plan.diagnose_argv(inv, a)[:5] == ("docker", "exec", "-u", "0", ours)


def test_another_user_s_job_of_the_same_name_has_containers_of_its_own_names():
    """Two hosts.yaml calling their job ``demo`` on one Docker engine (two users', each with its
    own storage): neither's start, stop, status, logs or doctor names the other's container."""
    ours, theirs = _inv(), _inv(nas="/home/other/nas")
    a, their_a = ours.node("a"), theirs.node("a")
    mine = {plan.stop_argv(ours, a)[4], plan.status_argv(ours, a)[4], plan.logs_argv(ours, a, tail=5, follow=False)[-1],
            plan.diagnose_argv(ours, a)[4], _opt(_docker(plan.launch_plan(ours)[0].argv), "--name")}
    other = {plan.stop_argv(theirs, their_a)[4], plan.status_argv(theirs, their_a)[4],
             plan.logs_argv(theirs, their_a, tail=5, follow=False)[-1], plan.diagnose_argv(theirs, their_a)[4]}
    assert len(mine) == 1 and len(other) == 1 and mine != other, (mine, other)


@pytest.mark.parametrize("restarts", ["9" * 5000, "\u00b2", "\u0663", "-1", "1e9"])
def test_a_restarts_count_that_is_no_small_number_reads_as_none_without_failing(restarts):
    s = plan.parse_status(f"running\nrestarts {restarts}\n")
    assert (s.state, s.restarts) == ("running", 0)


def test_parse_status_reads_state_and_last_metrics_line():
    s = plan.parse_status('exited 1\nMETRICS {"step": 3}\n')
    assert (s.state, s.metrics, s.failed, s.exists) == ("exited(1)", 'METRICS {"step": 3}', True, True)
    assert plan.parse_status("absent\n").exists is False
    assert plan.parse_status("running\n").state == "running"


IP_ADDR = """1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever
1: lo    inet6 ::1/128 scope host \\       valid_lft forever preferred_lft forever
2: eth0@if7    inet 198.18.0.12/24 scope global eth0\\       valid_lft forever preferred_lft forever
3: ib0    inet6 fd00::12/64 scope global \\       valid_lft forever preferred_lft forever
"""


def test_the_interface_holding_the_node_address_is_found():
    assert plan.interface_holding("198.18.0.12", IP_ADDR) == "eth0"
    assert plan.interface_holding("fd00::12", IP_ADDR) == "ib0"
    assert plan.interface_holding("198.18.0.1", IP_ADDR) is None


def test_a_detected_interface_is_used_only_where_the_inventory_names_none():
    specs = plan.launch_plan(_inv(), {"a": plan.NodeFacts("eth7"), "b": plan.NodeFacts("eth8")})
    assert ("GLOO_SOCKET_IFNAME", "eth0") in specs[0].env  # the inventory's wins
    assert ("GLOO_SOCKET_IFNAME", "eth8") in specs[1].env and ("NCCL_SOCKET_IFNAME", "eth8") in specs[1].env
    assert [f"{k}={v}" for k, v in specs[2].env] == [*contract("c"), *beats("c")]  # no NIC known: left to gloo/NCCL


@pytest.mark.parametrize("said, absent", [(f"Error response from daemon: No such container: demo-a-{DEMO_WHERE}", True),
                                          ("Cannot connect to the Docker daemon at unix:///var/run/docker.sock", False)])
def test_docker_status_is_absent_for_a_missing_container_never_for_a_failing_engine(tmp_path, monkeypatch, said, absent):
    """Docker status is absent only for a missing container, never for a failing engine."""
    install_command(tmp_path, monkeypatch, "docker", f"#!/bin/sh\necho '{said}' >&2\nexit 1\n")
    inv = _inv()
    r = subprocess.run(list(plan.status_argv(inv, inv.node("a"))), capture_output=True, text=True)
    if absent:
        assert r.returncode == 0 and plan.parse_status(r.stdout).state == "absent"
    else:  # the CLI reads a failed status command as a node that did not answer (unreachable), not an end
        assert r.returncode != 0 and "Cannot connect" in r.stderr


def test_min_nodes_makes_the_job_elastic_from_min_to_every_node():
    inv = _inv(job={"min_nodes": 2})
    assert inv.elastic
    assert {_opt(s.torchrun, "--nnodes") for s in plan.launch_plan(inv)} == {"2:3"}
    # the round of fewer nodes ends before join_timeout (120): a third of it, at most 30 s
    assert {_opt(s.torchrun, "--rdzv-conf").split(",")[-1] for s in plan.launch_plan(inv)} == {"last_call_timeout=30"}
    every = _inv(job={"min_nodes": 3})
    assert not every.elastic and _opt(plan.launch_plan(every)[0].torchrun, "--nnodes") == "3:3"


def test_min_nodes_above_the_node_count_is_refused_naming_the_field():
    from deploy.errors import InventoryError

    with pytest.raises(InventoryError, match=r"job\.min_nodes.*4 is more than the 3 nodes"):
        _inv(job={"min_nodes": 4})


def test_without_the_rendezvous_node_the_first_remaining_node_hosts_it():
    inv = _inv().without(["b"])
    assert [n.name for n in inv.nodes] == ["a", "c"] and inv.rdzv_node.name == "a"
    specs = plan.launch_plan(inv)
    assert {_opt(s.torchrun, "--rdzv-endpoint") for s in specs} == {"198.18.0.11:29500"}
    assert _opt(specs[0].torchrun, "--rdzv-conf").startswith("is_host=1")
    assert [_opt(s.torchrun, "--nnodes") for s in specs] == ["2:2", "2:2"]  # a: 2 procs, c: 1
    assert _inv().without(["c"]).rdzv_node.name == "b"  # the endpoint stays where it was


def test_without_refuses_an_unknown_node_and_going_below_min_nodes():
    from deploy.errors import InventoryError

    with pytest.raises(InventoryError, match="z: not in nodes"):
        _inv().without(["z"])
    elastic = _inv(job={"min_nodes": 2})
    with pytest.raises(InventoryError, match=r"leaves 1 node\(s\), fewer than job.min_nodes \(2\)"):
        elastic.without(["a", "b"])


def test_the_cli_without_a_node_says_where_the_rendezvous_moved_and_plans_the_rest(ddp, tmp_path):
    """The CLI without a node says where the rendezvous moved, and plans only the others."""
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(THREE_NODES)
    r = ddp(hosts, "--without", "b", "launch", "--dry-run")
    assert r.exit_code == 0, r.output
    assert "note: without b: 2 nodes; the rendezvous moves from b to a (198.18.0.11:29500)" in r.stderr
    started = [line for line in r.stdout.splitlines() if line.startswith("[a] ") or line.startswith("[c] ")]
    assert started and not any(line.startswith("[b] ") for line in r.stdout.splitlines())
    assert all("198.18.0.11:29500" in line for line in started if "--rdzv-endpoint" in line)
    bad = ddp(hosts, "--without", "z", "status")
    assert bad.exit_code == 2 and "z: not in nodes[].name (a, b, c)" in bad.stderr


def test_an_elastic_job_without_a_node_keeps_room_for_it_to_join_later():
    elastic = _inv(job={"min_nodes": 2})
    smaller = elastic.without(["c"])
    assert [n.name for n in smaller.nodes] == ["a", "b"] and smaller.listed == 3 and smaller.elastic
    assert {_opt(s.torchrun, "--nnodes") for s in plan.launch_plan(smaller)} == {"2:3"}
    # a fixed-size job without a node is exactly the nodes left
    assert _opt(plan.launch_plan(_inv().without(["c"]))[0].torchrun, "--nnodes") == "2"


def test_the_launch_record_says_where_the_rendezvous_is_and_how_many_nodes_may_join():
    from deploy.job import record

    elastic = _inv(job={"min_nodes": 2}).without(["b"])
    kept = record.decode(record.encode(record.launch_record(elastic, None)).decode())
    assert kept["rendezvous"] == {"node": "a", "endpoint": "198.18.0.11:29500", "id": "demo"}
    assert kept["nnodes"] == "2:3" and [n["name"] for n in kept["nodes"]] == ["a", "c"]
    assert record.decode("not json") is None and record.decode("[1]") is None


def _cli(ddp, tmp_path, text, *args):
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(text)
    return ddp(hosts, *args)


def test_join_is_refused_for_a_fixed_size_job_and_an_unknown_node_before_connecting(ddp, tmp_path):
    fixed = _cli(ddp, tmp_path, THREE_NODES, "join", "c")
    assert fixed.exit_code == 2 and "job demo has a fixed size" in fixed.stderr and "ddp-deploy stop" in fixed.stderr
    elastic = json.dumps(three_nodes(job={"min_nodes": 2}))
    unknown = _cli(ddp, tmp_path, elastic, "join", "z")
    assert unknown.exit_code == 2 and "z: not in nodes[].name (a, b, c)" in unknown.stderr


def test_join_dry_run_prints_the_node_s_start_command_and_its_rendezvous_source(ddp, tmp_path):
    """join --dry-run prints the node's start command and where the rendezvous comes from."""
    elastic = json.dumps(three_nodes(job={"min_nodes": 2}))
    r = _cli(ddp, tmp_path, elastic, "join", "c", "--dry-run")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert all(line.startswith("[c] ") for line in lines)
    assert "launch record /nas/ckpt/.ddp-deploy/demo/launch.json" in lines[0]
    assert "--nnodes 2:3" in lines[-1] and "--rdzv-endpoint 198.18.0.12:29500" in lines[-1]


def test_a_launch_dry_run_says_which_nodes_may_take_the_probe_answer_they_kept(ddp, tmp_path):
    def kept(text: str) -> list[str]:
        hosts = tmp_path / "hosts.yaml"
        hosts.write_text(text)
        r = ddp(hosts, "launch", "--dry-run")
        assert r.exit_code == 0, r.output
        return [line for line in r.stdout.splitlines() if "probe's answer this node kept" in line]

    assert kept(THREE_NODES) == []  # GPU nodes: probed every time (their devices can change)
    cpu = json.dumps(three_nodes(nodes=CPU_NODES))
    assert kept(cpu) == [f"[{n}] the torch probe's answer this node kept for the same image and probe command "
                         "serves, if it has one (`ddp-deploy check` probes afresh and keeps it)" for n in "abc"]


def test_same_named_jobs_of_other_checkpoint_roots_never_share_a_heartbeat_directory():
    """Two jobs of one name from other checkpoint roots never share a heartbeat directory."""
    # the launcher empties its directory and its watchdog takes every process naming it for its own:
    # two hosts.yaml that both call their job demo, run on one machine, must not meet there
    one, other = loads(THREE_NODES), _inv(storage={"checkpoints": {"host": "/nas/other-ckpt", "container": "/ckpt"}})
    assert heartbeat_dir(one, one.node("a")) != heartbeat_dir(other, other.node("a"))
    assert heartbeat_dir(one, one.node("a")) == heartbeat_dir(loads(THREE_NODES), one.node("a"))  # launch after launch
    assert heartbeat_dir(one, one.node("a")) != heartbeat_dir(one, one.node("b"))


def test_cpu_workers_are_forked_from_a_zygote_unless_refused_and_gpu_ones_never():
    """A CPU job's workers are forked from a zygote unless train.env says 0, and a GPU job's never are."""
    cpu = plan.launch_plan(_inv(nodes=CPU_NODES))
    assert all(dict(s.env)["DDP_PREFORK"] == "1" for s in cpu)
    off = plan.launch_plan(_inv(nodes=CPU_NODES, train={"env": {"DDP_PREFORK": "0"}}))
    assert all(dict(s.env)["DDP_PREFORK"] == "0" for s in off)
    assert all("DDP_PREFORK" not in dict(s.env) for s in plan.launch_plan(_inv()))  # CUDA: not until tried on a GPU
