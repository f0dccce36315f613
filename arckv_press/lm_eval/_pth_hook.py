"""Start-up hook that registers the ``hf-arckv`` lm-eval model when lm-eval loads its registry.

lm-eval 0.4.13 ignores entry points for models, so ``lm_eval --model hf-arckv`` can only resolve
the name if something registers it in ``lm_eval.api.registry.model_registry`` first. This module
installs a one-shot meta-path finder: the first time ``lm_eval.api.registry`` is imported, the
finder lets the normal machinery load it and then calls
:func:`arckv_press.lm_eval.on_registry_imported`, which registers ``hf-arckv`` as a *lazy*
``"module:Class"`` placeholder (nothing heavy is imported until lm-eval asks for the model).

It is loaded in two ways:

- at interpreter start-up, through the ``arckv_press_lm_eval.pth`` file that the build step
  (:mod:`arckv_press.lm_eval._build`) installs next to a copy of this file named
  ``_arckv_press_lm_eval_hook.py`` in ``site-packages``;
- by ``import arckv_press.lm_eval`` (when lm-eval's registry is not imported yet).

Start-up cost: importing this file (standard library only: ``sys``) and putting one object in
``sys.meta_path``; afterwards one cheap string comparison per import. Set the environment
variable ``ARCKV_LM_EVAL_NO_HOOK=1`` to disable the start-up hook.

This file must stay self-contained (no imports from ``arckv_press``, no relative imports) because
it is copied verbatim into ``site-packages``.
"""

import sys

REGISTRY_MODULE = "lm_eval.api.registry"
DISABLE_ENV = "ARCKV_LM_EVAL_NO_HOOK"


def _notify(module) -> None:
    """Hand the freshly executed registry module to the package (which registers ``hf-arckv``)."""
    try:
        from arckv_press.lm_eval import on_registry_imported
    except Exception as exc:  # noqa: BLE001 - arckv-press uninstalled/broken: lm-eval must still work
        import warnings

        warnings.warn(f"arckv-press: cannot register the 'hf-arckv' lm-eval model ({exc!r})", stacklevel=2)
        return
    on_registry_imported(module)


class RegistryImportHook:
    """One-shot meta-path finder: runs :func:`_notify` right after ``lm_eval.api.registry`` executes.

    ``find_spec`` finds the real spec with the remaining finders and wraps its loader's
    ``exec_module``; it never changes what is imported.
    """

    def __init__(self) -> None:
        self._searching = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != REGISTRY_MODULE or self._searching:
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
            hook.uninstall()
            _notify(module)

        spec.loader.exec_module = exec_module  # this loader instance serves this one spec only
        return spec

    def uninstall(self) -> None:
        while self in sys.meta_path:
            sys.meta_path.remove(self)


def installed() -> bool:
    """True when a hook is waiting in ``sys.meta_path``."""
    return any(type(f).__name__ == "RegistryImportHook" for f in sys.meta_path)


def install() -> None:
    """Install the hook unless lm-eval's registry is already imported or a hook is waiting.

    When the registry is already imported, it is handed to the package at once.
    """
    registry = sys.modules.get(REGISTRY_MODULE)
    if registry is not None:
        if hasattr(registry, "model_registry"):
            _notify(registry)
        return
    if not installed():
        sys.meta_path.insert(0, RegistryImportHook())


def _startup() -> None:
    import os

    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return
    install()


if __name__ == "_arckv_press_lm_eval_hook":  # the copy imported by the .pth file at start-up
    _startup()
