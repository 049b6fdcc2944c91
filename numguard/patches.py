"""Every process-wide change numguard makes to other libraries' objects, in one place.

numguard replaces a few functions (``torch.autograd.backward`` in operation mode,
``GradScaler.step``, ``Module.compile`` under ``NUMGUARD=1``, the ``torch.distributed``
collectives of the guard, ``destroy_process_group``, Transformers' ``DebugUnderflowOverflow``)
and registers a few global hooks (the optimizer step pre-hook, the module forward pre-hook of
``NUMGUARD=1``). Each goes through :func:`replace` or :func:`add_hook` and comes back out through
:func:`restore`; :func:`numguard.patched` lists what is in place now, with why.

Installing is idempotent (a second install of the same target returns the patch in place), and
restoring puts the original back only where numguard's replacement is still what the attribute
holds: a function someone wrapped on top of ours is left alone. Imports nothing (the start-up
hook uses it before the script has imported anything).
"""
from __future__ import annotations

import threading

__all__ = ["Patch", "add_hook", "active", "patched", "replace", "restore"]

_lock = threading.RLock()
_active = {}  # target -> Patch, in install order


class Patch:
    """One change in place: `target` (what it changes, as a dotted name), `why` (one line)."""

    __slots__ = ("target", "why", "owner", "attribute", "original", "replacement", "handle")

    def __init__(self, target, why, owner=None, attribute=None, original=None, replacement=None, handle=None):
        self.target = target
        self.why = why
        self.owner = owner
        self.attribute = attribute
        self.original = original
        self.replacement = replacement
        self.handle = handle

    def __repr__(self):
        return f"numguard.patches.Patch({self.target!r})"


def replace(owner, attribute, replacement, *, target, why, calls=None) -> Patch:
    """Set ``owner.<attribute>`` to `replacement`, keeping the original to restore. The function
    the replacement calls (`calls`, default the original) is its ``__numguard_original__`` where
    it takes attributes. Idempotent per target while numguard's replacement is in place."""
    with _lock:
        patch = _active.get(target)
        if patch is not None:
            if _in_place(patch):
                return patch
            del _active[target]  # someone restored or replaced it since: ours is gone
        original = getattr(owner, attribute)
        try:
            replacement.__numguard_original__ = original if calls is None else calls
        except (AttributeError, TypeError):  # a builtin or a bound method takes no attributes
            pass
        setattr(owner, attribute, replacement)
        patch = _active[target] = Patch(target, why, owner, attribute, original, replacement)
        return patch


def add_hook(register, hook, *, target, why) -> Patch:
    """``register(hook)`` (a torch global hook registration returning a removable handle), once
    per target."""
    with _lock:
        patch = _active.get(target)
        if patch is not None:
            return patch
        patch = _active[target] = Patch(target, why, handle=register(hook), replacement=hook)
        return patch


def restore(patch_or_target) -> None:
    """Undo a patch (idempotent). A replaced attribute gets its original back only while it still
    holds numguard's replacement."""
    with _lock:
        target = patch_or_target if isinstance(patch_or_target, str) else patch_or_target.target
        patch = _active.pop(target, None)
        if patch is None:
            return
        if patch.handle is not None:
            patch.handle.remove()
        elif getattr(patch.owner, patch.attribute, None) is patch.replacement:
            setattr(patch.owner, patch.attribute, patch.original)


def _in_place(patch) -> bool:
    return patch.handle is not None or getattr(patch.owner, patch.attribute, None) is patch.replacement


def active(target) -> Patch | None:
    """The patch of `target` in place now, or None."""
    patch = _active.get(target)
    return patch if patch is not None and _in_place(patch) else None


def patched() -> list:
    """What numguard has changed in this process and is in place now: ``[{"target": ...,
    "why": ...}]``, in the order installed (empty when numguard changes nothing)."""
    with _lock:
        return [{"target": p.target, "why": p.why} for p in _active.values() if _in_place(p)]
