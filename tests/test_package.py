"""The package's public surface: lazy top-level exports, and the wheel installed in a fresh venv."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import short_quality_file

import arckv_press
from arckv_press.lm_eval import _build


def test_import_is_light():
    """``import arckv_press`` loads neither torch nor transformers (the lm-eval start-up hook imports it)."""
    code = "import sys, arckv_press; print(sorted(m for m in ('torch', 'transformers', 'kvpress') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", sorted(arckv_press._EXPORTS))
def test_exports_are_the_defining_objects(name):
    obj = getattr(arckv_press, name)
    assert obj is getattr(importlib.import_module(arckv_press._EXPORTS[name]), name)
    assert name in arckv_press.__all__ and name in dir(arckv_press)


def test_documented_import_line():
    from arckv_press import ARCKVPress, AttentionMatchingPress, CompactCache, compact, load_model  # noqa: F401

    assert ARCKVPress.__module__ == "arckv_press.presses"


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'ARCKV'"):
        arckv_press.ARCKV  # noqa: B018
    with pytest.raises(ImportError):
        exec("from arckv_press import not_a_name", {})


def test_all_lists_exactly_the_exports():
    assert set(arckv_press.__all__) == set(arckv_press._EXPORTS) | {"__version__"}


# ----------------------------------------------------------------------------- the wheel

REPO = Path(__file__).resolve().parents[1]


def _run(args, cwd, env=None, timeout=600):
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, cwd=str(cwd),
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return proc.stdout


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory):
    """A wheel built from a copy of the sources, installed into a fresh virtual environment (its
    dependencies come from this interpreter's site-packages, never from an index: :func:`_see_our_site`)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for folder in ("arckv_press", "tasks"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", src, "-w", root / "dist"], root)
    (wheel,) = (root / "dist").glob("*.whl")
    _run([sys.executable, "-m", "venv", root / "venv"], root)
    python = root / "venv" / "bin" / "python"
    _see_our_site(python, root)
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel], root)
    work = root / "elsewhere"  # every command runs outside the checkout
    work.mkdir()
    return wheel, python, work


def _our_site_dirs() -> list[str]:
    """Where this interpreter finds its packages: its purelib and platlib (a virtualenv's own
    site-packages when the tests run in one) and every site-packages folder it reads."""
    paths = sysconfig.get_paths()
    found = [paths["purelib"], paths["platlib"], *site.getsitepackages()]
    return [p for i, p in enumerate(found) if p not in found[:i] and os.path.isdir(p)]


def _see_our_site(python: Path, cwd: Path) -> Path:
    """Let the virtual environment of ``python`` import this interpreter's packages (torch, lm-eval,
    ...) behind its own: a ``.pth`` file in its site-packages that lists :func:`_our_site_dirs`.
    ``--system-site-packages`` would not do: it exposes the *base* interpreter's packages, which
    lack them when the tests run in a virtualenv. The listed folders only join ``sys.path`` (their
    own ``.pth`` files, such as an editable install of this checkout, are not run), after the
    environment's own site-packages, so the wheel installed there is what ``import arckv_press`` finds."""
    own = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd).strip()
    pth = Path(own) / "_arckv_test_parent_site.pth"
    pth.write_text("".join(f"{p}\n" for p in _our_site_dirs()), encoding="utf-8")
    return pth


def test_a_venv_sees_this_interpreters_packages_behind_its_own(tmp_path):
    """The fixture's venv imports this interpreter's torch (in a virtualenv too, where the base
    interpreter has none), and reads its own site-packages before the borrowed folders."""
    import torch

    _run([sys.executable, "-m", "venv", "--without-pip", tmp_path / "venv"], tmp_path)
    python = tmp_path / "venv" / "bin" / "python"
    _see_our_site(python, tmp_path)
    code = "import json, sys, sysconfig, torch; print(json.dumps([torch.__file__, sysconfig.get_paths()['purelib'], sys.path]))"
    torch_file, own, path = json.loads(_run([python, "-c", code], tmp_path))
    assert torch_file == torch.__file__
    assert own.startswith(str(tmp_path)) and own in path
    assert all(p in path and path.index(p) > path.index(own) for p in _our_site_dirs())


