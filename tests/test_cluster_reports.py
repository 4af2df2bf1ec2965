"""tests/cluster/conftest.py's excerpt of a node's kept log, as a failed cluster test's report shows
it (CI keeps nothing else of a run's nodes)."""

from __future__ import annotations

from cluster.conftest import NODE_LOG_HEAD, NODE_LOG_LINES, kept_log_excerpt


def test_a_failed_cluster_test_shows_a_node_s_first_end_last_lines_and_exits(tmp_path):
    """A failed cluster test shows a node's first end, its last lines and its exits, without C++ frames."""
    log = tmp_path / "log"
    first = ["launcher started", "RuntimeError: the first end", *(f"frame #{i}: libtorch_cpu.so" for i in range(40))]
    middle = [f"middle {i}" for i in range(500)]
    last = [f"last {i}" for i in range(NODE_LOG_LINES)]
    log.write_text("\n".join([*first, *middle, "Exception raised from x at y", *last]) + "\n")
    (tmp_path / "exits").write_text("1796301713 1\n1796302000 1\n")
    shown = kept_log_excerpt(log).splitlines()
    assert shown[0] == "exits (time, code): 1796301713 1 | 1796302000 1"
    assert shown[1:3] == first[:2]  # the head: the first end, before a restart's lines bury it
    assert not any(line.startswith(("frame #", "Exception raised from")) for line in shown)
    assert shown[-NODE_LOG_LINES:] == last
    assert shown[1 + NODE_LOG_HEAD] == f"[... {len(first[:2]) + len(middle) - NODE_LOG_HEAD} lines ...]"


def test_a_short_log_is_shown_whole_and_a_log_without_exit_records_says_none(tmp_path):
    log = tmp_path / "log"
    log.write_text("one\ntwo\n")
    assert kept_log_excerpt(log) == "one\ntwo"
    assert kept_log_excerpt(tmp_path / "missing").startswith("(not read: ")
