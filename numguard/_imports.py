"""Run code when a module is imported: the one import hook numguard uses (the start-up hook of
``NUMGUARD=1`` to act once torch and Transformers load, the collective guard to follow a framework
imported after it). Imports nothing, so that the start-up hook can use it before anything loads.
"""
from __future__ import annotations

import sys

__all__ = ["after_import"]


class _AfterImportFinder:
    """A meta path finder that finds nothing itself: when module `name` is about to be imported
    it asks the other finders for its spec and makes its loader call `callback` after the module
    ran (then steps aside)."""

    def __init__(self, name, callback):
        self.name = name
        self.callback = callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        original = getattr(loader, "exec_module", None)
        if original is None:
            sys.stderr.write(f"numguard: NUMGUARD=1 is set but the import of {fullname} cannot be followed; "
                             "call numguard.watch(model) in the script instead\n")
            return spec
        callback = self.callback

        def exec_module(module):
            try:
                original(module)
            finally:
                try:
                    del loader.exec_module  # the loader is the module's own; leave it as it was
                except AttributeError:
                    pass
            callback()

        loader.exec_module = exec_module
        return spec


def after_import(name, callback):
    """Call `callback` once module `name` is imported (now, if it already is)."""
    module = sys.modules.get(name)
    if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False) is False:
        callback()
        return
    sys.meta_path.insert(0, _AfterImportFinder(name, callback))
