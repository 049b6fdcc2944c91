"""The module hooks of an Inspector (no host sync in here): the root's and top modules' hooks that
track the forward's depth and end batches, and the per-module hook that records a frame.

A module called outside the root's forward becomes a "top" module: its own return ends a check,
so its NaN is never left waiting for a root call that may not come.
"""
from __future__ import annotations

import functools
import sys
import threading
import weakref

import torch

from . import frames as _frames
from . import graph as _graph

active: list = []  # inspectors inside a watched forward (for detect_overflow)
_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_ONE_IN_ONE_OUT_LABELS = _frames.ONE_IN_ONE_OUT_LABELS
_ONE_IN_ONE_OUT_KINDS = _frames.ONE_IN_ONE_OUT_KINDS


class BatchState:
    """Where an Inspector's batch stands, the state its hooks share (and the native recorder's
    fast path reads, by these public names: csrc/recorder.cpp)."""
    __slots__ = ("closed", "open", "depth", "done")

    def __init__(self):
        self.closed = False  # the Inspector was closed: every hook does nothing
        self.open = False    # a batch has begun and not ended
        self.depth = 0       # watched top-module forwards running (nested calls included)
        self.done = 0        # batches finished (the running batch's number)


class ModuleHooks:
    """Hook installation and the hooks themselves, for the Inspector. They use its `_ring`,
    `options`, `_owners`, `_module_names`, `_handles`, `_batch` (a BatchState),
    `_thread`, `_reader` (the step time's clock), `_child_hooks` and `_first_child`, and call its
    batch life cycle: `_begin_batch`, `_end_batch`,
    `_end_direct_call`, `_after_raised_forward`, `_guarded` and `_warn_once`."""

    def _install_hooks(self, model):
        headroom = self.options.headroom
        root_seen = False
        for name, module in model.named_modules():
            owner = _frames.Owner(len(self._owners), name, module.__class__.__name__, weakref.ref(module),
                                  headroom=headroom)
            self._owners.append(owner)
            self._module_names[module] = name
            if module is model and not root_seen:
                owner.is_root = owner.is_top = True
                root_seen = True
                self._root_owner = owner
                # NOTE: [compile] The root's hooks run outside any torch.compile graph (the batch-end
                # read must not break a graph in the middle); inner hooks record into the graph.
                self._handles.append(module.register_forward_pre_hook(
                    torch.compiler.disable(functools.partial(self._top_pre_hook, owner))))
                self._handles.append(module.register_forward_hook(
                    torch.compiler.disable(functools.partial(self._root_hook, owner)), with_kwargs=True))
                self._add_after_hook(owner, module)
                self._time_first_child(module)
            else:
                # Without operation mode: the native fast path first, else the module hook itself.
                hook = (functools.partial(self._hook, owner) if self._ops is not None
                        else self._fast_module_hook(owner))
                self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
                if self._ops is not None:
                    # Operation mode names the module whose forward runs each operation.
                    self._handles.append(module.register_forward_pre_hook(
                        functools.partial(_ops_push, self._ops, owner)))
                    self._handles.append(module.register_forward_hook(
                        functools.partial(_ops_pop, self._ops, owner), always_call=True))

    def _time_first_child(self, model):
        """A pre-hook on the root's children: the step time starts the forward's clock at its first
        child (NOTE: [step time] in checks.py). After the first batch only the hook of the child
        that came first stays."""
        for child in model.children():
            handle = child.register_forward_pre_hook(functools.partial(self._child_pre_hook, id(child)))
            self._handles.append(handle)
            self._child_hooks.append((id(child), handle))

    def _child_pre_hook(self, key, module, args):
        if self._batch.depth != 1 or _is_compiling():  # only inside the root's eager forward
            return None
        if self._first_child is None:
            self._first_child = key
        if key == self._first_child:
            self._reader.inner_forward_started()
        return None

    def _keep_first_child_hook(self):
        """Drop the pre-hooks of the root's children other than the one that came first."""
        if self._first_child is None or len(self._child_hooks) < 2:
            return
        for key, handle in self._child_hooks:
            if key != self._first_child:
                handle.remove()
        self._child_hooks = [(k, h) for k, h in self._child_hooks if k == self._first_child]

    def _add_after_hook(self, owner, module):
        # NOTE: [forward raised] Runs after the returned-hook on a normal return, alone when the
        # forward raised. Whether an exception is being handled says nothing: a healthy model may
        # be called inside a user's `except` block.
        self._handles.append(module.register_forward_hook(
            torch.compiler.disable(functools.partial(self._top_after_hook, owner)), always_call=True))

    def _make_top(self, owner, module):
        """A module called outside the root's forward becomes a top module of its own: from its
        next call on, its return ends a check like the root's (without counting a batch)."""
        owner.is_top = True
        self._handles.append(module.register_forward_pre_hook(
            torch.compiler.disable(functools.partial(self._top_pre_hook, owner))))
        self._handles.append(module.register_forward_hook(
            torch.compiler.disable(functools.partial(self._top_returned_hook, owner))))
        self._add_after_hook(owner, module)

    def _top_pre_hook(self, owner, module, args):
        if self._batch.depth == 0:
            self._thread = threading.get_ident()
            if owner.is_root:
                self._reader.forward_started()
            if not self._batch.open:
                self._begin_batch()
            if self not in active:
                active.append(self)
            if self._ops is not None:
                self._ops_call("start", owner)
        elif self._thread != threading.get_ident():
            self._warn_once("threads", "numguard: the watched model is being called from several threads at "
                            "once; one Inspector counts batches for one thread, so batch numbers and the "
                            "module blamed for a trip may be wrong. Watch a separate model object per thread.")
        self._batch.depth += 1

    def _leave_top(self):
        self._batch.depth = max(0, self._batch.depth - 1)
        if self._batch.depth == 0:
            if self in active:
                active.remove(self)
            if self._ops is not None:
                self._ops_call("stop")
        return self._batch.depth == 0

    def _ops_call(self, what, *args):
        """Start or stop operation mode; its failure switches it off, never the job."""
        try:
            getattr(self._ops, what)(*args)
        except Exception as exc:
            self._ops_failed(exc)

    def _ops_failed(self, exc):
        self._ops.off = True
        self._warn_once(("ops",), f"numguard: operation mode stopped after an internal error "
                                  f"({type(exc).__name__}: {exc}); modules are still watched")

    def _root_hook(self, owner, module, args, kwargs, output):
        owner.returned = True
        self._hook(owner, module, args, kwargs, output)
        if self._leave_top():
            self._end_batch()
        return None

    def _top_returned_hook(self, owner, module, args, output):
        owner.returned = True
        if self._leave_top():
            self._end_direct_call(owner)
        return None

    def _top_after_hook(self, owner, module, args, output):
        if owner.returned:
            owner.returned = False
            return None
        # The forward raised (NOTE: [forward raised]): the batch did not finish.
        if self._leave_top():
            self._guarded(self._after_raised_forward, sys.exc_info()[1])
        return None

    def _hook(self, owner, module, args, kwargs, output):
        ops = self._ops
        if ops is None:
            return self._module_hook(owner, module, args, kwargs, output)
        ops.paused += 1  # numguard's own recording is not an operation of the model
        try:
            return self._module_hook(owner, module, args, kwargs, output)
        finally:
            ops.paused -= 1

    def _fast_module_hook(self, owner):
        """The forward hook of a module: the ring's native fast path for the steady-state call (one
        tensor in, one out, inside the root's forward), else _module_hook. Under torch.compile
        only _module_hook is traced (NOTE: [compile])."""
        ring = self._ring
        batch = self._batch
        slow = self._module_hook

        def hook(module, args, kwargs, output):
            if not _is_compiling():
                try:
                    if ring.module_call(owner, batch, args, kwargs, output):
                        return None
                except Exception as exc:  # numguard's own failure must not kill the job
                    self._disable(owner, exc)
                    return None
            return slow(owner, module, args, kwargs, output)

        hook.__wrapped__ = functools.partial(slow, owner)  # says whose hook it is, like the other hooks
        return hook

    def _module_hook(self, owner, module, args, kwargs, output):
        if owner.off or self._batch.closed:
            return None
        if _is_compiling():
            # Traced into the graph: one recording op per call (numguard.inspector.graph).
            return _graph.record_in_graph(self, owner, args, kwargs, output)
        try:
            if not self._batch.open:
                # A module frame outside the root's forward (a submodule called directly) opens the
                # batch: its weights are those of now.
                self._begin_batch()
            # The root's and top modules' frames end a check: recorded afresh (NOTE: [fresh frames]).
            fresh = owner.is_top or self._batch.depth == 0
            # NOTE: [context records] In watch() a module's inputs trip only with a non-finite output.
            context_inputs = not self._ring.inputs_trip
            if not kwargs and len(args) == 1 and type(output) is _Tensor and type(args[0]) is _Tensor:
                # Fast path: one positional tensor in, one tensor out (Linear, LayerNorm, Dropout, ...).
                self._ring.record(owner, [args[0], output], _ONE_IN_ONE_OUT_LABELS, _ONE_IN_ONE_OUT_KINDS,
                                  "forward", True, True, self._batch.done, None, fresh, int(context_inputs))
            else:
                xs, labels, kinds, n_inputs = _frames.flatten_call(args, kwargs, output)
                self._ring.record(owner, xs, labels, kinds, "forward", True, True, self._batch.done, None, fresh,
                                  n_inputs if context_inputs else 0)
        except Exception as exc:  # numguard's own failure must not kill the job
            self._disable(owner, exc)
        if self._batch.depth == 0 and not owner.is_top:
            # Called outside the root's forward (e.g. model.encoder(x) directly).
            try:
                self._make_top(owner, module)
            except Exception as exc:
                self._disable(owner, exc)
            self._end_direct_call(owner)
        return None

    def _disable(self, owner, exc):
        owner.off = True
        name = owner.name or "(root module)"
        self._warn_once(("module", owner.index, owner.name),
                        f"numguard: stopped watching module {name!r} ({owner.cls}) after an internal error: "
                        f"{type(exc).__name__}: {exc}. Training goes on; the other modules are still watched.")


def _ops_push(ops, owner, module, args):
    ops.push(owner)


def _ops_pop(ops, owner, module, args, output):
    ops.pop(owner)
