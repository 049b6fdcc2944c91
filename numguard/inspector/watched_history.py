"""The history feature of an Inspector: the per-module device history (numguard.inspector.history)
folded at each healthy check, the spike detector that reads it (numguard.inspector.spikes,
spikes=...), and what they give the user: ``advice()``, ``history()``, ``spikes()`` and the
"history" field of a trip's report."""
from __future__ import annotations

import warnings

import torch

from .. import process as _process
from ..errors import SpikeError, SpikeWarning
from . import spikes as _spikes
from .features import Feature
from .graph import GraphBlindWarning
from .history import ModuleHistory


class HistoryFeature(Feature):
    """Built by every Inspector (advice is always available); the detector only with spikes=."""

    def __init__(self, inspector, device, spikes=None):
        self.inspector = inspector
        self.history = ModuleHistory(inspector._owners, device)
        self.spikes = _spikes.SpikeDetector(spikes) if spikes else None
        self.graph_blind = GraphBlindWarning(   # says once what torch.compile hides
            "spikes", "which keep no values of their own in the history: a spike made there is named at the "
            "compiled module's output, not at the module that made it. Watch the model uncompiled to have it "
            "named there.")
        if self.spikes is not None:
            model = inspector._model_ref()
            # Before the inspector's own root hook, which ends the batch and checks it.
            inspector._handles.append(model.register_forward_hook(
                torch.compiler.disable(self._root_returned), prepend=True))
            self.spikes.root = next((o for o in inspector._owners if o.is_root), None)

    def _root_returned(self, module, args, output):
        insp = self.inspector
        if self.spikes is None or self.spikes.root is None or self.history is None or insp._batch.depth != 1 \
                or insp._batch.closed:
            return None
        try:
            history = self.history
            self.spikes.note_loss(output, insp._batch.done % history.window, history.window, history.table.device)
        except Exception as exc:  # the loss is lost, never the job
            insp._warn_once(("spikes", "loss"), f"numguard: loss spikes are not watched after an internal "
                                                f"error ({type(exc).__name__}: {exc})")
            self.spikes.root = self.spikes.loss = None
        return None

    def parameter_gradients(self, labels, grads):
        insp = self.inspector
        if self.spikes is None or self.history is None or not insp._batch.done or not self.spikes.watch_norms:
            return
        try:
            history = self.history
            self.spikes.note_gradients(labels, grads, (insp._batch.done - 1) % history.window, history.window,
                                       history.table.device)
        except Exception as exc:  # the norms are lost, never the job
            insp._warn_once(("spikes", "norms"), f"numguard: gradient norm spikes are not watched after an "
                                                 f"internal error ({type(exc).__name__}: {exc})")
            self.spikes.watch_norms = False

    def end_batch(self, batch):
        if self.spikes is not None:
            self.graph_blind.check(self.inspector)

    def device_moved(self, device):
        if self.history is not None:
            self.history.move_to(device)

    def check_read(self, status):
        """A spike the check read (NOTE: [spike rule]): re-arm the words, then warn or raise."""
        if self.spikes is None or not status.values[_spikes.SPIKE_CODE]:
            return
        insp = self.inspector
        spike = self.spikes.read(status.values, insp._owners, _process.rank(default=None))
        insp._ring.state_buf[_spikes.SPIKE_WORDS].fill_(0)
        if spike is None:
            return
        attribution, why_none = self._rerun(spike)
        text = _spikes.message(spike) + (f"; rerun verdict: {attribution}" if attribution is not None else
                                         f"; no rerun verdict: {why_none}" if why_none else "")
        if self.spikes.mode == "raise":
            raise SpikeError(text, spike, attribution)
        warnings.warn(SpikeWarning(text, spike, attribution), stacklevel=2)

    def _rerun(self, spike):
        """With rerun=True, (the verdict of a rerun of the spiked batch, why there is none)
        (numguard.inspector.rerun)."""
        rerun = getattr(self.inspector, "_rerun", None)
        if rerun is None:
            return None, ""
        owner = next((o for o in self.inspector._owners if o.name == spike.get("module")), None)
        try:
            return rerun.rerun_spike(spike, owner.ref() if owner is not None and owner.ref is not None else None)
        except Exception as exc:  # the verdict is lost, never the spike
            self.inspector._warn_once(("rerun", "spike"), f"numguard: the rerun of a spike failed "
                                                          f"({type(exc).__name__}: {exc})")
            return None, ""

    def frames_confirmed(self, ring, start, boundary):
        if self.history is None:
            return
        try:
            self.history.fold(ring, start, boundary)
        except Exception as exc:  # advice is lost, never the job
            self.history = self.spikes = None
            self.inspector._warn_once(("history",), f"numguard: the per-module history stopped after an internal "
                                                    f"error ({type(exc).__name__}: {exc}); advice() has no data "
                                                    "from now on")
            return
        if self.spikes is not None:
            try:
                self.spikes.after_fold(self.history, ring.state_buf, ring.frames[start:boundary])
            except Exception as exc:  # spikes are lost, never the job
                self.spikes = None
                self.inspector._warn_once(("spikes",), f"numguard: spike detection stopped after an internal "
                                                       f"error ({type(exc).__name__}: {exc}); NaN/Inf are still "
                                                       "watched")

    def annotate_report(self, report, offender, frames):
        if self.history is not None:
            report["history"] = self.to_dict()

    def to_dict(self) -> dict:
        """The history as plain data (the "history" field of a dump), with the loss scale the
        gradients were seen at (GradScaler's when backward=True saw one; else assumed 1)."""
        if self.history is None:
            return {"window": 0, "batches": [], "modules": []}
        data = self.history.to_dict()
        scale, source = None, "assumed"
        scaler = getattr(self.inspector.backward_watcher, "last_scaler", None)
        scaler = scaler() if scaler is not None else None
        if scaler is not None and scaler.is_enabled():
            scale, source = float(scaler.get_scale()), "GradScaler"
        data["loss_scale"], data["loss_scale_source"] = scale, source
        quant = getattr(self.inspector, "_quant", None)
        if quant is not None:  # quant=: the what-if table advice reads
            data["quant"] = quant.to_dict()
        return data

    def found_spikes(self) -> list:
        return [] if self.spikes is None else list(self.spikes.found)


__all__ = ["HistoryFeature"]
