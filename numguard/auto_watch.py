"""``NUMGUARD=1``'s root watcher: once the script has imported torch, every root module it calls
(a module called while no watched module runs) gets ``numguard.watch(root)`` with the settings of
the ``NUMGUARD_*`` variables.

numguard._startup (torch-free, loaded by the start-up hook) calls :func:`on_torch_imported` when
the script's ``import torch`` has finished; everything here may import torch and numguard. The
watcher registers itself with numguard.ownership, which the Inspector and the integrations ask.
The process-wide changes it makes (the global forward pre-hook, ``Module.compile``) go through
numguard.patches.
"""
import logging
import sys
import warnings
import weakref

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from . import env, ownership, patches
from .inspector import core as _core

__all__ = ["AutoWatcher", "on_torch_imported"]


def _serve_transformers_debug():
    """Trainer(debug="underflow_overflow") in a NUMGUARD=1 job: numguard's detector alone."""
    try:
        from .integrations import transformers as integration  # transformers is imported by now
        integration.serve_debug_option()
    except Exception as exc:  # numguard's failure must not kill the job
        warnings.warn(f"numguard: could not take over Transformers' debug option ({type(exc).__name__}: "
                      f"{exc}); with debug='underflow_overflow' both detectors run", RuntimeWarning, stacklevel=2)


def on_torch_imported(after_import):
    """torch has been imported: validate the settings, then install the root watcher (once).
    `after_import(name, callback)` follows a later import (numguard._imports.after_import)."""
    try:
        env.validate()
    except env.EnvironmentSettingError as exc:
        raise env.EnvironmentSettingError(exc.variable, exc.value, exc.accepted) from None
    level = env.log_level_from_env()
    if level is not None:
        logging.getLogger("numguard").setLevel(level)
    if ownership.provisional() is None:
        watcher = AutoWatcher(env.settings_from_env())
        watcher.install()
        ownership.set_provisional(watcher)
    after_import("transformers.trainer", _serve_transformers_debug)
    if env.dist_settings_from_env()["dist_check"]:
        try:
            from . import distributed  # loaded on first use only (numguard.__getattr__)
            from .integrations import accelerate as accelerate_integration
            distributed.guard_collectives()
            # Accelerate's debug mode would exchange the same shapes again: numguard's check only.
            accelerate_integration.prefer_numguard_collective_check()
        except Exception as exc:  # numguard's failure must not kill the job
            warnings.warn(f"numguard: NUMGUARD_DIST_CHECK=1 but the collective checks could not be "
                          f"installed ({type(exc).__name__}: {exc}); collectives are not checked",
                          RuntimeWarning, stacklevel=2)


# What AutoWatcher changes in the process (numguard.patches targets).
_GLOBAL_HOOK = "torch.nn.modules.module.register_module_forward_pre_hook (NUMGUARD=1)"
_COMPILE = "torch.nn.Module.compile"


