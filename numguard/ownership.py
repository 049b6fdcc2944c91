"""Who watches a model: the start-up watcher of ``NUMGUARD=1`` watches every root module
provisionally, and gives way to the inspector the script or a framework integration makes.

The start-up watcher (numguard.auto_watch) registers itself here; the Inspector and the
integrations ask here, never the watcher's module.
Imports nothing: the start-up hook uses it before the script has imported anything.
"""
from __future__ import annotations

__all__ = ["give_way", "provisional", "set_provisional", "started_here"]

_provisional = None  # the start-up watcher (numguard.auto_watch.AutoWatcher), or None


def set_provisional(watcher) -> None:
    """Register the start-up watcher (None: none)."""
    global _provisional
    _provisional = watcher


def provisional():
    """The start-up watcher of ``NUMGUARD=1``, or None."""
    return _provisional


def started_here(inspector) -> bool:
    """Whether `inspector` is one the start-up watcher opened."""
    return _provisional is not None and _provisional.opened(inspector)


def give_way(model=None, inspector=None) -> int:
    """The start-up watcher closes what it opened on `model` or inside it (and leaves those
    modules alone from now on), or the one `inspector`; returns how many it closed."""
    if _provisional is None:
        return 0
    return _provisional.give_way(model=model, inspector=inspector)
