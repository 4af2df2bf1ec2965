"""The trainer and the node agent run in their image: they import nothing the image does not install.

The image is the base (python, torch, torchvision) plus docker/requirements.txt. A module the
deploy tool has on the operator's machine (packaging, pydantic, ...) is not there, and a trainer
importing one fails on every node at start, which only the slow image tests would otherwise see.
"""

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE_PROVIDES = {"torch", "torchvision"}
IMPORT_NAME = {"pyyaml": "yaml"}  # distribution -> the module it installs, where they differ


def image_modules() -> set[str]:
    names = set()
    for line in (ROOT / "docker" / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            dist = re.match(r"[A-Za-z0-9_.-]+", line).group(0).lower()
            names.add(IMPORT_NAME.get(dist, dist.replace("-", "_")))
    return names | BASE_PROVIDES


def trainer_imports() -> dict[str, set[str]]:
    """Top-level module -> the trainer files importing it (function-level imports included). A module
    beside the file importing it is the trainer's own (agent/progress_hook runs from a directory on
    the workers' PYTHONPATH): not counted."""
    found: dict[str, set[str]] = {}
    for path in sorted(p for part in ("trainer", "agent") for p in (ROOT / part).rglob("*.py")):
        beside = {p.stem for p in path.parent.glob("*.py")}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            for mod in mods:
                if mod.split(".")[0] in beside:
                    continue
                found.setdefault(mod.split(".")[0], set()).add(path.name)
    return found


def test_the_trainer_imports_only_the_standard_library_and_what_its_image_installs():
    allowed = set(sys.stdlib_module_names) | image_modules() | {"trainer", "agent", "__future__"}
    foreign = {mod: sorted(files) for mod, files in trainer_imports().items() if mod not in allowed}
    assert not foreign, f"not in the image (docker/requirements.txt or the base): {foreign}"


def test_the_import_scan_sees_function_level_imports():
    # binds_stores imports torch inside the function; the scan must see such imports too.
    assert "compat.py" in trainer_imports()["torch"]


def test_the_import_scan_takes_a_module_beside_its_importer_for_the_trainers_own():
    assert "ddp_deploy_progress" not in trainer_imports()
    assert "sitecustomize.py" in {f for files in trainer_imports().values() for f in files}