@pytest.mark.wheel
def test_wheel_contents(installed_wheel):
    wheel, _, _ = installed_wheel
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        record = z.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode()
        pth = z.read(_build.PTH_NAME).decode()
    assert {_build.PTH_NAME, f"{_build.HOOK_MODULE}.py"} <= names and _build.PTH_NAME in record
    assert pth == f"import {_build.HOOK_MODULE}\n"
    tasks = {p.relative_to(REPO / "tasks").as_posix() for p in (REPO / "tasks").rglob("*")
             if p.is_file() and "__pycache__" not in p.parts}
    assert {f"arckv_press/tasks/{t}" for t in tasks} <= names  # every YAML, template and helper
    assert any(n.startswith("arckv_press/indexer/weights/") for n in names)


@pytest.mark.wheel
def test_installed_package_imports_from_anywhere(installed_wheel):
    _, python, work = installed_wheel
    code = """
import arckv_press, arckv_press.tasks
from arckv_press import ARCKVPress, AttentionMatchingPress, compact, CompactCache, load_model
from arckv_press.tasks._common import resources
from arckv_press.tasks.ruler import utils
from arckv_press.bench import CHECKOUT, needle, make_leaderboard
print(arckv_press.__file__)
print(arckv_press.tasks.__file__)
print(resources.SHARED_DATA_DIR, resources.REPO_ROOT, CHECKOUT)
"""
    out = _run([python, "-c", code], work).split()
    venv = str(python.parents[1])
    assert out[0].startswith(venv) and out[1].startswith(venv)  # the wheel's copy, not the checkout
    assert out[2:] == ["None", "None", "None"]  # an installed package never reads ../shared/data


@pytest.mark.wheel
def test_stock_lm_eval_command_runs_from_the_wheel(installed_wheel, tmp_path):
    """``lm_eval --model hf-arckv ... --tasks quality`` with no --include_path, data from
    ARCKV_QUALITY_PATH, run outside the checkout (the plain ``lm_eval`` script of this
    interpreter, through the installed start-up hook)."""
    _, python, work = installed_wheel
    data = short_quality_file(tmp_path / "quality.jsonl")
    out = tmp_path / "results"
    env = {"HF_HUB_OFFLINE": "1", "ARCKV_QUALITY_PATH": str(data), "OMP_NUM_THREADS": "1"}
    _run([python, "-m", "lm_eval", "--model", "hf-arckv", "--model_args", "press=arckv-ha,ratio=0.1",
          "--tasks", "quality", "--limit", "1", "--device", "cpu", "--output_path", out], work, env, timeout=900)
    (result,) = out.rglob("results_*.json")
    results = json.loads(result.read_text())
    assert results["config"]["model"] == "hf-arckv"
    assert results["n-samples"]["quality"] == {"original": 3, "effective": 1}
    assert 0.0 <= results["results"]["quality"]["acc,none"] <= 1.0
    # the task came from the installed package, and its article was compacted once
    assert results["configs"]["quality"]["metadata"]["config_source"].startswith(str(python.parents[1]))
    (records,) = out.glob("arckv_compaction_*arckv-ha_0.1.jsonl")
    assert len(records.read_text().splitlines()) == 1


def test_pyproject_lists_every_package():
    """``pyproject.toml`` names the packages explicitly (the task folder is mapped): none may be missed."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"arckv_press.tasks": "tasks"}
    found = set()
    for root, prefix in ((REPO / "arckv_press", "arckv_press"), (REPO / "tasks", "arckv_press.tasks")):
        for init in root.rglob("__init__.py"):
            found.add(".".join([prefix, *init.parent.relative_to(root).parts]))
    assert set(setuptools["packages"]) == found
