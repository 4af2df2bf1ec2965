"""What the job's environment offers, printed as one ``PROBE {json}`` line.

``ddp-deploy check`` runs it before anything starts, where the job will run: in the image on
docker nodes (with the job's ``--gpus``), with the configured interpreter on host nodes (with
the job's ``CUDA_VISIBLE_DEVICES``). The operator's side judges the answer (deploy/checks/preflight.py):
torch inside the supported range, on GPU nodes CUDA usable on every device a process will use,
and the job's program importing where it will run (``--import MODULE`` or ``--script PATH``), so
that a typo'd module name is a refusal in seconds, not a crash loop under torchrun's restarts.
Only the standard library is imported before torch, so that a broken torch is reported rather
than crashing the probe.

    python -m agent.probe --gpus 2 --procs 2 --import pkg.train
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import importlib.util
import io
import json
import os
import platform
import re
import sys
import time
import traceback
import warnings

from . import exits  # the standard library alone
from .contract import PROBE_KEPT_PREFIX as KEPT_PREFIX, PROBE_PREFIX as PREFIX

INFINIBAND = "/dev/infiniband"
KEEP_DAYS = 7
"""Kept answers older than this are removed (by the next probe that keeps one)."""


def probe(gpus: int, procs: int) -> dict:
    report: dict = {"python": platform.python_version(), "torch": None, "cuda_build": None,
                    "cuda_available": None, "devices": 0, "device_names": [], "nccl": None,
                    "cuda_error": None, "infiniband": sorted(os.listdir(INFINIBAND)) if os.path.isdir(INFINIBAND) else [],
                    "error": None}
    try:
        import torch
    except Exception as exc:  # a broken install is the answer, not a crash
        report["error"] = f"cannot import torch: {type(exc).__name__}: {exc}"
        return report
    report["torch"] = torch.__version__
    report["cuda_build"] = torch.version.cuda
    if gpus == 0:
        return report
    report.update(_cuda(torch, max(gpus, procs)))
    return report


def _cuda(torch, used: int) -> dict:
    """CUDA as the job would meet it: available, enough devices, and a kernel runs on each of the
    ``used`` ones its processes will use, a split model's stages included (a driver too old for
    the image's CUDA fails here, not in the job)."""
    out: dict = {"cuda_available": False}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    if not available:
        said = [str(w.message).strip() for w in caught]
        out["cuda_error"] = said[0] if said else "no CUDA device visible"
        return out
    try:
        out["devices"] = torch.cuda.device_count()
        out["device_names"] = [torch.cuda.get_device_name(i) for i in range(out["devices"])]
        # what the build has code for, and what each device is: read before any kernel runs, so
        # that a build with no code for the device says why its first kernel fails
        out["arch_list"] = list(torch.cuda.get_arch_list())
        out["capabilities"] = ["%d.%d" % torch.cuda.get_device_capability(i) for i in range(out["devices"])]
        for i in range(min(used, out["devices"])):
            torch.ones(1, device=f"cuda:{i}").add_(1).item()
        if torch.distributed.is_available() and torch.distributed.is_nccl_available():
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:  # any CUDA failure is the answer, reported on its first line
        out["cuda_error"] = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return out
    out["cuda_available"] = True
    return out


def program(module: str | None, script: str | None) -> dict:
    """Whether the program is there and its imports resolve, as torchrun would run it (from the
    working directory): ``{"program": NAME, "program_error": None or the error's last line}``.

    The program itself is not executed (a script without a ``__main__`` guard would train here):
    its source is compiled, and each module its top-level statements import must be found.
    Imports inside ``try`` blocks (optional dependencies) and functions are not required.
    """
    name = module or script
    out = {"program": name, "program_error": None}
    if name is None:
        return out
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the PROBE line stays the only line we print
            path, package = _locate(module, script)
            _check_imports(path, package)
    except SyntaxError as exc:
        out["program_error"] = f"SyntaxError: {exc.msg} ({exc.filename}, line {exc.lineno})"
    except BaseException as exc:  # SystemExit from a package's __init__ included
        lines = traceback.format_exception_only(type(exc), exc)
        out["program_error"] = lines[-1].strip() if lines else type(exc).__name__
    return out


