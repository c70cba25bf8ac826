"""CPU: the import graph of ``ops/``, read from the sources (``ast``, imports inside functions
included): no cycle, each attention backend a leaf that imports no other backend (the
dispatcher, ``ops.attention``, chooses between them), and no module reaching for another
module's private (``_x``) names, the package's own underscore infrastructure modules aside."""

import ast
import pathlib

import pytest

OPS = pathlib.Path(__file__).resolve().parents[1] / "ops"
BACKENDS = {"attention_fwd_sm90", "attention_sm90", "mem_eff_attention"}
# private to the package as a whole: any module of it may use their names
INFRASTRUCTURE = {"_compile", "_validate", "_memo", "_disk_cache"}
PACKAGE = "__init__"


def _modules() -> dict:
    return {p.stem: ast.parse(p.read_text(), filename=str(p)) for p in sorted(OPS.glob("*.py"))}


def _target(module, level: int, names=()) -> list:
    """The ops modules an import names: ``from . import a, b`` names a and b, ``from .a import
    x`` names a, ``from ops.a import x`` / ``import ops.a`` name a; the package itself is
    ``__init__``. None for anything outside ``ops``."""
    if level == 0:
        if module != "ops" and not (module or "").startswith("ops."):
            return []
        module = module[len("ops.") :] if module.startswith("ops.") else ""
    elif level > 1:
        return []
    if module:
        return [module.split(".")[0]]
    return list(names) or [PACKAGE]


def _imports(tree) -> list:
    """(target module, imported name or None, alias) of every import of an ops module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                for target in _target(alias.name, 0):
                    found.append((target, None, alias.asname or alias.name))
        elif isinstance(node, ast.ImportFrom):
            plain = [a.name for a in node.names]
            if node.module is None or node.module == "ops":  # ``from . import a as b``: modules
                for alias in node.names:
                    found.append((alias.name, None, alias.asname or alias.name))
                continue
            for target in _target(node.module, node.level, plain):
                for alias in node.names:
                    found.append((target, alias.name, alias.asname or alias.name))
    return found


def _graph(modules) -> dict:
    return {name: {t for t, _, _ in _imports(tree) if t in modules and t != name} for name, tree in modules.items()}


def _cycle(graph):
    """A cycle of ``graph`` as a list of nodes, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [node])
            if found:
                return found
    return None


def _private_uses(name, tree) -> list:
    """``module.name`` strings of private names ``name`` takes from other ops modules: by
    ``from .m import _x`` or as an attribute of an imported ops module (``m._x``)."""
    uses, aliases = [], {}
    for target, imported, alias in _imports(tree):
        if target in INFRASTRUCTURE or target == name:
            continue
        if imported is None:
            aliases[alias] = target
        elif imported.startswith("_"):
            uses.append(f"{target}.{imported}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = ast.unparse(node.value)  # an alias, or a dotted name: ``ops.norm``
            if owner in aliases:
                uses.append(f"{aliases[owner]}.{node.attr}")
    return uses


def test_the_graph_is_read():
    """The reader sees what is there: the dispatcher imports both backends and the shared module."""
    graph = _graph(_modules())
    assert BACKENDS | {"attention_common", "_compile"} <= graph["attention"]
    assert "attention" in graph[PACKAGE] and "_disk_cache" in graph["_compile"]


def test_no_import_cycle():
    assert _cycle(_graph(_modules())) is None


def test_a_cycle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_backends_are_leaves(backend):
    """A backend imports neither the other backends nor the dispatcher or the package."""
    imported = _graph(_modules())[backend]
    assert not imported & (BACKENDS | {"attention", PACKAGE}), imported


def test_no_private_names_across_modules():
    modules = _modules()
    found = {name: _private_uses(name, tree) for name, tree in modules.items()}
    assert {name: uses for name, uses in found.items() if uses} == {}


def test_private_uses_are_found():
    tree = ast.parse(
        "from . import attention_bwd_prepost as P\n"
        "from ._compile import _x\n"
        "def f():\n"
        "    from .mem_eff_attention import _check\n"
        "    import ops.norm\n"
        "    return P._impl, P.public, ops.norm._plan\n"
    )
    uses = sorted(_private_uses("attention", tree))
    assert uses == ["attention_bwd_prepost._impl", "mem_eff_attention._check", "norm._plan"]
