"""numguard in a Transformers ``Trainer``:

    from numguard.integrations.transformers import NumguardCallback
    trainer = Trainer(model, args, ..., callbacks=[NumguardCallback(on_trip="raise")])

From ``on_train_begin`` the callback watches the model the Trainer runs (DDP and torch.compile
wrappers taken off), with ``backward=True`` unless told otherwise: parameter gradients are checked
right before each optimizer step, after clipping and unscaling. A trip's message gives the
Trainer's ``global_step`` next to numguard's batch number. Each time the Trainer logs, numguard adds
``numguard/worst_headroom``, ``numguard/nonfinite`` and ``numguard/skipped_steps`` to its logs, so
they reach TensorBoard, W&B and the console like any metric. ``on_train_end`` closes the inspector.

``TrainingArguments(debug="underflow_overflow")`` with this callback: numguard's detector replaces
Transformers' ``DebugUnderflowOverflow`` (its hooks are removed; one message says so), never both.
Without the callback, in a ``NUMGUARD=1`` job (``serve_debug_option``), the option gets numguard's
drop-in ``DebugUnderflowOverflow``: Transformers' report lines and ``ValueError`` byte for byte.

Evaluation and prediction under the Trainer run with gradients off; numguard checks those batches
on their own rank, outside the cross-rank exchange of training steps.
"""
from __future__ import annotations

import logging
import sys
import weakref

from . import _common

__all__ = ["NumguardCallback", "remove_debug_underflow_overflow", "serve_debug_option"]

_log = logging.getLogger("numguard")
_PREFIX = "numguard/"


def _trainer_callback_base():
    try:
        from transformers import TrainerCallback
    except ImportError as exc:  # the class below cannot exist without it
        raise ImportError("numguard.integrations.transformers needs the transformers package "
                          f"(pip install transformers): {exc}") from exc
    return TrainerCallback


def remove_debug_underflow_overflow(model) -> int:
    """Remove the hooks of Transformers' ``DebugUnderflowOverflow`` from `model` (what
    ``debug="underflow_overflow"`` installs), and close the drop-in that serve_debug_option() put
    there instead. Returns how many hooks were removed."""
    removed = 0
    served = _served.pop(model, None)
    if served is not None:
        removed += len(served._handles)
        served.close(check=False)
    debug_utils = sys.modules.get("transformers.debug_utils")
    hf_class = getattr(debug_utils, "DebugUnderflowOverflow", None)
    if hf_class is None:
        return removed
    for module in model.modules():
        for hook_id, hook in list(module._forward_hooks.items()):
            if isinstance(getattr(hook, "__self__", None), hf_class):
                del module._forward_hooks[hook_id]
                module._forward_hooks_with_kwargs.pop(hook_id, None)
                module._forward_hooks_always_called.pop(hook_id, None)
                removed += 1
    return removed


_told = set()
_served = weakref.WeakKeyDictionary()  # model -> the drop-in serve_debug_option() put on it


def _say_debug_replaced(removed=None):
    if "debug" in _told:
        return
    _told.add("debug")
    what = f" (hooks removed: {removed})" if removed is not None else ""
    _common.warn('numguard: Trainer debug="underflow_overflow" is served by numguard\'s detector instead of '
                 f"Transformers' DebugUnderflowOverflow{what}; reports keep Transformers' format")


def _say_debug_served():
    if "served" in _told:
        return
    _told.add("served")
    _common.warn('numguard: Trainer debug="underflow_overflow" is served by numguard\'s drop-in '
                 "DebugUnderflowOverflow (NUMGUARD=1): the same report lines and ValueError texts as "
                 "Transformers', recorded on the device without its per-tensor host syncs")


def _serve(model, args, kwargs):
    """What the Trainer's ``DebugUnderflowOverflow(model)`` call makes under serve_debug_option():
    numguard's drop-in, with Transformers' output and exceptions byte for byte, alone on `model`
    (the start-up watcher leaves it). NUMGUARD_* variables fill in what the call leaves out."""
    from .. import env
    from ..inspector.dropin import TransformersDebugUnderflowOverflow

    previous = _served.pop(model, None)
    if previous is not None:  # train() again: one detector, as Transformers' hooks would not be twice
        previous.close(check=False)
    _common.take_over_from_start_up(model)
    options = env.settings_from_env()
    names = ("max_frames_to_save", "trace_batch_nums", "abort_after_batch_num")
    for name, value in zip(names, args):
        options[name] = value
    options.update(kwargs)
    served = _served[model] = TransformersDebugUnderflowOverflow(model, **options)
    _say_debug_served()
    return served


