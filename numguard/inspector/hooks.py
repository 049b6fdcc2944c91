"""The module hooks of an Inspector (no host sync in here) and the batch state they share: the
root's and top modules' hooks that track the forward's depth and end batches, the per-module hook
that records a frame, and the public batch bracket (``Inspector.batch``) by which a framework's own
batch hooks begin and end a batch instead.

A module called outside the root's forward becomes a "top" module: its own return ends a check,
so its NaN is never left waiting for a root call that may not come.

The hooks call the batch life cycle (numguard.inspector.cycle.BatchCycle) at the points they see:
``begin_batch``, ``end_batch``, ``end_direct_call``, ``after_raised_forward``.
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
_NOTHING = object()


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
    """The hooks of one Inspector on its model's modules, and what they hold: the batch state
    (``batch``), the modules' owners and names, the handles to remove at close.

    Args:
        inspector: the Inspector (put on ``active`` while its forward runs; frames inside compiled
            graphs are recorded through it).
        cycle: the batch life cycle the hooks call (numguard.inspector.cycle.BatchCycle), with the
            ring frames are recorded into and the reader whose clock times the step.
        batch: the BatchState, shared with the cycle.
        owners: the list that gets one Owner per module, in named_modules order (the weight
            table's too).
        headroom: watch()'s headroom option, for each module's Owner.
        ops: the OperationRecorder of ops=True, or None.
    """

    def __init__(self, inspector, cycle, batch, owners, headroom, ops=None):
        self.inspector = inspector
        self.cycle = cycle
        self.ring = cycle.ring
        self.reader = cycle.reader                     # NOTE: [step time] in checks.py
        self.batch = batch
        self.headroom = headroom
        self.ops = ops
        self.owners = owners
        self.module_names = weakref.WeakKeyDictionary()
        self.handles = []                              # removed at close
        self.root_owner = None
        self.root_ref = None
        self.thread = None                             # the thread running the watched forward
        self.child_hooks = []                          # pre-hooks timing the root's first child
        self.first_child = None
        self.bracketing = False                        # a batch bracket is beginning a batch now

    def install(self, model):
        headroom = self.headroom
        root_seen = False
        for name, module in model.named_modules():
            owner = _frames.Owner(len(self.owners), name, module.__class__.__name__, weakref.ref(module),
                                  headroom=headroom)
            self.owners.append(owner)
            self.module_names[module] = name
            if module is model and not root_seen:
                owner.is_root = owner.is_top = True
                root_seen = True
                self.root_owner = owner
                self.root_ref = owner.ref
                # NOTE: [compile] The root's hooks run outside any torch.compile graph (the batch-end
                # read must not break a graph in the middle); inner hooks record into the graph.
                self.handles.append(module.register_forward_pre_hook(
                    torch.compiler.disable(functools.partial(self.top_pre_hook, owner))))
                self.handles.append(module.register_forward_hook(
                    torch.compiler.disable(functools.partial(self.root_hook, owner)), with_kwargs=True))
                self._add_after_hook(owner, module)
                self._time_first_child(module)
            else:
                # Without operation mode: the native fast path first, else the module hook itself.
                hook = (functools.partial(self.hook, owner) if self.ops is not None
                        else self._fast_module_hook(owner))
                self.handles.append(module.register_forward_hook(hook, with_kwargs=True))
                if self.ops is not None:
                    # Operation mode names the module whose forward runs each operation.
                    self.handles.append(module.register_forward_pre_hook(
                        functools.partial(_ops_push, self.ops, owner)))
                    self.handles.append(module.register_forward_hook(
                        functools.partial(_ops_pop, self.ops, owner), always_call=True))

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _time_first_child(self, model):
        """A pre-hook on the root's children: the step time starts the forward's clock at its first
        child (NOTE: [step time] in checks.py). After the first batch only the hook of the child
        that came first stays."""
        for child in model.children():
            handle = child.register_forward_pre_hook(functools.partial(self._child_pre_hook, id(child)))
            self.handles.append(handle)
            self.child_hooks.append((id(child), handle))

    def _child_pre_hook(self, key, module, args):
        if self.batch.depth != 1 or _is_compiling():  # only inside the root's eager forward
            return None
        if self.first_child is None:
            self.first_child = key
        if key == self.first_child:
            self.reader.inner_forward_started()
        return None

    def keep_first_child_hook(self):
        """Drop the pre-hooks of the root's children other than the one that came first."""
        if self.first_child is None or len(self.child_hooks) < 2:
            return
        for key, handle in self.child_hooks:
            if key != self.first_child:
                handle.remove()
        self.child_hooks = [(k, h) for k, h in self.child_hooks if k == self.first_child]

    def _add_after_hook(self, owner, module):
        # NOTE: [forward raised] Runs after the returned-hook on a normal return, alone when the
        # forward raised. Whether an exception is being handled says nothing: a healthy model may
        # be called inside a user's `except` block.
        self.handles.append(module.register_forward_hook(
            torch.compiler.disable(functools.partial(self.top_after_hook, owner)), always_call=True))

    def _make_top(self, owner, module):
        """A module called outside the root's forward becomes a top module of its own: from its
        next call on, its return ends a check like the root's (without counting a batch)."""
        owner.is_top = True
        self.handles.append(module.register_forward_pre_hook(
            torch.compiler.disable(functools.partial(self.top_pre_hook, owner))))
        self.handles.append(module.register_forward_hook(
            torch.compiler.disable(functools.partial(self.top_returned_hook, owner))))
        self._add_after_hook(owner, module)

    # -- entering and leaving the root's forward (or a batch bracket) -----------------------------
    def top_pre_hook(self, owner, module, args):
        batch = self.batch
        if batch.depth == 0:
            self.thread = threading.get_ident()
            if owner.is_root:
                self.reader.forward_started()
            if not batch.open:
                self.cycle.begin_batch()
            if self.inspector not in active:
                active.append(self.inspector)
            if self.ops is not None:
                self.ops_call("start", owner)
        elif self.thread != threading.get_ident():
            self.cycle.warn_once("threads", "numguard: the watched model is being called from several threads at "
                                 "once; one Inspector counts batches for one thread, so batch numbers and the "
                                 "module blamed for a trip may be wrong. Watch a separate model object per thread.")
        batch.depth += 1

    def _leave_top(self):
        batch = self.batch
        batch.depth = max(0, batch.depth - 1)
        if batch.depth == 0:
            if self.inspector in active:
                active.remove(self.inspector)
            if self.ops is not None:
                self.ops_call("stop")
        return batch.depth == 0

    def _end_root_call(self):
        if self._leave_top():
            self.reader.forward_ended()  # host step time for the cross-rank numbers
            self.keep_first_child_hook()
            self.cycle.end_batch()

    def ops_call(self, what, *args):
        """Start or stop operation mode; its failure switches it off, never the job."""
        try:
            getattr(self.ops, what)(*args)
        except Exception as exc:
            self.ops_failed(exc)

    def ops_failed(self, exc):
        self.ops.off = True
        self.cycle.warn_once(("ops",), f"numguard: operation mode stopped after an internal error "
                                       f"({type(exc).__name__}: {exc}); modules are still watched")

    def root_hook(self, owner, module, args, kwargs, output):
        owner.returned = True
        self.hook(owner, module, args, kwargs, output)
        self._end_root_call()
        return None

    def top_returned_hook(self, owner, module, args, output):
        owner.returned = True
        if self._leave_top():
            self.cycle.end_direct_call(owner)
        return None

    def top_after_hook(self, owner, module, args, output):
        if owner.returned:
            owner.returned = False
            return None
        # The forward raised (NOTE: [forward raised]): the batch did not finish.
        self._raised(sys.exc_info()[1])
        return None

    def _raised(self, exc):
        if self._leave_top():
            self.cycle.guarded(self.cycle.after_raised_forward, exc)

    # -- recording a module's frame -------------------------------------------------------------
    def hook(self, owner, module, args, kwargs, output):
        ops = self.ops
        if ops is None:
            return self.module_hook(owner, module, args, kwargs, output)
        ops.paused += 1  # numguard's own recording is not an operation of the model
        try:
            return self.module_hook(owner, module, args, kwargs, output)
        finally:
            ops.paused -= 1

    def _fast_module_hook(self, owner):
        """The forward hook of a module: the ring's native fast path for the steady-state call (one
        tensor in, one out, inside the root's forward), else module_hook. Under torch.compile
        only module_hook is traced (NOTE: [compile])."""
        ring = self.ring
        batch = self.batch
        slow = self.module_hook

        def hook(module, args, kwargs, output):
            if not _is_compiling():
                try:
                    if ring.module_call(owner, batch, args, kwargs, output):
                        return None
                except Exception as exc:  # numguard's own failure must not kill the job
                    self.disable(owner, exc)
                    return None
            return slow(owner, module, args, kwargs, output)

        hook.__wrapped__ = functools.partial(slow, owner)  # says whose hook it is, like the other hooks
        return hook

    def module_hook(self, owner, module, args, kwargs, output):
        batch = self.batch
        if owner.off or batch.closed:
            return None
        if _is_compiling():
            # Traced into the graph: one recording op per call (numguard.inspector.graph).
            return _graph.record_in_graph(self.inspector, owner, args, kwargs, output)
        ring = self.ring
        try:
            if not batch.open:
                # A module frame outside the root's forward (a submodule called directly) opens the
                # batch: its weights are those of now.
                self.cycle.begin_batch()
            # The root's and top modules' frames end a check: recorded afresh (NOTE: [fresh frames]).
            fresh = owner.is_top or batch.depth == 0
            # NOTE: [context records] In watch() a module's inputs trip only with a non-finite output.
            context_inputs = not ring.inputs_trip
            if not kwargs and len(args) == 1 and type(output) is _Tensor and type(args[0]) is _Tensor:
                # Fast path: one positional tensor in, one tensor out (Linear, LayerNorm, Dropout, ...).
                ring.record(owner, [args[0], output], _ONE_IN_ONE_OUT_LABELS, _ONE_IN_ONE_OUT_KINDS,
                            "forward", True, True, batch.done, None, fresh, int(context_inputs))
            else:
                xs, labels, kinds, n_inputs = _frames.flatten_call(args, kwargs, output)
                ring.record(owner, xs, labels, kinds, "forward", True, True, batch.done, None, fresh,
                            n_inputs if context_inputs else 0)
        except Exception as exc:  # numguard's own failure must not kill the job
            self.disable(owner, exc)
        if batch.depth == 0 and not owner.is_top:
            # Called outside the root's forward (e.g. model.encoder(x) directly).
            try:
                self._make_top(owner, module)
            except Exception as exc:
                self.disable(owner, exc)
            self.cycle.end_direct_call(owner)
        return None

    def disable(self, owner, exc):
        owner.off = True
        name = owner.name or "(root module)"
        self.cycle.warn_once(("module", owner.index, owner.name),
                             f"numguard: stopped watching module {name!r} ({owner.cls}) after an internal "
                             f"error: {type(exc).__name__}: {exc}. Training goes on; the other modules are "
                             "still watched.")

    # -- the public batch bracket -------------------------------------------------------------------
    def bracket(self, inputs=_NOTHING):
        return BatchBracket(self, inputs)


class BatchBracket:
    """One batch, begun and ended by the caller instead of by the root module's forward:
    ``with inspector.batch(step=...):`` or ``begin()`` ... ``end()`` from a framework's own batch
    hooks. Inside it the model's modules (the root's forward included, or none of it) count as
    inside the root's forward: the bracket's end is the batch's end (its check, unless backward=True
    leaves that to the optimizer step). Brackets and root calls nest: only the outermost ends the
    batch.

    ``end(output)`` records the batch's result (the step's loss, say) as a frame of the root module,
    with the bracket's ``inputs`` (a tuple: positional; a dict: keyword) as its inputs, and so checks it: a NaN computed outside every
    module is then a trip of the root, as if the root had returned it. An exception leaving the
    bracket is handled as a raised forward (NOTE: [forward raised])."""

    __slots__ = ("hooks", "inputs", "state")

    def __init__(self, hooks, inputs=_NOTHING):
        self.hooks = hooks
        self.inputs = inputs
        self.state = "new"

    def begin(self):
        """Begin the batch (a root call running now continues it). Returns the bracket."""
        if self.state != "new":
            raise RuntimeError(f"numguard: this batch bracket is {self.state}; make a new one with "
                               "inspector.batch() for each batch")
        hooks = self.hooks
        self.state = "open"
        if hooks.root_owner is not None and not hooks.batch.closed:
            hooks.bracketing = True   # the features' begin_batch learns who began it
            try:
                hooks.top_pre_hook(hooks.root_owner, None, ())
            finally:
                hooks.bracketing = False
        return self

    def end(self, output=_NOTHING):
        """End the batch, checking `output` (if given) as the root's result. Idempotent."""
        if self.state != "open":
            return
        self.state = "ended"
        hooks = self.hooks
        if hooks.root_owner is None or hooks.batch.closed or hooks.batch.depth == 0:
            return
        if output is not _NOTHING:
            inputs = () if self.inputs is _NOTHING else self.inputs
            args, kwargs = ((), inputs) if isinstance(inputs, dict) else (
                inputs if isinstance(inputs, tuple) else (inputs,), {})
            hooks.hook(hooks.root_owner, hooks.root_ref(), args, kwargs, output)
        hooks._end_root_call()

    def abandon(self, exc):
        """The batch raised `exc` before its end: handled as a raised forward. Idempotent."""
        if self.state != "open":
            return
        self.state = "ended"
        hooks = self.hooks
        if hooks.root_owner is not None and not hooks.batch.closed and hooks.batch.depth > 0:
            hooks._raised(exc)

    @property
    def is_open(self) -> bool:
        return self.state == "open"

    def __enter__(self):
        return self.begin()

    def __exit__(self, exc_type, exc, tb):
        if exc is None:
            self.end()
        else:
            self.abandon(exc)
        return False


def _ops_push(ops, owner, module, args):
    ops.push(owner)


def _ops_pop(ops, owner, module, args, output):
    ops.pop(owner)
