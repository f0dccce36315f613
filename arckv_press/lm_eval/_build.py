"""Build step that ships the ``hf-arckv`` start-up hook (a ``.pth`` file) with the package.

A ``.pth`` file only works at the top of ``site-packages``, where no package data can go, so a
custom ``build_py`` writes two files at the *root* of the build output:

- ``arckv_press_lm_eval.pth``: the single line ``import _arckv_press_lm_eval_hook``;
- ``_arckv_press_lm_eval_hook.py``: a verbatim copy of :mod:`arckv_press.lm_eval._pth_hook`.

Regular wheels (``pip install .``, ``python -m build``): the files are written to ``build_lib``,
whose whole tree goes into the wheel's purelib, i.e. ``site-packages``.

Editable installs (``pip install -e .``, PEP 660): setuptools runs ``build_py`` with
``editable_mode = True`` and ignores extra ``build_lib`` outputs in its default (lenient) mode;
it installs the ``install`` command's ``install_lib`` folder (the unpacked editable wheel) as
is. So in editable mode the two files are written there as well. Both files are then listed in
the wheel's RECORD, and ``pip uninstall`` removes them.

Enabled in ``pyproject.toml`` with::

    [tool.setuptools]
    cmdclass = { build_py = "arckv_press.lm_eval._build.build_py" }

setuptools loads this module by file path (without importing ``arckv_press``), so it uses only
the standard library and setuptools.
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools.command.build_py import build_py as _build_py

PTH_NAME = "arckv_press_lm_eval.pth"
HOOK_MODULE = "_arckv_press_lm_eval_hook"
HOOK_SOURCE = Path(__file__).with_name("_pth_hook.py")

__all__ = ["HOOK_MODULE", "PTH_NAME", "build_py", "hook_files", "write_hook_files"]


def hook_files() -> dict[str, str]:
    """``{file name: content}`` of the two files installed at the top of ``site-packages``."""
    return {
        PTH_NAME: f"import {HOOK_MODULE}\n",
        f"{HOOK_MODULE}.py": HOOK_SOURCE.read_text(encoding="utf-8"),
    }


def write_hook_files(directory: str | os.PathLike[str]) -> list[str]:
    """Write :func:`hook_files` into ``directory`` (created if needed); returns the paths."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in hook_files().items():
        path = folder / name
        path.write_text(content, encoding="utf-8")
        written.append(str(path))
    return written


class build_py(_build_py):  # noqa: N801 - setuptools command naming
    """setuptools ``build_py`` that also writes the ``hf-arckv`` start-up hook files."""

    def run(self) -> None:
        super().run()
        write_hook_files(self.build_lib)
        if getattr(self, "editable_mode", False):
            install_lib = getattr(self.get_finalized_command("install"), "install_lib", None)
            if install_lib:
                write_hook_files(install_lib)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        return outputs + [os.path.join(self.build_lib, name) for name in hook_files()]
