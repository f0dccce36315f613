"""Start-up hook that plugs arckv-press into lm-eval: the ``hf-arckv`` model and the package's tasks.

lm-eval 0.4.13 has no plugin mechanism for models or tasks: ``lm_eval --model hf-arckv`` resolves
only if something registers the name in ``lm_eval.api.registry.model_registry`` first, and
``--tasks quality`` finds only the built-in task folder plus ``--include_path``. This module
installs a one-shot meta-path finder that watches two lm-eval modules. When one of them is first
imported, the finder lets the normal machinery load it and then hands it to the package:

- ``lm_eval.api.registry`` -> :func:`arckv_press.lm_eval.plugin.on_registry_imported`, which registers
  ``hf-arckv`` as a *lazy* ``"module:Class"`` placeholder (nothing heavy is imported until lm-eval
  asks for the model);
- ``lm_eval.tasks.manager`` -> :func:`arckv_press.lm_eval.plugin.on_task_manager_imported`, which
  makes every ``TaskManager`` also index the package's task folder (``arckv_press.tasks``), below
  lm-eval's own tasks (it adds names, never replaces one).

It is loaded in two ways:

- at interpreter start-up, through the ``arckv_press_lm_eval.pth`` file that the build step
  (:mod:`arckv_press.lm_eval._build`) installs next to a copy of this file named
  ``_arckv_press_lm_eval_hook.py`` in ``site-packages``;
- by ``import arckv_press.lm_eval`` (for the modules lm-eval has not imported yet).

Start-up cost: importing this file (standard library only: ``sys``) and putting one object in
``sys.meta_path``; afterwards one cheap dictionary lookup per import. Set the environment
variable ``ARCKV_LM_EVAL_NO_HOOK=1`` to disable the start-up hook.

This file must stay self-contained (no imports from ``arckv_press``, no relative imports) because
it is copied verbatim into ``site-packages``.
"""

import sys

REGISTRY_MODULE = "lm_eval.api.registry"
TASK_MANAGER_MODULE = "lm_eval.tasks.manager"
#: watched module -> (attribute that shows it finished executing, callback in arckv_press.lm_eval.plugin)
TARGETS = {
    REGISTRY_MODULE: ("model_registry", "on_registry_imported"),
    TASK_MANAGER_MODULE: ("TaskManager", "on_task_manager_imported"),
}
DISABLE_ENV = "ARCKV_LM_EVAL_NO_HOOK"


def _notify(name, module) -> None:
    """Hand the freshly executed lm-eval module ``name`` to the package."""
    callback = TARGETS[name][1]
    try:
        import arckv_press.lm_eval.plugin as plugin

        function = getattr(plugin, callback)
    except Exception as exc:  # noqa: BLE001 - arckv-press uninstalled/broken: lm-eval must still work
        import warnings

        warnings.warn(f"arckv-press: cannot plug into lm-eval ({exc!r})", stacklevel=2)
        return
    function(module)


class LmEvalImportHook:
    """One-shot meta-path finder: runs :func:`_notify` right after each watched module executes.

    ``find_spec`` finds the real spec with the remaining finders and wraps its loader's
    ``exec_module``; it never changes what is imported. It leaves ``sys.meta_path`` once every
    watched module has been seen.
    """

    def __init__(self, pending) -> None:
        self.pending = set(pending)
        self._searching = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.pending or self._searching:
            return None
        import importlib.util

        self._searching = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        original = spec.loader.exec_module
        hook = self

        def exec_module(module):
            original(module)
            hook.pending.discard(fullname)
            if not hook.pending:
                hook.uninstall()
            _notify(fullname, module)

        spec.loader.exec_module = exec_module  # this loader instance serves this one spec only
        return spec

    def uninstall(self) -> None:
        while self in sys.meta_path:
            sys.meta_path.remove(self)


def installed() -> bool:
    """True when a hook is waiting in ``sys.meta_path``."""
    return any(type(f).__name__ == "LmEvalImportHook" for f in sys.meta_path)


def install() -> None:
    """Hand the watched modules lm-eval already imported to the package at once, and install the
    hook for the others (unless a hook is already waiting)."""
    pending = []
    for name, (attribute, _) in TARGETS.items():
        module = sys.modules.get(name)
        if module is None:
            pending.append(name)
        elif hasattr(module, attribute):
            _notify(name, module)
    if pending and not installed():
        sys.meta_path.insert(0, LmEvalImportHook(pending))


def _startup() -> None:
    import os

    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return
    install()


if __name__ == "_arckv_press_lm_eval_hook":  # the copy imported by the .pth file at start-up
    _startup()
