"""numguard in a Lightning ``Trainer`` (``pytorch_lightning`` or ``lightning.pytorch``; the
callback is a Callback of whichever is installed, of both when both are):

    from numguard.integrations.lightning import NumguardCallback
    trainer = pl.Trainer(..., callbacks=[NumguardCallback()])

From ``on_fit_start`` the callback watches the LightningModule (``backward=True`` unless told
otherwise). Each ``training_step`` / ``validation_step`` / ``test_step`` / ``predict_step`` is one
numguard batch: under a wrapping strategy (ddp) Lightning already routes the step through the
module's call; on a single device the callback does the same, so the module's own hooks see the
step begin and end. Parameter gradients are checked by numguard's optimizer step pre-hook, which
runs after ``on_before_optimizer_step`` (after Lightning's AMP unscale); a step GradScaler skips
under ``precision="16-mixed"`` is counted, not a trip. Every ``log_every_n_steps`` training
steps the callback logs ``numguard/worst_headroom``, ``numguard/nonfinite`` and
``numguard/skipped_steps`` through ``pl_module.log``. ``teardown`` (or ``on_exception``) closes the inspector.

With ``strategy="ddp"`` every rank learns of a trip at the same check (numguard's cross-rank
exchange), so every rank stops in the same step.
"""
from __future__ import annotations

import importlib

from . import _common

__all__ = ["NumguardCallback"]

_STEPS = ("training_step", "validation_step", "test_step", "predict_step")
_PREFIX = "numguard/"


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


def _through_call(module, name):
    """`module.<name>` routed through ``module(...)`` (the way Lightning's forward redirection
    does for wrapped models), so the module's forward hooks see the step begin and end."""
    method = getattr(module, name)

    def step(*args, **kwargs):
        had_forward = "forward" in module.__dict__
        forward = module.forward

        def redirected(*a, **k):
            _restore_forward(module, had_forward, forward)  # the step may call self(x) itself
            return method(*a, **k)

        module.forward = redirected
        try:
            return module(*args, **kwargs)
        finally:
            _restore_forward(module, had_forward, forward)

    step.__numguard_step__ = method
    return step


def _restore_forward(module, had_forward, forward):
    if had_forward:
        module.forward = forward
    else:
        module.__dict__.pop("forward", None)


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
        self._patched = []
        self._trainer = None

    def on_fit_start(self, trainer, pl_module):
        if self.inspector is not None:
            return
        self._trainer = trainer
        try:
            _common.take_over_from_start_up(pl_module)
            self.inspector = _common.watch(pl_module, self.watch_options, step=self._global_step,
                                           step_label="Lightning global_step")
        except Exception as exc:  # numguard's failure must not stop training
            self.inspector = None
            _common.warn(f"numguard: could not watch {type(pl_module).__name__} ({type(exc).__name__}: "
                         f"{exc}); training goes on unwatched")
            return
        if getattr(trainer.strategy, "model", None) is pl_module:  # no wrapper routes steps through a call
            for name in _STEPS:
                if name in pl_module.__dict__:
                    continue  # an instance attribute is the user's: leave it alone
                pl_module.__dict__[name] = _through_call(pl_module, name)
                self._patched.append((pl_module, name))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        # Nothing to do here: numguard's optimizer pre-hook runs next, inside optimizer.step()
        # (after this hook and after Lightning's AMP unscale), and checks every parameter gradient.
        return None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
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
        """Close the inspector and undo the step routing (teardown does this)."""
        for module, name in self._patched:
            if getattr(module.__dict__.get(name), "__numguard_step__", None) is not None:
                del module.__dict__[name]
        self._patched.clear()
        inspector, self.inspector = self.inspector, None
        if inspector is not None:
            inspector.close(check=False)

    def _global_step(self):
        trainer = self._trainer
        return trainer.global_step if trainer is not None else None
