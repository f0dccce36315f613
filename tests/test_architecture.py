"""The layering rule of ARCHITECTURE.md, checked on the package's import statements: the method's
tensor code (``arckv_press/compaction``) imports only the standard library, torch, numpy, scipy and
its own modules, never the model plumbing above it (capture, cache, api, presses, lm-eval, cli) or
transformers / kvpress."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "arckv_press"
ALLOWED_THIRD_PARTY = {"torch", "numpy", "scipy"}


def _imports(path: Path, package: str | None = None) -> list[tuple[str, int]]:
    """Absolute module names imported by ``path`` (relative imports resolved against ``package``, by
    default the file's own), anywhere in the file, function-local imports included."""
    tree = ast.parse(path.read_text(), str(path))
    if package is None:
        package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                names.append((f"{base}.{node.module}" if node.module else base, node.lineno))
            else:
                names.append((node.module, node.lineno))
    return names


def test_compaction_imports_nothing_above_it():
    """compaction/ imports only itself, methods.py (the method names) and the allowed libraries;
    methods.py imports nothing of the package (it names press classes, imported when asked for)."""
    files = sorted((PACKAGE / "compaction").glob("*.py"))
    assert len(files) >= 8
    assert not [name for name, _ in _imports(PACKAGE / "methods.py") if name.split(".")[0] not in ("__future__", *sys.stdlib_module_names)]
    bad = []
    for path in files:
        for name, line in _imports(path):
            top = name.split(".")[0]
            if (name.startswith("arckv_press.compaction") or name == "arckv_press.methods" or top == "__future__"
                    or top in sys.stdlib_module_names):
                continue
            if top not in ALLOWED_THIRD_PARTY:
                bad.append(f"{path.name}:{line} imports {name}")
    assert not bad, bad


def test_the_checker_resolves_relative_and_local_imports(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("from ..capture import prefill\nfrom .stats import ReferenceStats\n"
                   "def f():\n    import transformers\n")
    found = {n for n, _ in _imports(src, "arckv_press.compaction")}
    assert found == {"arckv_press.capture", "arckv_press.compaction.stats", "transformers"}


# The package's layers, bottom first (ARCHITECTURE.md, "Layers"): a module imports only from its own
# layer or lower ones, function-local imports included. The root package (lazy exports, version)
# imports nothing at run time and may be imported from anywhere.
LAYERS = (
    ("compaction", "attention", "methods"),
    ("models", "cache", "capture", "config", "framing", "indexer"),
    ("api", "generation", "haystack"),
    ("presses", "registry", "lm_eval", "cli", "tasks"),
    ("reconstruction", "probe_metrics", "runinfo", "bench"),
)


def _layer_of(module: str) -> int:
    part = module.split(".")[1]
    for level, names in enumerate(LAYERS):
        if part in names:
            return level
    raise AssertionError(f"{module} is in no layer of LAYERS: add it (and to ARCHITECTURE.md)")


def _package_modules():
    for root, prefix in ((PACKAGE, "arckv_press"), (PACKAGE.parent / "tasks", "arckv_press.tasks")):
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join((prefix, *parts)).removesuffix(".__init__")
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            yield name, path, package


def test_every_import_goes_to_the_same_or_a_lower_layer():
    bad = []
    for name, path, package in _package_modules():
        if name == "arckv_press":
            continue
        level = _layer_of(name)
        for imported, line in _imports(path, package):
            if not imported.startswith("arckv_press."):
                continue
            if _layer_of(imported) > level:
                bad.append(f"{name} (layer {level}) line {line} imports {imported} (layer {_layer_of(imported)})")
    assert not bad, "\n".join(bad)


def test_the_layer_check_catches_an_upward_import(tmp_path):
    src = tmp_path / "data.py"
    src.write_text("def f():\n    from arckv_press.api import encode_document\n")
    (imported, _), = _imports(src, "arckv_press.indexer")
    assert _layer_of("arckv_press.indexer.data") < _layer_of(imported)


# ----------------------------------------------------------------------------- cycles and private names

def _resolve(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def _bindings(tree: ast.AST, package: str, modules) -> list[tuple[str, str | None, str, int]]:
    """Every import of ``tree`` as ``(module, name, bound as, line)``: ``name`` is what a
    ``from module import name`` takes (``None`` for ``import module``); a name that is itself a module
    of ``modules`` is given as that module with name ``None``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append((alias.name, None, alias.asname or alias.name.split(".")[0], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(node, package)
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                if sub in modules:
                    out.append((sub, None, alias.asname or alias.name, node.lineno))
                else:
                    out.append((module, alias.name, alias.asname or alias.name, node.lineno))
    return out


def _import_graph(modules: dict[str, tuple[Path, str]]) -> dict[str, set[str]]:
    """Package module -> the package modules it imports (function-local imports included; the root
    package, which only exports lazily, left out; importing ``a.b.c`` counts as importing ``a.b.c``)."""
    graph = {}
    for name, (path, package) in modules.items():
        targets = {module for module, _, _, _ in _bindings(ast.parse(path.read_text(), str(path)), package, modules)}
        graph[name] = {t for t in targets if t in modules and t not in (name, "arckv_press")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def _modules() -> dict[str, tuple[Path, str]]:
    return {name: (path, package) for name, path, package in _package_modules()}


def test_no_import_cycles_between_package_modules():
    cycles = _cycles(_import_graph(_modules()))
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_imports(modules: dict[str, tuple[Path, str]]) -> set[tuple[str, str]]:
    """``(importing module, module.name)`` for every private name (one leading underscore) a package
    module takes from another module: ``from m import _x``, or ``m._x`` on a module it imported. A
    package and its modules may import the package's own private submodules (``from . import
    _pth_hook`` in ``lm_eval``). A dotted path through a private package
    (``arckv_press.tasks._common.resources``) is not refused: ``tasks/_common`` holds what the task
    families share with the rest of the package (document markers, data paths)."""
    found = set()
    for name, (path, package) in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        bindings = _bindings(tree, package, modules)
        aliases = {bound: module for module, imported, bound, _ in bindings if imported is None and module in modules}
        for module, imported, _, _ in bindings:
            if not module.startswith("arckv_press") or module == name:
                continue
            if imported is not None and _is_private(imported):
                found.add((name, f"{module}.{imported}"))
            leaf = module.rpartition(".")
            if imported is None and _is_private(leaf[2]) and not (name == leaf[0] or name.startswith(leaf[0] + ".")):
                found.add((name, module))  # another package's private module
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _is_private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and aliases[node.value.id] != name):
                found.add((name, f"{aliases[node.value.id]}.{node.attr}"))
    return found


def test_no_private_name_is_imported_across_modules():
    bad = sorted(_private_imports(_modules()))
    assert not bad, "\n".join(f"{who} uses {what}" for who, what in bad)


def _fake_package(tmp_path: Path, files: dict[str, str]) -> dict[str, tuple[Path, str]]:
    """Modules from sources; a name that prefixes another's is a package (its own ``package``)."""
    modules = {}
    for name, source in files.items():
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        is_package = any(other.startswith(name + ".") for other in files)
        modules[name] = (path, name if is_package else name.rpartition(".")[0])
    return modules


def test_the_cycle_and_private_checks_catch_what_they_refuse(tmp_path):
    modules = _fake_package(tmp_path, {
        "arckv_press.p.a": "from arckv_press.p.b import f, _g\n",
        "arckv_press.p.b": "def f():\n    from . import c\n    return c._h()\n",
        "arckv_press.p.c": "import arckv_press.p.a as a\nfrom arckv_press.p import _own\n",
        "arckv_press.p._own": "from . import d\n",
        "arckv_press.p": "from . import _own\n",
        "arckv_press.q": "from arckv_press.p import _own\nfrom arckv_press import __version__\n",
        "arckv_press.p.d": "",
    })
    graph = _import_graph(modules)
    assert graph["arckv_press.p.b"] == {"arckv_press.p.c"} and graph["arckv_press.q"] == {"arckv_press.p._own"}
    assert _cycles(graph) == [{"arckv_press.p.a", "arckv_press.p.b", "arckv_press.p.c"}]
    assert _private_imports(modules) == {
        ("arckv_press.p.a", "arckv_press.p.b._g"), ("arckv_press.p.b", "arckv_press.p.c._h"),
        ("arckv_press.q", "arckv_press.p._own"),  # another package's private module
    }  # arckv_press.p and arckv_press.p.c import their own package's _own: allowed
