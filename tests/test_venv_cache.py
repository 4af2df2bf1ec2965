"""tools/venv.sh, the Makefile's venvs: a clone on a machine that already built a venv of the same
inputs gets a hard-linked copy of the kept one, pointed at its own path, with this package
installed editable from its own tree; the kept venv is left as it was; and a build's clean-up keeps
the two kept venvs last used and any that a clone is copying.

The copy is checked on the kept venv of the main venv's pins, which `make test` has just made or
found: where it is missing (``DDP_VENV_CACHE=`` builds the venvs afresh) the test is skipped, since
building one here would unpack torch again.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "venv.sh"


def _pins() -> list[str]:
    (line,) = re.findall(r"^TORCH_PINS \?= (.+)$", (ROOT / "Makefile").read_text(), re.M)
    return line.split()


def _first_line(path: Path) -> str:
    with open(path, "rb") as fh:
        return fh.readline().decode(errors="replace").strip()


@pytest.mark.budget(40)
def test_a_venv_copied_from_the_kept_one_runs_from_its_own_path_leaving_it_intact(tmp_path):
    """A venv copied from the kept one runs from its own path, and leaves the kept one as it was."""
    kept = Path(subprocess.run(["bash", str(SCRIPT), "--kept", *_pins()], capture_output=True, text=True,
                               check=True).stdout.strip())
    made_from = ROOT / ".venv" / ".kept"
    if made_from.exists() and made_from.read_text().strip() != str(kept):
        pytest.skip(f"the week turned since this clone's venv was made from {made_from.read_text().strip()}: "
                    f"the kept venv of this week is {kept}, and building it would unpack torch again")
    if not (kept / ".complete").exists():
        pytest.skip(f"no kept venv at {kept} (DDP_VENV_CACHE= builds the venvs afresh; `make install` keeps one)")
    kept_scripts = {p.name: _first_line(p) for p in (kept / "bin").iterdir() if p.is_file() and not p.is_symlink()}
    venv = tmp_path / "venv"

    made = subprocess.run(["bash", str(SCRIPT), str(venv), *_pins()], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]

    # its scripts and pyvenv.cfg name the copy, and nothing in bin/ names the kept venv
    assert _first_line(venv / "bin" / "pytest") == f"#!{venv}/bin/python3"
    assert _first_line(venv / "bin" / "ddp-deploy") == f"#!{venv}/bin/python3"
    for path in [*(venv / "bin").iterdir(), venv / "pyvenv.cfg"]:
        if path.is_file() and not path.is_symlink():
            assert str(kept).encode() not in path.read_bytes(), path
    # the package is this tree's, torch the kept one's (shared, not copied), the console scripts run
    ran = subprocess.run([str(venv / "bin" / "python"), "-c",
                          "import sys, deploy, torch; print(deploy.__file__); print(torch.__file__); print(sys.prefix)"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert ran[0] == str(ROOT / "deploy" / "__init__.py") and ran[2] == str(venv)
    torch_init = Path(ran[1])
    assert torch_init.is_relative_to(venv)
    assert os.stat(torch_init).st_ino == os.stat(kept / torch_init.relative_to(venv)).st_ino
    assert subprocess.run([str(venv / "bin" / "ddp-deploy"), "--help"], capture_output=True, text=True,
                          check=True).stdout.startswith("Usage: ddp-deploy")
    assert not (venv / ".complete").exists() and (venv / ".installed").exists()
    assert (venv / ".kept").read_text() == f"{kept}\n"  # which kept venv it was made from

    # the kept venv: its scripts still name it, and this package was never installed into it
    assert {p.name: _first_line(p) for p in (kept / "bin").iterdir()
            if p.is_file() and not p.is_symlink()} == kept_scripts
    assert not list((kept / "lib").glob("python3*/site-packages/*ddp_bundle*"))
    assert not (kept / "bin" / "ddp-deploy").exists()


def test_pruning_keeps_the_three_kept_venvs_last_used_and_any_being_copied(tmp_path):
    cache = tmp_path / "venvs"
    for age, name in enumerate(["newest", "second", "third", "fourth", "oldest"]):
        (cache / name / "bin").mkdir(parents=True)
        stamp = time.time() - 3600 * (age + 1)
        os.utime(cache / name, (stamp, stamp))
    with open(cache / "oldest.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)  # a clone taking its copy
        subprocess.run(["bash", str(SCRIPT), "--prune"], env={**os.environ, "DDP_VENV_CACHE": str(cache)},
                       check=True, timeout=60)
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == ["newest", "oldest", "second", "third"]
