"""deploy/ is packages by concern whose imports flow one way: no import circles, each package
imports only those below it, and nothing imports the CLI.

Every import of a deploy module counts, at the top, inside a function or under TYPE_CHECKING:
each one ties the two modules together all the same. From the bottom: the base (errors, text,
the inventory, the node programs (programs/)), talking to nodes (nodes/), the job on a node (job/), the image
(images/) and observing (observe/), the checks (checks/), the engines (engines/: the SSH fleet's
procedures and API, Slurm's, Kubernetes export), and the CLI on top (cli/: the engine interface,
the rendering): the only package that imports click or rich.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
# Each layer imports only from its own and the layers before it.
LAYERS = (
    {"errors", "text", "inventory", "programs"},
    {"nodes"},
    {"job"},
    {"images", "observe"},
    {"checks"},
    {"engines"},
    {"cli", "__main__"},
)
BASE_MODULES = {"__init__", "__main__", "errors", "text"}


def _name(path: Path, root: Path = DEPLOY) -> str:
    """A module's dotted name inside deploy (``job.plan``; a package's __init__ is the package)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"


def _modules(root: Path = DEPLOY) -> set[str]:
    return {_name(p, root) for p in root.rglob("*.py") if "__pycache__" not in p.parts}


def _imports(path: Path, root: Path = DEPLOY) -> set[str]:
    """The deploy modules that the module at ``path`` imports (by their dotted names in deploy/)."""
    known = _modules(root)
    package = path.relative_to(root).parts[:-1]

    def resolve(base: tuple[str, ...], names: list[str]) -> set[str]:
        found = set()
        for name in names:
            dotted = ".".join((*base, name))
            found.add(dotted if dotted in known else ".".join(base) or "__init__")
        return found

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            base = (*base, *(node.module.split(".") if node.module else ()))
            found |= resolve(base, [a.name for a in node.names])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "deploy":
            found |= resolve(tuple(node.module.split(".")[1:]), [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            found |= {".".join(a.name.split(".")[1:]) for a in node.names if a.name.startswith("deploy.")}
    return {m for m in found if m in known}


def _graph(root: Path = DEPLOY) -> dict[str, set[str]]:
    return {_name(p, root): _imports(p, root) - {_name(p, root)}
            for p in root.rglob("*.py") if "__pycache__" not in p.parts}


def _layer(module: str) -> int:
    top = module.split(".")[0]
    (index,) = [i for i, layer in enumerate(LAYERS) if top in layer or module in layer]
    return index


def test_deploy_has_no_import_circle():
    try:
        graphlib.TopologicalSorter(_graph()).prepare()
    except graphlib.CycleError as e:
        raise AssertionError("an import circle in deploy/: " + " -> ".join(e.args[1])) from None


def test_each_package_imports_only_the_packages_below_it():
    upward = sorted(f"{m} imports {i}" for m, imported in _graph().items() if m != "__init__"
                    for i in imported if _layer(i) > _layer(m))
    assert upward == []


def test_no_module_imports_the_cli():
    assert [m for m, imported in _graph().items()
            if any(i.split(".")[0] == "cli" for i in imported) and m.split(".")[0] not in ("cli", "__main__")] == []


def test_nothing_outside_the_cli_package_imports_click_or_rich():
    """The engines and everything below them return data; only deploy/cli/ shows it."""
    found = []
    for p in DEPLOY.rglob("*.py"):
        if "__pycache__" in p.parts or p.relative_to(DEPLOY).parts[0] in ("cli", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [f"{_name(p)} imports {n}" for n in names if n.split(".")[0] in ("click", "rich")]
    assert found == []


def test_deploy_s_top_holds_the_base_modules_and_the_packages_only():
    assert {p.stem for p in DEPLOY.glob("*.py")} == BASE_MODULES
    packages = {p.name for p in DEPLOY.iterdir() if (p / "__init__.py").exists()}
    assert packages == set().union(*LAYERS) - BASE_MODULES


def test_the_circle_finder_sees_an_import_inside_a_function_and_across_packages(tmp_path):
    (tmp_path / "a.py").write_text("from .pkg import b\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from ..a import g\n")
    graph = _graph(tmp_path)
    assert graph["a"] == {"pkg.b"} and graph["pkg.b"] == {"a"}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError:
        return
    raise AssertionError("graphlib saw no circle")


REPO = DEPLOY.parent


def _absolute_imports(path: Path) -> set[str]:
    """Every module ``path`` imports by its absolute name, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def _sources(package: str) -> list[Path]:
    return [p for p in sorted((REPO / package).rglob("*.py")) if "__pycache__" not in p.parts]


def test_deploy_imports_nothing_of_the_job_s_side_but_the_contract():
    crossing = {str(p.relative_to(REPO)): sorted(m for m in _absolute_imports(p)
                                                 if m.split(".")[0] in ("agent", "trainer"))
                for p in _sources("deploy")}
    allowed = {"agent", "agent.contract"}  # ``from agent.contract import X`` also names agent.contract.X
    beyond = {f: [m for m in ms if m not in allowed and not m.startswith("agent.contract.")]
              for f, ms in crossing.items()}
    assert not {f: ms for f, ms in beyond.items() if ms}, beyond
    assert any(crossing.values()), "no module of deploy/ imports the contract: the scan sees nothing"


def test_the_contract_is_the_standard_library_alone_and_the_agent_imports_no_trainer():
    import sys

    contract = _absolute_imports(REPO / "agent" / "contract.py")
    assert {m.split(".")[0] for m in contract} <= set(sys.stdlib_module_names) | {"__future__"}, contract
    into_trainer = {str(p.relative_to(REPO)) for p in _sources("agent")
                    if any(m.split(".")[0] == "trainer" for m in _absolute_imports(p))}
    assert not into_trainer, f"the node agent runs user programs without the trainer: {into_trainer}"


def test_the_holds_program_spells_the_contract_s_variable():
    """agent/holds.py runs alone from its text on a node, so it spells DDP_HOLD itself."""
    from agent import contract, holds

    assert holds.ENV == contract.HOLD_ENV
    assert contract.program("holds") == Path(holds.__file__).read_text()


def test_no_module_of_the_tool_the_agent_or_the_trainer_is_over_600_lines():
    """A module past that holds two concerns: split it by concern instead."""
    long = {str(p.relative_to(REPO)): n for package in ("deploy", "agent", "trainer") for p in _sources(package)
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long
