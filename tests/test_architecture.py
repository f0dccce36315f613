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
    ("models", "cache", "capture", "framing", "indexer"),
    ("api", "generation", "haystack"),
    ("presses", "registry", "lm_eval", "cli", "tasks"),
    ("fidelity", "probes", "runinfo", "bench"),
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