def _locate(module: str | None, script: str | None) -> tuple[str, str | None]:
    """(source file, package for relative imports)."""
    if script is not None:
        if not os.path.isfile(script):
            raise FileNotFoundError(f"no file {script} in {os.getcwd()}")
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        return script, None
    sys.path.insert(0, os.getcwd())
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise ModuleNotFoundError(f"No module named {module!r}")
    if spec.submodule_search_locations is not None:  # a package: python -m runs its __main__
        spec = importlib.util.find_spec(module + ".__main__")
        if spec is None:
            raise ModuleNotFoundError(f"No module named '{module}.__main__'; '{module}' is a package "
                                      "and cannot be directly executed")
    if not spec.origin or not os.path.isfile(spec.origin):
        return "", None  # built in or compiled: found is all that can be said
    return spec.origin, spec.name.rpartition(".")[0] or None


def _check_imports(path: str, package: str | None) -> None:
    if not path:
        return
    with open(path, "rb") as f:
        tree = compile(f.read(), path, "exec", flags=ast.PyCF_ONLY_AST, dont_inherit=True)
    for node in _top_level(tree.body):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names = [importlib.util.resolve_name(base, package) if node.level else base]
        else:
            continue
        for name in names:
            if name != "__future__" and importlib.util.find_spec(name) is None:
                raise ModuleNotFoundError(f"No module named {name!r} (imported by {path}, line {node.lineno})")


def _top_level(body):
    """Statements that run on import: the body, and both branches of top-level ``if`` (not ``try``)."""
    for node in body:
        if isinstance(node, ast.If):
            if not _is_main_guard(node):
                yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        else:
            yield node


def _is_main_guard(node) -> bool:
    return "__main__" in ast.dump(node.test)


def installation() -> str:
    """What a CPU node's answer depends on beyond the probe's command line: the interpreter, and
    every place on ``sys.path`` (where torch and the program's imports are found), each by its
    inode, size and modification time, and torch's own package files. Installing, removing or
    upgrading a package changes its directory's; a new interpreter at the same path, its file's.
    Standard library only: torch is not imported."""
    h = hashlib.sha256()

    def add(path: str) -> None:
        try:
            st = os.stat(path)
            h.update(f"{path}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\n".encode(errors="replace"))
        except OSError:
            h.update(f"{path}\0-\n".encode(errors="replace"))

    add(os.path.realpath(sys.executable))
    for entry in sys.path:
        add(os.path.abspath(entry or "."))
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        package = os.path.dirname(spec.origin)
        for name in ("", "__init__.py", "version.py", "lib"):
            add(os.path.join(package, name))
    return h.hexdigest()[:32]


def _kept_path(key: str) -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ddp-deploy", "probe", f"{key}-{installation()}")


def _keep(path: str, line: str) -> None:
    """A good answer kept at ``path``; answers older than KEEP_DAYS removed. Never fails the probe."""
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        old = time.time() - KEEP_DAYS * 86400
        for name in os.listdir(folder):
            with contextlib.suppress(OSError):
                if os.stat(os.path.join(folder, name)).st_mtime < old:
                    os.unlink(os.path.join(folder, name))
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(line + "\n")
        os.replace(tmp, path)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=0, help="GPUs this node's processes use (0: a CPU node)")
    parser.add_argument("--procs", type=int, default=1, help="processes this node runs")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--import", dest="module", help="the job's module (python -m MODULE): it must import")
    which.add_argument("--script", help="the job's script: it must exist and import")
    parser.add_argument("--kept", nargs=2, metavar=("MODE", "KEY"),
                        help="on a CPU node (--gpus 0): keep a good answer (torch imported, the program's imports "
                             "found) under KEY, the operator's hash of this command, and this installation "
                             "(installation()); MODE reuse also prints one kept before instead of probing, after a "
                             f"line {KEPT_PREFIX} <when>; keep always probes")
    args = parser.parse_args(argv)
    kept = None
    if args.kept and args.gpus == 0:
        mode, key = args.kept
        if mode not in ("reuse", "keep"):
            parser.error(f"--kept: MODE is reuse or keep, not {mode!r}")
        if not re.fullmatch(r"[0-9a-f]{8,64}", key):
            parser.error(f"--kept: not a key (hex digits): {key!r}")
        kept = _kept_path(key)  # before the program's directory goes first on sys.path
        if mode == "reuse":
            with contextlib.suppress(OSError, UnicodeDecodeError):
                with open(kept) as f:
                    line = f.read().strip()
                if line.startswith(PREFIX + "{"):
                    print(f"{KEPT_PREFIX} {int(os.stat(kept).st_mtime)}\n{line}", flush=True)
                    return 0
    report = probe(args.gpus, args.procs)
    report.update(program(args.module, args.script))
    line = PREFIX + json.dumps(report)
    print(line, flush=True)
    if kept is not None and report["error"] is None and report["program_error"] is None:
        _keep(kept, line)
    return 0


if __name__ == "__main__":
    exits.main(main)  # sys.exit(main()), without the interpreter's teardown of torch
