"""Drop-ins for Transformers' debug helpers: ``DebugUnderflowOverflow`` (an Inspector that prints,
raises and counts like Transformers' class) and ``detect_overflow``."""
from __future__ import annotations

import collections
import sys
import warnings

import torch

from .. import ops, schema
from .. import report as _report
from ..errors import InspectorWarning
from . import core
from .frames import EXTRA, TENSOR


class DebugUnderflowOverflow(core.Inspector):
    """Drop-in for ``transformers.debug_utils.DebugUnderflowOverflow``: the same signature, the
    same printed lines (nothing added), the same exception texts and the same public attributes
    (``batch_number`` counts finished batches, ``detected_overflow``, ``total_calls``, ``frames``,
    ``prefix``), from numguard's sync-free device-side recording.

    numguard's extras are options here, off by default: ``extras=True`` (keyword inputs, nested
    outputs and numguard's own report sections), ``headroom=0.5`` (warnings before fp16/bf16
    overflow), and every other ``watch()`` option.

    One deliberate difference: after a traced batch, Transformers' frame buffer loses its size
    limit (it becomes a list), so its next report, and its ``frames``, hold every frame since the
    trace; numguard keeps the last ``max_frames_to_save``, printed exactly as Transformers prints
    them. Keeping them all would grow memory for the rest of the job. And a NaN inside a traced
    batch is raised at that batch's end (after its trace), not at the next batch's first module."""

    prefix = " " * 17
    _batch_offset = 0

    def __init__(self, model, max_frames_to_save=21, trace_batch_nums=None, abort_after_batch_num=None, *,
                 extras=False, headroom=0.0, **options):
        super().__init__(model, max_frames_to_save, trace_batch_nums or [], abort_after_batch_num,
                         extras=extras, headroom=headroom, **options)
        self._reporter.trip_message = (
            "DebugUnderflowOverflow: inf/nan detected, aborting as there is no point running further. "
            "Please scroll up above this traceback to see the activation values prior to this event.")
        self.trace_batch_nums = list(trace_batch_nums or [])  # as given, like Transformers keeps it
        self._model = model  # a strong reference, like Transformers' `model` attribute

    @property
    def model(self):
        return self._model

    @property
    def batch_number(self) -> int:
        """Batches finished so far (Transformers' meaning: the batch running now, 0-indexed)."""
        return self._batches_done - self._batch_offset

    @property
    def detected_overflow(self) -> bool:
        """Whether a NaN/Inf has been detected."""
        return self.trips > 0

    @property
    def total_calls(self) -> int:
        """Module forward calls recorded so far."""
        return self._ring.hf_calls

    @property
    def frames(self):
        """The last `max_frames_to_save` frames as Transformers' text blocks. Reading it copies the
        ring to the host (one device->host copy), so it is for inspection, not for every step."""
        ring = self._ring
        kept = [f for f in ring.frames[ring.floor:] if f.hf and f.section == "forward"]
        kept = kept[-self.max_frames_to_save:]
        texts = collections.deque([], self.max_frames_to_save)
        if kept:
            host_ring = ring.host_copy()
            tables = self._weights.host_tables({f.batch for f in kept})
            for f in kept:
                texts.append(_report.frame_text(self._reporter.frame_record(f, host_ring, tables, ring.pos), False))
        return texts

    def _trip_reported(self, report, frames_after):
        # Transformers raises inside the offending module's hook: its counters stop there.
        self._batch_offset = self._batches_done - report["batch_number"]
        self._ring.hf_calls -= frames_after

    def _abort_message(self, batch):
        return (f"DebugUnderflowOverflow: aborting after {self._batches_done} batches due to "
                f"`abort_after_batch_num={self.abort_after_batch_num}` arg")


def _current_module(inspector):
    frame = sys._getframe(2)
    names = inspector.module_names
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, torch.nn.Module) and candidate in names:
            return candidate
        frame = frame.f_back
    return None


def _record_detect(inspector, var, ctx, module):
    name = inspector.module_names.get(module) if module is not None else None
    owners = inspector._owners
    owner = next((o for o in owners if o.name == name), inspector._root_owner) if name is not None \
        else inspector._root_owner
    inspector._ring.record(owner, [var], [str(ctx)], [TENSOR | EXTRA], "forward", False, False,
                           inspector._batch_index())


def detect_overflow(var, ctx) -> bool:
    """Inside a watched forward: record `var` as a line labelled `ctx` of the module whose forward
    is running (no host sync; returns False, the check happens at batch end). Outside: like
    Transformers' helper, print "<ctx> has nans" / "<ctx> has infs" and return whether either was
    found."""
    if core.active and isinstance(var, torch.Tensor):
        inspector = core.active[-1]
        try:
            _record_detect(inspector, var, ctx, _current_module(inspector))
            return False
        except Exception as exc:
            warnings.warn(f"numguard.detect_overflow: could not record {ctx!r} ({exc}); checking it now",
                          InspectorWarning, stacklevel=2)
    stats = ops.tensor_stats(var).tolist()
    detected = False
    if stats[schema.NAN] > 0:
        detected = True
        print(f"{ctx} has nans")
    if stats[schema.POS_INF] + stats[schema.NEG_INF] > 0:
        detected = True
        print(f"{ctx} has infs")
    return detected
