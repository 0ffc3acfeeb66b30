"""The package's shape, kept so: imports point one way, no circles, small modules.

Layers, lowest first (a module may import only from its own layer or below; within a layer, no circle):

    base        errors, dtypes, connections
    memory      memory/*
    wire        protocol (frames, handshake, versions), manifest (layout)
    regions     region, staging, checksum, synthetic, quant (FP8 layouts, the quantizer), and the model files
    transport   transport/*
    session     session/*
    fanout      fanout/*
    live/sync   live, sync/*
    cli         cli/*, the package's __init__

Every import counts for the layers: module level, inside functions (a lazy import is still an edge), and
under ``TYPE_CHECKING`` (a type-only upward reference is how circles start).  Circles are looked for among
the imports that run (a type-only reference may point sideways within a layer: it imports nothing).
``sync/spec`` and ``sync/plan`` are the planner: they import neither session nor transport.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tensorxfer"
MAX_LINES = 700
EXEMPT_FROM_LINES = {"tensorxfer.transport._verbs"}     # the verbs data plane: one nogil module by design

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("tensorxfer.errors", "tensorxfer.dtypes", "tensorxfer.connections")),
    ("memory", ("tensorxfer.memory", "tensorxfer._lib")),
    ("wire", ("tensorxfer.protocol", "tensorxfer.manifest")),
    ("regions", ("tensorxfer.region", "tensorxfer.sources", "tensorxfer.binding", "tensorxfer.staging",
                 "tensorxfer.checksum", "tensorxfer.synthetic", "tensorxfer.quant",
                 "tensorxfer.safetensors_io", "tensorxfer.files")),
    ("transport", ("tensorxfer.transport",)),
    ("session", ("tensorxfer.session",)),
    ("fanout", ("tensorxfer.fanout",)),
    ("live/sync", ("tensorxfer.live", "tensorxfer.sync")),
    ("cli", ("tensorxfer.cli", "tensorxfer")),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix in (".py", ".pyx") and "build" not in path.parts:
            out[module_name(path)] = path
    return out


def layer_of(name: str) -> int:
    best = (-1, -1)     # (prefix length, layer index): the longest matching prefix decides
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best[0]:
                best = (len(prefix), index)
    assert best[1] >= 0, f"{name} belongs to no layer: place it in LAYERS (tests/test_architecture.py)"
    return best[1]


_PYX_IMPORT = re.compile(r"^\s*(?:from\s+(tensorxfer[\w.]*)\s+c?import\s+([\w, ()]+)|c?import\s+(tensorxfer[\w.]*))",
                         re.M)


def _type_only_lines(tree: ast.AST) -> set[int]:
    """Line numbers of the statements under ``if TYPE_CHECKING:`` blocks."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (
                (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
                or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")):
            for stmt in node.body:
                lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines


def imports_of(name: str, path: Path, known: set[str], runtime_only: bool = False) -> set[str]:
    """The tensorxfer modules ``name`` imports (``from pkg import mod`` resolves to the module); with
    ``runtime_only``, not those imported for type checking alone."""
    found: set[str] = set()

    def add(target: str, names: list[str]) -> None:
        for n in names:
            if f"{target}.{n}" in known:
                found.add(f"{target}.{n}")
                continue
            if target in known:
                found.add(target)

    text = path.read_text()
    if path.suffix == ".pyx":
        for m in _PYX_IMPORT.finditer(text):
            if m.group(1):
                add(m.group(1), [n.strip(" ()") for n in m.group(2).split(",")])
            elif m.group(3) in known:
                found.add(m.group(3))
        return found - {name}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(text)
    skip = _type_only_lines(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("tensorxfer") and alias.name in known:
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            if base.startswith("tensorxfer"):
                add(base, [a.name for a in node.names])
    return found - {name}


def graph(runtime_only: bool = False) -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known, runtime_only) for name, path in mods.items()}


def test_every_import_points_down_the_layers() -> None:
    upward = []
    for name, targets in graph().items():
        for target in targets:
            if layer_of(target) > layer_of(name):
                upward.append(f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} "
                              f"({LAYERS[layer_of(target)][0]})")
    assert not upward, "imports that point up the layers:\n" + "\n".join(sorted(upward))


def test_no_import_circles() -> None:
    g = graph(runtime_only=True)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:      # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_planner_is_pure() -> None:
    g = graph()
    for name in ("tensorxfer.sync.spec", "tensorxfer.sync.plan"):
        if name not in g:
            pytest.skip(f"{name} does not exist yet")
        bad = {t for t in g[name] if t.startswith(("tensorxfer.session", "tensorxfer.transport", "tensorxfer.fanout"))}
        assert not bad, f"{name} must stay free of I/O layers, imports {bad}"


def test_no_module_is_over_700_lines() -> None:
    long = {name: n for name, path in modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES and name not in EXEMPT_FROM_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by what they do): {long}"


@pytest.mark.parametrize("module, cls", [("tensorxfer.session.receiver", "Receiver"),
                                         ("tensorxfer.session.server", "ServerSession")])
def test_the_receiver_and_the_server_session_stay_small(module: str, cls: str) -> None:
    path = modules()[module]
    node = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == cls)
    lines = (node.end_lineno or node.lineno) - node.lineno + 1
    assert lines < 300, f"{module}.{cls} is {lines} lines: give what does another job its own object"


def test_the_layer_check_catches_an_upward_edge() -> None:
    # The check itself must be able to fail: a transport importing the session is refused.
    known = {"tensorxfer.session", "tensorxfer.transport.tcp"}
    fake = ROOT / "build" / "fake_tcp.py"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text("from tensorxfer.session import Sender\n")
    try:
        targets = imports_of("tensorxfer.transport.tcp", fake, known)
    finally:
        fake.unlink()
    assert targets == {"tensorxfer.session"}
    assert layer_of("tensorxfer.session") > layer_of("tensorxfer.transport.tcp")
