"""Drop-ins for Transformers' debug helpers: ``DebugUnderflowOverflow`` (an Inspector that prints,
raises and counts like Transformers' class) and ``detect_overflow``."""
from __future__ import annotations

import collections
import sys
import warnings

import torch

from .. import ops, schema
from .. import report as _report
from ..errors import AbortAfterBatch, InspectorWarning, NonFiniteError
from . import core
from .frames import EXTRA, TENSOR, Owner


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
    _inputs_trip = True  # Transformers' rule: a module's non-finite input trips by itself

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
        return self._batch.done - self._batch_offset

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
                texts.append(_report.frame_text(self._reporter.builder.frame_record(f, host_ring, tables, ring.pos), False))
        return texts

    def _trip_reported(self, report, frames_after):
        # Transformers raises inside the offending module's hook: its counters stop there.
        self._batch_offset = self._batch.done - report["batch_number"]
        self._ring.hf_calls -= frames_after

    def _abort_message(self, batch):
        return (f"DebugUnderflowOverflow: aborting after {self._batch.done} batches due to "
                f"`abort_after_batch_num={self.abort_after_batch_num}` arg")



def _plain_value_error(call, args):
    """`call(*args)`, with numguard's trip and abort errors raised as the plain ValueError of the
    same text that Transformers raises (the numguard error stays reachable as ``__context__``)."""
    try:
        return call(*args)
    except (NonFiniteError, AbortAfterBatch) as exc:
        raise ValueError(str(exc)) from None


class TransformersDebugUnderflowOverflow(DebugUnderflowOverflow):
    """The drop-in as it serves ``Trainer(debug="underflow_overflow")`` in a ``NUMGUARD=1`` job,
    where the script never named numguard: what it prints and the exceptions it raises are
    Transformers' own, down to their type (``ValueError``, not a subclass, as a traceback, a log
    grep or ``type(e) is ValueError`` sees it). The NonFiniteError with numguard's report is the
    exception's ``__context__`` (not printed)."""

    class _hooks_class(core.ModuleHooks):
        """Its module hooks: the same, with numguard's trip and abort raised as plain ValueErrors."""

        def root_hook(self, *args):
            return _plain_value_error(super().root_hook, args)

        def top_returned_hook(self, *args):
            return _plain_value_error(super().top_returned_hook, args)

        def module_hook(self, *args):
            return _plain_value_error(super().module_hook, args)


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
    """A watch(extras=True) report's own line for a detect_overflow call, in a frame of the module
    whose forward called it. It does not trip the ring: the check already happened on the host
    (Transformers' rule: detect_overflow prints, the module frames trip), and a trip on this
    record would freeze the ring before the module frame that a report must end with."""
    name = inspector.module_names.get(module) if module is not None else None
    if name is None:
        name, cls = "", type(inspector.model).__name__
    else:
        cls = type(module).__name__
    key = ("detect_overflow", name, cls)
    owner = inspector._named.get(key)
    if owner is None:  # index -1: numguard's own lines, not part of the module's history
        owner = inspector._named[key] = Owner(-1, name, cls)
    ring = inspector._ring
    with torch.inference_mode(False):
        state = torch.tensor(schema.STATE_INITIAL, dtype=torch.int64, device=ring.device)
    ring.record(owner, [var], [str(ctx)], [TENSOR | EXTRA], "forward", False, False, inspector._batch_index(),
                state)


def _has_nans_and_infs(var):
    """(any NaN, any Inf) of `var`: one stats launch and one device->host read (Transformers' helper
    makes two), or torch's own isnan / isinf for what the kernels do not take."""
    try:
        stats = ops.tensor_stats(var.detach()).tolist()
    except Exception:
        return bool(torch.isnan(var).any().item()), bool(torch.isinf(var).any().item())
    return stats[schema.NAN] > 0, stats[schema.POS_INF] + stats[schema.NEG_INF] > 0


def detect_overflow(var, ctx) -> bool:
    """Transformers' ``detect_overflow``, inside a watched forward too: check `var` now, print
    "<ctx> has nans" / "<ctx> has infs" for what it holds and return whether it holds either.
    Like Transformers' helper it waits for the device (it is the check you asked for at that
    spot); the module hooks stay free of host syncs. Inside a ``watch(extras=True)`` forward the
    value is also a line of the report, in a frame of the module that called it; it trips
    nothing by itself (the module frames do, as in Transformers)."""
    if not isinstance(var, torch.Tensor):
        raise TypeError(f"numguard.detect_overflow({ctx!r}): var must be a torch.Tensor, got "
                        f"{type(var).__name__}")
    inspector = core.active[-1] if core.active else None
    recorder = getattr(inspector, "_ops", None)
    if recorder is not None:
        recorder.paused += 1  # numguard's own check is not an operation of the model
    try:
        nans, infs = _has_nans_and_infs(var)
        if inspector is not None and inspector.options.extras and not inspector._batch.closed:
            try:
                _record_detect(inspector, var, ctx, _current_module(inspector))
            except Exception as exc:  # the check above stands; only the report line is lost
                warnings.warn(f"numguard.detect_overflow: could not add {ctx!r} to the report ({exc})",
                              InspectorWarning, stacklevel=2)
    finally:
        if recorder is not None:
            recorder.paused -= 1
    if nans:
        print(f"{ctx} has nans")
    if infs:
        print(f"{ctx} has infs")
    return nans or infs