def serve_debug_option() -> None:
    """Make ``debug="underflow_overflow"`` run numguard's drop-in ``DebugUnderflowOverflow``: the
    Trainer's ``DebugUnderflowOverflow(model)`` call gets numguard's detector, which prints the
    same lines and raises the same ``ValueError`` as Transformers' (said once, on stderr). For
    ``NUMGUARD=1`` jobs; call it once transformers.trainer is imported. Idempotent."""
    import transformers.trainer as trainer_module

    current = trainer_module.DebugUnderflowOverflow
    if getattr(current, "__numguard_serves__", False):
        return

    def numguard_serves(model, *args, **kwargs):
        return _serve(model, args, kwargs)

    numguard_serves.__numguard_serves__ = True
    numguard_serves.__wrapped__ = current
    from .. import patches

    patches.replace(trainer_module, "DebugUnderflowOverflow", numguard_serves,
                    target="transformers.trainer.DebugUnderflowOverflow",
                    why='NUMGUARD=1: debug="underflow_overflow" runs numguard\'s drop-in')


# NOTE: [reporters first] The Trainer puts its reporting callbacks (TensorBoard, W&B, ...) before
# the user's, and they read `logs` in their on_log before this callback could add numguard's
# numbers to it. No event comes between the Trainer building `logs` and those reads, and no
# callback event hands a callback the handler, its list or the Trainer, so the list is found once
# per train() as the list of callbacks that holds this callback and the Trainer's
# DefaultFlowCallback (which every Trainer's CallbackHandler holds): the garbage collector's
# referrers of this callback, one pass over the heap's containers (nothing of the call stack, and
# nothing patched); this callback then moves ahead of the first reporter. Where it is not found,
# the numbers still reach the callbacks after this one and the Trainer's log history.
def _callback_lists(callback):
    """The Trainer's lists of callbacks that hold `callback` (see NOTE: [reporters first])."""
    import gc

    from transformers.trainer_callback import DefaultFlowCallback

    found = []
    for holder in gc.get_referrers(callback):
        if (type(holder) is list and not any(holder is known for known in found)
                and any(isinstance(cb, DefaultFlowCallback) for cb in holder)):
            found.append(holder)
    return found


class NumguardCallback(_trainer_callback_base()):
    """A ``transformers.TrainerCallback`` that watches the Trainer's model with numguard.

    Args:
        **watch_options: numguard.watch() options (``on_trip``, ``check``, ``headroom``,
            ``report_to``, ...); ``backward`` defaults to True here. Options left out take their
            NUMGUARD_* variables. Invalid options raise here, not at the first step.

    Attributes:
        inspector: the Inspector while training runs (None before on_train_begin and after
            on_train_end). When train() raises, the Trainer calls no on_train_end: the model stays
            watched until close() or the next train().
        last_summary: the numbers added to the last logs.
    """

    def __init__(self, **watch_options):
        _common.resolve_options(watch_options)  # fail now, naming the bad option
        self.watch_options = dict(watch_options)
        self.inspector = None
        self.last_summary = {}
        self._state = None

    # -- training ---------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._log_first()
        self._state = state
        if model is None:
            return
        model = _common.unwrap(model)
        if self.inspector is not None:
            if self.inspector.model is model:
                return  # train() raised last time (no on_train_end): keep watching the same model
            self.close()
        removed = remove_debug_underflow_overflow(model)
        if removed or "underflow_overflow" in str(getattr(args, "debug", "")):
            _say_debug_replaced(removed)
        try:
            _common.take_over_from_start_up(model)
            self.inspector = _common.watch(model, self.watch_options, step=self._global_step,
                                           step_label="Trainer global_step")
        except Exception as exc:  # numguard's failure must not stop the Trainer
            self.inspector = None
            _common.warn(f"numguard: could not watch the Trainer's model ({type(exc).__name__}: {exc}); "
                         "training goes on unwatched")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.inspector is None or logs is None:
            return
        summary = {_PREFIX + key: value for key, value in _common.numerics_summary(self.inspector).items()}
        self.last_summary = summary
        logs.update(summary)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(summary)  # the Trainer copied logs there before on_log

    def on_train_end(self, args, state, control, **kwargs):
        inspector, self.inspector = self.inspector, None
        if inspector is not None:
            inspector.close()

    def close(self):
        """Close the inspector now (on_train_end does this)."""
        self.on_train_end(None, None, None)

    # -- helpers ----------------------------------------------------------------------------------
    def _global_step(self):
        return self._state.global_step if self._state is not None else None

    def _log_first(self):
        """Move this callback ahead of the reporting callbacks (TensorBoard, W&B, ...), which the
        Trainer puts before user callbacks: its numbers must be in `logs` before they read it
        (NOTE: [reporters first])."""
        try:
            for callbacks in _callback_lists(self):
                here = callbacks.index(self)
                first_reporter = next((i for i, cb in enumerate(callbacks)
                                       if type(cb).__module__.startswith("transformers.integrations")), None)
                if first_reporter is not None and first_reporter < here:
                    # Moving ourselves earlier while the handler iterates skips and repeats nothing.
                    callbacks.pop(here)
                    callbacks.insert(first_reporter, self)
        except Exception:
            pass
