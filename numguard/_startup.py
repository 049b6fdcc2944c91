"""Start-up activation: ``NUMGUARD=1`` watches every root module of a script that never imports
numguard.

Installing numguard installs ``numguard-startup.pth`` into site-packages. Python's ``site`` runs its
one line at every start-up; the line reads ``os.environ["NUMGUARD"]`` and stops there unless it is
set to something other than 0. Only then does it load this file (by path: neither ``numguard``'s
package nor torch is imported) and call :func:`activate`, which adds an import watcher for torch and
returns. Start-up therefore imports nothing with ``NUMGUARD`` unset, and with it set it still does
not import torch before the script does (a script may set ``CUDA_VISIBLE_DEVICES`` or thread counts
before its ``import torch``).

Once the script's ``import torch`` has finished, numguard validates every ``NUMGUARD_*`` variable (an
invalid one fails that import with an error naming it), and registers one global forward pre-hook:
a module called while no watched module is running is a root, and gets ``numguard.watch(root)``
with the settings of the variables. Calls inside a watched root return from that hook at once (one
integer test); so do calls of any module under a watched root.

This file must stay importable without numguard's package and without torch.
"""
import os
import sys

__all__ = ["activate", "auto_watcher", "PTH_NAME", "pth_path"]

PTH_NAME = "numguard-startup.pth"


def pth_path():
    """The start-up hook file shipped in the package (installed as ``PTH_NAME``)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_startup.pth")


_activated = False


def _after_import(name, callback):
    """numguard._imports.after_import, its file loaded by path (no package import before the
    script's own: the same way the .pth line loads this file)."""
    module = sys.modules.get("numguard._imports")
    if module is None:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "numguard._imports", os.path.join(os.path.dirname(os.path.abspath(__file__)), "_imports.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    module.after_import(name, callback)


def activate():
    """Arrange for numguard to watch the script's root modules once torch is imported.

    Called by the start-up hook when ``NUMGUARD`` is set; imports nothing. Safe to call twice.
    """
    global _activated
    if _activated:
        return
    _activated = True
    _after_import("torch", _on_torch_imported)


def auto_watcher():
    """The root watcher (numguard.auto_watch.AutoWatcher) that ``NUMGUARD=1`` installed, or None."""
    ownership = sys.modules.get("numguard.ownership")  # loaded once the watcher exists
    return None if ownership is None else ownership.provisional()


def _on_torch_imported():
    """The script's ``import torch`` has finished: numguard's package may load now."""
    from numguard import auto_watch

    auto_watch.on_torch_imported(_after_import)


