"""trainer.netcheck: the pair schedule, the slow-node judgment, the NCCL log parser, the report;
and three loopback "nodes" under the real launcher."""

import subprocess
import sys

import pytest

from deploy.job import plan
from trainer import netcheck
from trainer.netcheck import nccl_transport, pair_rounds, report, slow_nodes, unique_names
from trainer_helpers import trainer_env
from fakes import free_port

MB = 2**20


# --------------------------------------------------------------------------- schedule

@pytest.mark.parametrize("n", range(1, 10))
def test_every_node_meets_two_distinct_peers_in_rounds_of_disjoint_pairs(n):
    """Every node meets two distinct peers in rounds of disjoint pairs, never pairing twice."""
    rounds = pair_rounds(n)
    for pairs in rounds:
        nodes = [node for pair in pairs for node in pair]
        assert len(nodes) == len(set(nodes)), pairs
        assert all(0 <= a < b < n for a, b in pairs)
    every_pair = [pair for pairs in rounds for pair in pairs]
    assert len(every_pair) == len(set(every_pair))
    for node in range(n):
        peers = {b if a == node else a for a, b in every_pair if node in (a, b)}
        assert len(peers) >= min(2, n - 1), (node, rounds)


@pytest.mark.parametrize("n, expected", [(1, 0), (2, 1), (3, 3), (4, 2), (5, 3), (8, 2), (9, 3)])
def test_the_schedule_takes_the_fewest_rounds_possible(n, expected):
    """An odd number of nodes leaves one out of every round, so it needs a third round."""
    assert len(pair_rounds(n)) == expected


def test_the_schedule_is_the_same_on_every_rank():
    assert pair_rounds(6) == pair_rounds(6) == [[(0, 5), (1, 4), (2, 3)], [(0, 4), (3, 5), (1, 2)]]


# --------------------------------------------------------------------------- slow judgment

def test_a_node_below_half_the_median_is_slow():
    assert slow_nodes({"a": 100.0, "b": 95.0, "c": 40.0, "d": 110.0}) == ["c"]


def test_a_node_at_exactly_half_the_median_is_not_slow():
    assert slow_nodes({"a": 100.0, "b": 100.0, "c": 50.0}) == []


def test_nodes_within_the_same_range_are_not_slow():
    assert slow_nodes({"a": 100.0, "b": 70.0, "c": 60.0}) == []


@pytest.mark.parametrize("figures", [{"a": 100.0, "b": 1.0}, {"a": None}, {}])
def test_with_fewer_than_three_nodes_nobody_is_named_slow(figures):
    assert slow_nodes(figures) == []


# --------------------------------------------------------------------------- NCCL log

IB_LOG = """\
gpu-a:4242:4242 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>
gpu-a:4242:4242 [0] NCCL INFO NET/Plugin: No plugin found (libnccl-net.so), using internal implementation
gpu-a:4242:4290 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB eth0:10.0.0.1<0>
gpu-a:4242:4290 [0] NCCL INFO Using network IB
gpu-a:4242:4290 [0] NCCL INFO comm 0x55d1 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 1b000 commId 0x9f - Init START
"""

ROCE_LOG = """\
gpu-b:77:101 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/RoCE [1]mlx5_1:1/RoCE [RO]; OOB ens1f0:10.1.0.5<0>
gpu-b:77:101 [0] NCCL INFO Using network IB
"""

SOCKET_LOG = """\
cpu-c:9:9 [0] NCCL INFO NET/IB : No device found.
cpu-c:9:9 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.3<0> [1]eth1:10.0.1.3<0>
cpu-c:9:9 [0] NCCL INFO Using network Socket
"""


@pytest.mark.parametrize("log, expected", [
    (IB_LOG, "IB"),
    (ROCE_LOG, "RoCE"),
    (SOCKET_LOG, "sockets"),
    ("h:1:1 [0] NCCL INFO Using network AWS Libfabric\n", "AWS Libfabric"),
])
def test_the_network_nccl_chose_is_read_from_its_debug_lines(log, expected):
    assert nccl_transport(log.splitlines()) == expected


def test_the_device_lines_alone_still_tell_the_transport():
    """A log cut before NCCL's "Using network" line."""
    assert nccl_transport(IB_LOG.splitlines()[:3]) == "IB"
    assert nccl_transport(SOCKET_LOG.splitlines()[:2]) == "sockets"


def test_lines_that_do_not_name_a_network_give_none():
    assert nccl_transport(["h:1:1 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>", ""]) is None
    assert nccl_transport([]) is None


