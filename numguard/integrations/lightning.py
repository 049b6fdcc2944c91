"""numguard in a Lightning ``Trainer`` (``pytorch_lightning`` or ``lightning.pytorch``; the
callback is a Callback of whichever is installed, of both when both are):

    from numguard.integrations.lightning import NumguardCallback
    trainer = pl.Trainer(..., callbacks=[NumguardCallback()])

From ``on_fit_start`` the callback watches the LightningModule (``backward=True`` unless told
otherwise). Each ``training_step`` / ``validation_step`` / ``test_step`` / ``predict_step`` is one
numguard batch, bracketed from Lightning's own batch hooks (``Inspector.batch``): it begins at
``on_*_batch_start`` and ends when the step has returned (``on_before_backward`` for an
automatically optimized training step, ``on_*_batch_end`` otherwise), with the step's result
checked as the module's output, so a loss made NaN outside every submodule is a trip too. Nothing
of the module is rewritten. Parameter gradients are checked by numguard's optimizer step
pre-hook, which runs after ``on_before_optimizer_step`` (after Lightning's AMP unscale); a step
GradScaler skips under ``precision="16-mixed"`` is counted, not a trip. Every
``log_every_n_steps`` training steps the callback logs ``numguard/worst_headroom``,
``numguard/nonfinite`` and ``numguard/skipped_steps`` through ``pl_module.log``. ``teardown`` (or
``on_exception``) closes the inspector.

With ``strategy="ddp"`` every rank learns of a trip at the same check (numguard's cross-rank
exchange), so every rank stops in the same step.
"""
from __future__ import annotations

import importlib

from . import _common

__all__ = ["NumguardCallback"]

_PREFIX = "numguard/"
_STEP_LABEL = "Lightning global_step"


def _callback_bases():
    bases = []
    for package in ("pytorch_lightning", "lightning.pytorch"):
        try:
            bases.append(importlib.import_module(package).Callback)
        except ImportError:
            continue
    if not bases:
        raise ImportError("numguard.integrations.lightning needs pytorch_lightning or lightning "
                          "(pip install pytorch-lightning)")
    return tuple(bases)


class NumguardCallback(*_callback_bases()):
    """A Lightning Callback that watches the LightningModule with numguard.

    Args:
        **watch_options: numguard.watch() options (``on_trip``, ``check``, ``headroom``,
            ``report_to``, ...); ``backward`` defaults to True here. Options left out take their
            NUMGUARD_* variables. Invalid options raise here, not at the first step.

    Attributes:
        inspector: the Inspector between on_fit_start and teardown, else None.
        last_summary: the numbers logged last.
    """

    def __init__(self, **watch_options):
        _common.resolve_options(watch_options)  # fail now, naming the bad option
        self.watch_options = dict(watch_options)
        self.inspector = None
        self.last_summary = {}
        self._bracket = None      # the running step's numguard batch (Inspector.batch)
        self._routed = False      # Lightning runs the steps through the module's call (a wrapping strategy)

    def on_fit_start(self, trainer, pl_module):
        if self.inspector is not None:
            return
        try:
            _common.take_over_from_start_up(pl_module)
            self.inspector = _common.watch(pl_module, self.watch_options)
        except Exception as exc:  # numguard's failure must not stop training
            self.inspector = None
            _common.warn(f"numguard: could not watch {type(pl_module).__name__} ({type(exc).__name__}: "
                         f"{exc}); training goes on unwatched")
            return
        # A wrapping strategy (ddp) already runs each step through the module's call, whose hooks
        # record its inputs and result: the bracket then only marks the batch.
        self._routed = getattr(trainer.strategy, "model", None) is not pl_module

    # -- one numguard batch per step --------------------------------------------------------------
    def _begin(self, trainer, inputs):
        if self.inspector is None:
            return
        self._end()  # a step Lightning skipped after its start hook (on_train_batch_start's -1)
        try:
            self._bracket = self.inspector.batch(step=trainer.global_step, label=_STEP_LABEL,
                                                 inputs=() if self._routed else inputs).begin()
        except Exception as exc:  # numguard's failure must not stop training
            _common.warn(f"numguard: could not begin the batch ({type(exc).__name__}: {exc}); its modules "
                         "are still watched")

    def _end(self, *output):
        bracket, self._bracket = self._bracket, None
        if bracket is not None:
            bracket.end(*(() if self._routed else output))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._begin(trainer, {"batch": batch, "batch_idx": batch_idx})  # as Lightning calls training_step

    def on_before_backward(self, trainer, pl_module, loss):
        if pl_module.automatic_optimization:  # a manual step calls backward inside training_step
            self._end(loss)

    def on_validation_batch_start(self, trainer, pl_module, *step_args):
        self._begin(trainer, step_args)

    def on_validation_batch_end(self, trainer, pl_module, outputs, *step_args):
        self._end(outputs)

    on_test_batch_start = on_predict_batch_start = on_validation_batch_start
    on_test_batch_end = on_predict_batch_end = on_validation_batch_end

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        # Nothing to do here: numguard's optimizer pre-hook runs next, inside optimizer.step()
        # (after this hook and after Lightning's AMP unscale), and checks every parameter gradient.
        return None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._end(outputs)  # a manual step, or one that returned no loss (no backward)
        if self.inspector is None:
            return
        every = max(1, int(getattr(trainer, "log_every_n_steps", 50) or 1))
        if trainer.global_step % every:
            return
        summary = {_PREFIX + key: value for key, value in _common.numerics_summary(self.inspector).items()}
        self.last_summary = summary
        try:
            pl_module.log_dict(summary, on_step=True, on_epoch=False, prog_bar=False,
                               logger=bool(getattr(trainer, "loggers", None)))
        except Exception as exc:  # a logger problem is not a reason to stop training
            _common.warn(f"numguard: could not log the numerics summary ({type(exc).__name__}: {exc})")

    def teardown(self, trainer, pl_module, stage):
        self.close()

    def on_exception(self, trainer, pl_module, exception):
        # Lightning skips the teardown hooks when fit raises (a NonFiniteError included).
        self.close()

    def close(self):
        """Close the inspector (teardown does this)."""
        self._bracket = None
        inspector, self.inspector = self.inspector, None
        if inspector is not None:
            inspector.close(check=False)
