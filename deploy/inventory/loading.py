"""Reading hosts.yaml: bounded in size, depth and values before pydantic sees it, and every
problem mapped to its file, field path and YAML line (:class:`~deploy.errors.InventoryError`)."""

from __future__ import annotations

import threading
from pathlib import Path

import yaml
from pydantic import ValidationError

from ..errors import InventoryError, Issue
from .fields import MAX_NUMBER
from .rules import CrossFieldProblems
from .schema import Inventory, Model


MAX_BYTES = 1 << 20
"""An inventory is a few kB; a larger file is the wrong file, refused before it is parsed."""
MAX_VALUES = 100_000
"""Values after YAML aliases are expanded ("billion laughs" files expand to billions)."""
MAX_DEPTH = 50


def load(path: str | Path) -> Inventory:
    path = Path(path)
    label = str(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise InventoryError([Issue(label, "", None, f"cannot read the file: {e.strerror or e}")]) from e
    if len(data) > MAX_BYTES:
        raise _too_large(label)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise InventoryError([Issue(label, "", line, f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}): "
                                                     "is this the right file?")]) from None
    return loads(text, label=label, base_dir=path.resolve().parent)


def loads(text: str, *, label: str = "hosts.yaml", base_dir: Path | None = None) -> Inventory:
    if len(text) > MAX_BYTES:
        raise _too_large(label)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is not None:
            _bounded(root, label)
        data = yaml.safe_load(text)
    except yaml.constructor.ConstructorError as e:
        mark = e.problem_mark
        raise InventoryError([Issue(label, "", mark.line + 1 if mark else None,
                                    f"{e.problem}: hosts.yaml holds plain data (no language-specific tags)")]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else None
        problem = getattr(e, "problem", None) or str(e)
        raise InventoryError([Issue(label, "", line, f"YAML syntax error: {problem}")]) from e
    except RecursionError:
        raise InventoryError([Issue(label, "", None, f"nested more than {MAX_DEPTH} levels deep")]) from None
    lines: dict[tuple, int] = {}
    dupes: list[Issue] = []
    if root is not None:
        _index_lines(root, (), lines, dupes, label)
    if dupes:
        raise InventoryError(dupes)
    if not isinstance(data, dict):
        raise InventoryError([Issue(label, "", 1, "expected a mapping with job, rendezvous, nodes, storage, ...")])
    _build_models()
    try:
        inv = Inventory.model_validate(data)
    except ValidationError as e:
        raise InventoryError([_issue(label, tuple(err["loc"]), _message(err), lines) for err in e.errors()]) from e
    except CrossFieldProblems as e:
        raise InventoryError([_issue(label, loc, msg, lines) for loc, msg in e.problems]) from e
    inv._base_dir = base_dir or Path.cwd()
    return inv


_BUILDING = threading.Lock()


def _build_models() -> None:
    """Builds every model's validator and serializer that is not built yet, in the order they are
    defined (a model's parts before it), as importing this module did before defer_build: all at
    once, here, rather than each at its first use, which may come in several threads at once
    (``ssh_for`` in the fan-out's): pydantic releases before 2.14 build a model unsafely there
    (two threads building one model can each see it half-built)."""
    with _BUILDING:
        for model in Model.__subclasses__():
            if not model.__pydantic_complete__:
                model.model_rebuild()


def _too_large(label: str) -> InventoryError:
    return InventoryError([Issue(label, "", None, f"larger than {MAX_BYTES // 1024} KiB: an inventory is a few kB "
                                                  "(is this the right file?)")])


_INT_TAG = "tag:yaml.org,2002:int"


def _bounded(root: yaml.Node, label: str) -> None:
    """Refuses a document nested too deeply, whose aliases expand to too many values or that holds
    an integer too long to read, before anything walks it expanded (counted once per distinct node:
    cheap whatever the expansion)."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node, depth: int, loc: tuple = ()) -> int:
        if depth > MAX_DEPTH:
            raise InventoryError([Issue(label, "", node.start_mark.line + 1, f"nested more than {MAX_DEPTH} levels deep")])
        if id(node) in sizes:
            return sizes[id(node)]
        if isinstance(node, yaml.MappingNode):
            n = 1 + sum(size(k, depth + 1, loc) + size(v, depth + 1, loc + (k.value,)) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            n = 1 + sum(size(v, depth + 1, loc + (i,)) for i, v in enumerate(node.value))
        else:
            n = 1
            if node.tag == _INT_TAG and len(node.value) > MAX_NUMBER:
                raise InventoryError([Issue(label, field_path(loc), node.start_mark.line + 1,
                                            f"a number of {len(node.value)} characters, more than the {MAX_NUMBER} "
                                            "any number may have (quote it if it is text)")])
        sizes[id(node)] = n
        if n > MAX_VALUES:
            raise InventoryError([Issue(label, "", node.start_mark.line + 1,
                                        f"YAML aliases expand to more than {MAX_VALUES} values (a \"billion laughs\" "
                                        "file?); an inventory has a few hundred")])
        return n

    size(root, 0)


def field_path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _issue(label: str, loc: tuple, message: str, lines: dict[tuple, int]) -> Issue:
    # Pydantic adds validator tags (e.g. 'function-after[...]') to some locs; drop them.
    loc = tuple(p for p in loc if isinstance(p, int) or "[" not in str(p))
    line = None
    for k in range(len(loc), -1, -1):
        if loc[:k] in lines:
            line = lines[loc[:k]]
            break
    return Issue(label, field_path(loc), line, message)


def _message(err: dict) -> str:
    kind = err["type"]
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        return "unknown key (check the spelling; see the comments in hosts.yaml)"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if "input" in err and kind not in ("missing",) and not isinstance(err["input"], (dict, list)):
        msg += f", got {_shown(err['input'])}"
    return msg


SHOWN = 40
"""Characters of a refused value shown in its error: the line names the field and the limit."""


def _shown(value) -> str:
    """``value`` as the file had it, cut to SHOWN characters with its length where longer."""
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[:SHOWN - 1]}… ({len(text)} characters)"


def _index_lines(node: yaml.Node, loc: tuple, lines: dict, dupes: list, label: str) -> None:
    lines[loc] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: set = set()
        for key, value in node.value:
            k = key.value
            if k in seen:
                dupes.append(Issue(label, field_path(loc + (k,)), key.start_mark.line + 1,
                                   "key appears twice in the same mapping"))
            seen.add(k)
            lines[loc + (k,)] = key.start_mark.line + 1
            _index_lines(value, loc + (k,), lines, dupes, label)
            lines[loc + (k,)] = key.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _index_lines(item, loc + (i,), lines, dupes, label)