def test_nccl_debug_goes_to_a_private_file_even_where_the_job_sets_its_own(monkeypatch, tmp_path):
    monkeypatch.setenv("NCCL_DEBUG", "WARN")  # the job's own setting (hosts.example.yaml has one)
    for name in ("NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"):
        monkeypatch.delenv(name, raising=False)
    log_dir = netcheck.capture_nccl_log()
    try:
        assert netcheck.os.environ["NCCL_DEBUG"] == "INFO"
        assert netcheck.os.environ["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
        assert netcheck.os.environ["NCCL_DEBUG_FILE"] == f"{log_dir}/nccl.%h.%p"
        (log_dir / "nccl.gpu-b.77").write_text(ROCE_LOG)
        assert netcheck.transport("nccl", log_dir) == "RoCE"
    finally:
        netcheck.shutil.rmtree(log_dir)
    assert netcheck.transport("nccl", None) == "unknown"
    assert netcheck.transport("gloo", None) == "tcp"


# --------------------------------------------------------------------------- report

def _nodes(*names):
    return [{"node": name, "interface": "eth0", "transport": "tcp"} for name in names]


def test_a_node_figure_is_its_best_pair_and_the_slow_node_is_named():
    # n3 is slow: both of its pairs are slow, while n1-n2 is fast
    result = report(backend="gloo", device="cpu", size_bytes=100 * MB, iters=5,
                    nodes=_nodes("n1", "n2", "n3", "n4"), allreduce_s=2.0,
                    pair_s={(0, 3): 1.0, (1, 2): 10.0, (0, 2): 10.0, (1, 3): 1.0})
    figures = {node["node"]: node["busbw"] for node in result["nodes"]}
    assert figures == {"n1": 100 * MB, "n2": 100 * MB, "n3": 10 * MB, "n4": 100 * MB}
    assert result["nodes"][2]["pairs"] == {"n1": 10 * MB, "n2": 10 * MB}
    assert result["slow"] == ["n3"] and result["note"] is None
    assert result["allreduce_busbw"] == round(100 * MB / 2.0 * 2 * 3 / 4)  # busbw = algbw * 2(n-1)/n


def test_a_busy_host_s_stretched_iterations_move_a_link_s_figure_only_if_most_are():
    """Iterations stretched by a busy host do not move a link's figure, unless most are."""
    # five iterations of a 0.2 s link; a host busy elsewhere stretches some of them
    assert netcheck.typical_seconds([0.2, 0.2, 0.9, 0.2, 1.5]) == 0.2
    assert netcheck.typical_seconds([0.2, 0.9, 0.9, 0.2, 1.5]) == 0.9  # most are slow: the link is


def test_a_two_node_report_names_nobody_and_says_why():
    result = report(backend="gloo", device="cpu", size_bytes=MB, iters=1, nodes=_nodes("a", "b"),
                    allreduce_s=1.0, pair_s={(0, 1): 1.0})
    assert result["slow"] == [] and "two nodes" in result["note"]
    assert result["allreduce_busbw"] == MB  # 2(n-1)/n = 1 for two ranks


def test_a_one_node_report_has_no_figures():
    result = report(backend="nccl", device="cuda", size_bytes=MB, iters=1, nodes=_nodes("solo"),
                    allreduce_s=None, pair_s={})
    assert result["allreduce_busbw"] is None
    assert result["nodes"] == [{**_nodes("solo")[0], "busbw": None, "pairs": {}}]
    assert result["slow"] == [] and "one node" in result["note"]


def test_nodes_sharing_a_hostname_are_told_apart_by_their_index():
    assert unique_names(["gpu", "gpu", "b"]) == ["gpu#0", "gpu#1", "b"]


# --------------------------------------------------------------------------- command line

@pytest.mark.parametrize("argv, named", [
    (["--size-mb", "0"], "--size-mb"),
    (["--iters", "two"], "--iters"),
    (["--device", "tpu"], "--device"),
    (["--backend", "mpi"], "--backend"),
    (["--dist-timeout", "-5"], "--dist-timeout"),
])
def test_a_bad_flag_exits_2_with_one_line_naming_it(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        netcheck.parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("netcheck: error: ") and named in err


def test_outside_torchrun_it_refuses_and_says_how_to_start_it(monkeypatch, capsys):
    for name in ("WORLD_SIZE", "MASTER_ADDR", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert netcheck.main(["--backend", "gloo", "--device", "cpu"]) == 2
    assert "--entry trainer.netcheck" in capsys.readouterr().err


# --------------------------------------------------------------------------- three loopback nodes

def _node(port: int, name: str, nproc: int, is_host: int) -> subprocess.Popen:
    # is_host=0 on the others too: every node's endpoint is a local address here, and each
    # would otherwise try to host the rendezvous store.
    cmd = [sys.executable, "-m", "agent.launch", "--nnodes", "3", "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"netcheck-{port}",
           "--rdzv-conf", f"is_host={is_host}", "--local-addr", "127.0.0.1",
           "--entry", "trainer.netcheck", "--", "--size-mb", "1", "--iters", "2"]
    env = {**trainer_env(), "DDP_NODE_NAME": name, "GLOO_SOCKET_IFNAME": "lo"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.e2e
def test_three_nodes_report_each_nodes_bandwidth_interface_and_transport_in_one_line():
    port = free_port()
    nodes = [_node(port, "n1", 1, 1), _node(port, "n2", 2, 0), _node(port, "n3", 1, 0)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]
    # global rank 0 alone reports; torchrun echoes its line with the rank in front ("[rank0]: ")
    lines = [line for out, _ in outputs for line in out.splitlines() if "NETCHECK " in line]
    assert len(lines) == 1 and lines[0].startswith("[rank0]: NETCHECK "), outputs
    result = plan.json_line(lines[0], "NETCHECK ")
    assert set(result) == {"backend", "device", "size_bytes", "iters", "nodes_total", "allreduce_busbw",
                           "nodes", "slow", "note"}
    assert (result["backend"], result["device"], result["size_bytes"], result["iters"]) == ("gloo", "cpu", MB, 2)
    assert result["nodes_total"] == 3 and result["allreduce_busbw"] > 0
    assert sorted(node["node"] for node in result["nodes"]) == ["n1", "n2", "n3"]
    for node in result["nodes"]:
        assert set(node) == {"node", "interface", "transport", "busbw", "pairs"}
        assert (node["interface"], node["transport"]) == ("lo", "tcp")
        assert set(node["pairs"]) == {"n1", "n2", "n3"} - {node["node"]}
        assert all(figure > 0 for figure in node["pairs"].values())
        assert node["busbw"] == max(node["pairs"].values())
    assert isinstance(result["slow"], list) and result["note"] is None
