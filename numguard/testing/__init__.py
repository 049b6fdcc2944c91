"""Tools for checking numguard's promises in tests and benchmarks: a host-sync counter, and the
fault-injection harness (numguard.testing.faults)."""
from __future__ import annotations

import contextlib
import os
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_NUMGUARD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_THIS_FILE = os.path.abspath(__file__)  # the counter's own frames are not numguard's work

__all__ = ["SyncCounter"]


class SyncCounter:
    """Counts host syncs: aten._local_scalar_dense (dispatch mode) and Tensor.item / tolist /
    __bool__ / __float__ / __int__ / cpu / numpy (function mode). Each event is attributed to
    numguard (a numguard frame on the stack) and, within numguard, to a hook or to a batch end."""

    FUNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
             torch.Tensor.__int__, torch.Tensor.cpu, torch.Tensor.numpy}
    # numguard's functions that run at a check (a batch end, a direct call's end, close(), the
    # optimizer step): a sync under one of them is a check's read, not a hook's.
    BATCH_END = {"end_batch", "end_direct_call", "after_raised_forward", "check", "check_now", "close",
                 "forget_trip_from", "read_now", "read_async", "read_local"}

    def __init__(self):
        self.total = 0
        self.numguard = 0
        self.in_hooks = 0
        self.where = []

    def event(self, what):
        self.total += 1
        frame = sys._getframe(2)
        ours = False
        batch_end = False
        while frame is not None:
            filename = frame.f_code.co_filename
            if filename.startswith(_NUMGUARD_DIR) and filename != _THIS_FILE:
                ours = True
                if frame.f_code.co_name in self.BATCH_END:
                    batch_end = True
            frame = frame.f_back
        if ours:
            self.numguard += 1
            if not batch_end:
                self.in_hooks += 1
            self.where.append(what)

    @contextlib.contextmanager
    def __call__(self):
        counter = self

        class _Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default:
                    counter.event("_local_scalar_dense")
                return func(*args, **(kwargs or {}))

        class _Function(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func in SyncCounter.FUNCS:
                    counter.event(getattr(func, "__name__", str(func)))
                return func(*args, **(kwargs or {}))

        with _Function(), _Dispatch():
            yield self