class AutoWatcher:
    """Watches every root module the script calls (a module called while no watched module runs).

    Args:
        watch_kwargs: keyword arguments for every ``numguard.watch`` call (the variables' settings).
    """

    def __init__(self, watch_kwargs):
        self.watch_kwargs = dict(watch_kwargs)
        self.running = 0                  # watched roots currently inside their forward
        self.covered = weakref.WeakSet()  # every module under a watched root, roots included
        self.inspectors = []              # (weakref to root, Inspector), oldest first
        self.handle = None
        self._is_compiling = None
        self._original_compile = None

    def install(self):
        self._is_compiling = torch.compiler.is_compiling
        self.handle = patches.add_hook(register_module_forward_pre_hook, self._global_pre_hook,
                                       target=_GLOBAL_HOOK, why="NUMGUARD=1: watch every root module the script runs")
        # A model compiled in place runs its whole call, global hooks included, inside the compiled
        # frame, where the hook above cannot watch anything: watch such a model before it compiles.
        self._original_compile = torch.nn.Module.compile
        watcher = self

        def compile(module, *args, **kwargs):
            watcher.watch_before_compile(module)
            return watcher._original_compile(module, *args, **kwargs)

        compile.__doc__ = self._original_compile.__doc__
        patches.replace(torch.nn.Module, "compile", compile, target=_COMPILE,
                        why="NUMGUARD=1: watch a model compiled in place before it compiles")

    def close(self):
        """Remove the global hook and close every inspector this watcher opened."""
        if self.handle is not None:
            patches.restore(self.handle)
            self.handle = None
        if self._original_compile is not None:
            patches.restore(_COMPILE)
            self._original_compile = None
        for _, inspector in self.inspectors:
            inspector.close()
        self.inspectors.clear()

    def _root_died(self, ref):
        """A watched root was garbage-collected (e.g. a loss module made anew every step): drop
        its inspector, so that roots made per step do not pile up."""
        for i, (root_ref, inspector) in enumerate(self.inspectors):
            if root_ref is ref:
                del self.inspectors[i]
                try:
                    inspector.close(check=False)
                except Exception:  # noqa: BLE001 - never raise from a garbage-collection callback
                    pass
                break

    def opened(self, inspector):
        """Whether this watcher opened `inspector` (numguard.ownership)."""
        return any(insp is inspector for _, insp in self.inspectors)

    def give_way(self, model=None, inspector=None):
        """Close the inspectors this watcher opened on `model` or inside it (and leave those
        modules to their new owner from now on), or the one `inspector`; returns how many it
        closed (numguard.ownership.give_way)."""
        inside = set() if model is None else {id(m) for m in model.modules()}
        closed = 0
        kept = []
        for ref, insp in list(self.inspectors):
            root = ref()
            if insp is inspector or (root is not None and id(root) in inside):
                try:
                    insp.close()
                finally:
                    closed += 1
            else:
                kept.append((ref, insp))
        self.inspectors[:] = kept
        if model is not None:
            self.covered.update(model.modules())
        return closed

    def roots(self):
        """The modules watched as roots, oldest first (those still alive)."""
        return [ref() for ref, _ in self.inspectors if ref() is not None]

    # NOTE: [root detection cost] This hook runs before every module call in the process. Inside a
    # watched root it returns after one integer test; the rest runs once per new root.
    def _global_pre_hook(self, module, args):
        # is_compiling() first: under torch.compile this hook then traces to nothing (no guard on
        # this watcher's state). A model compiled in place (Module.compile) is watched when it
        # compiles instead (watch_before_compile).
        if self._is_compiling() or self.running or module in self.covered:
            return None
        return self._new_root(module, args)

    def watch_before_compile(self, module):
        """Watch `module` as a root now: it is about to be compiled in place."""
        if module in self.covered:
            return
        try:
            self._watch_root(module)
        except Exception as exc:  # numguard's failure must not kill the job
            warnings.warn(f"numguard: could not watch {type(module).__name__} before Module.compile() "
                          f"({type(exc).__name__}: {exc}); it runs unwatched", RuntimeWarning, stacklevel=3)

    def _enter(self, module, args):
        self.running += 1

    def _exit(self, module, args, output):
        self.running -= 1

    def _watch_root(self, module):
        """numguard.watch(module) with the variables' settings, closing the inspectors of earlier
        roots it contains; None when the script watches it itself. Raises what watch() raises."""
        if _core.is_watched(module):  # the script watches it itself
            self.covered.update(module.modules())
            return None
        submodules = list(module.modules())
        inner = set(map(id, submodules))
        kept = []
        for ref, inspector in self.inspectors:  # a new root above an earlier one subsumes it
            root = ref()
            if root is not None and id(root) in inner:
                inspector.close()
            else:
                kept.append((ref, inspector))
        self.inspectors = kept
        self.covered.update(submodules)
        inspector = _core.watch(module, **self.watch_kwargs)
        self.inspectors.append((weakref.ref(module, self._root_died), inspector))
        # Counted as running while its forward runs; outside any compiled graph (Module.compile).
        module.register_forward_pre_hook(torch.compiler.disable(self._enter))
        module.register_forward_hook(torch.compiler.disable(self._exit), always_call=True)
        return inspector

    def _new_root(self, module, args):
        pre_hooks_before = set(module._forward_pre_hooks)
        try:
            inspector = self._watch_root(module)
        except Exception as exc:  # numguard's failure must not kill the job
            warnings.warn(f"numguard: could not watch {type(module).__name__} "
                          f"({type(exc).__name__}: {exc}); it runs unwatched", RuntimeWarning,
                          stacklevel=3)
            return None
        if inspector is None:
            return None
        # This call already runs: torch took its list of pre-hooks before ours ran, so run the
        # ones watch() just added, and count this call as running (its forward hooks will run).
        new_args = None
        kwargs = _call_kwargs()
        for hook_id, hook in list(module._forward_pre_hooks.items()):
            if hook_id in pre_hooks_before:
                continue
            call_args = args if new_args is None else new_args
            if hook_id in module._forward_pre_hooks_with_kwargs:
                result = hook(module, call_args, kwargs)
                if result is not None:
                    new_args, new_kwargs = result
                    kwargs.clear()
                    kwargs.update(new_kwargs)
            else:
                result = hook(module, call_args)
                if result is not None:
                    new_args = result if isinstance(result, tuple) else (result,)
        return new_args  # the loop ran _enter too: this call counts as running


def _call_kwargs():
    """The keyword arguments of the module call in progress: torch's ``Module._call_impl`` keeps
    them in its ``inner`` closure, the caller of the global pre-hook (three frames up from here).
    An empty dict when they cannot be found there."""
    try:
        frame = sys._getframe(3)
    except ValueError:
        return {}
    if frame.f_code.co_name != "inner" or "_call_impl" not in frame.f_code.co_qualname:
        return {}
    kwargs = frame.f_locals.get("kwargs")
    return kwargs if isinstance(kwargs, dict) else {}
