"""agent/torch_private.py, the one place that touches torch's private API: on each tested torch,
every part it uses is there in the shape it uses it, and nothing else in the package reaches past
torch's public names."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRIVATE = ("_popen", "_stdout", "_stderr", "_distributed_c10d", "_dump_fr_trace_json", "_dump_nccl_trace_json",
           "subprocess_handler", "dynamic_rendezvous", "c10d_rendezvous_backend", "torch._dynamo")


def test_every_private_part_of_torch_used_is_there_on_each_tested_torch(torch_python):
    got = subprocess.run([torch_python.python, "-m", "agent.torch_private"], cwd=REPO, capture_output=True,
                         text=True, timeout=180)
    assert got.returncode == 0, got.stderr[-3000:]
    said = json.loads(got.stdout.strip().splitlines()[-1])
    assert said == {"torch": torch_python.version, "missing": []}, said


def test_a_part_in_another_shape_is_named():
    from agent import torch_private

    class Handler:
        def _popen(self, argv, env):  # a torch that renamed the parameter
            pass

    missing = []
    original = torch_private._handler
    torch_private._handler = lambda: Handler
    try:
        missing = torch_private.missing()
    finally:
        torch_private._handler = original
    assert any(m.startswith("test_a_part_in_another_shape_is_named.<locals>.Handler._popen('self', 'argv', 'env')")
               for m in missing), missing


@pytest.mark.parametrize("package", ["trainer", "agent", "deploy"])
def test_no_other_module_names_a_private_part_of_torch(package):
    """Outside agent/torch_private.py, no code (docstrings and comments aside) names one."""
    found = []
    for path in sorted((REPO / package).rglob("*.py")):
        if path.name == "torch_private.py" or "__pycache__" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or "", *(a.name for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                names = [node.value]
            found += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names
                      if any(p == n or f".{p}" in n or n.startswith(f"{p}.") for p in PRIVATE)]
    assert found == [], found
