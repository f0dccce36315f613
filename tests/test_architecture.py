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
    files = sorted((PACKAGE / "compaction").glob("*.py"))
    assert len(files) >= 8
    bad = []
    for path in files:
        for name, line in _imports(path):
            top = name.split(".")[0]
            if name.startswith("arckv_press.compaction") or top == "__future__" or top in sys.stdlib_module_names:
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
