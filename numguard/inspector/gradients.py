"""Backward watching: the gradients flowing through each watched module, and the parameter
gradients right before the optimizer applies them.

``numguard.watch(model, backward=True)`` (or ``NUMGUARD_BACKWARD=1``) creates a
:class:`BackwardWatcher` next to the inspector:

* Each watched module's forward hook puts a gradient tap on the tensors it received and returned
  (those that require grad). A tensor gets one tap however many modules see it; when autograd
  delivers its gradient the tap records ONE backward frame: labelled ``grad_input[i]`` (or
  ``grad_input[name]`` for keyword inputs) of the innermost module that consumed the tensor, which
  is the module whose backward produced that gradient, else ``grad_output[i]`` of the innermost
  module that returned it. Recording is the inspector's ``record_frame``: no host sync.
* Right before an optimizer that holds the model's parameters steps (a global optimizer step
  pre-hook), every parameter gradient is recorded in one multi-tensor launch (labels
  ``<parameter name>.grad``; a sparse one through its values), and the inspector checks its flag,
  so that a NaN/Inf gradient raises before the optimizer writes any weight.
* ``torch.amp.GradScaler``: a step the scaler skips because the scaled gradients overflowed is
  normal fp16 training, not a trip. numguard sees that the optimizer did not step inside
  ``scaler.step`` and, with ``scaler_skips="count"`` (default), counts it and forgets the
  overflowing gradient records; with ``scaler_skips="trip"`` the skip is a trip.

* One read per training step: once an optimizer step was seen, the inspector's batch-end check
  of a forward run with grad enabled is left to that step's check, which reads the same flag and
  so covers the forward, the backward and the parameter gradients at once (forwards under
  ``no_grad``, e.g. evaluation, are still checked at their end).

* Under ``torch.compile``: while dynamo traces a watched module, its forward pre-hook and hook put
  the same taps into the graph as identity autograd Functions whose backward records the gradient
  on the device (numguard.inspector.graph: same frames and labels, no graph break, no
  recompilation, no host sync). A compiled model's wrapper (torch.compile's OptimizedModule) is
  not tapped itself: the model it holds is, and its frames and parameter gradients carry the
  model's own names, as in eager mode. Where the two modes differ (a tensor that no watched module
  returned records only its first watched consumer's share of its gradient; outputs in containers
  other than tuples, lists and dicts are not tapped; no headroom check), graph.py says so.

Only gradients computed while a watched forward ran are tapped.
"""
import threading
import warnings
import weakref

import torch

from .. import patches as _patches
from ..errors import InspectorWarning
from . import graph as _graph
from .features import Feature
from .frames import container_items, local_shard

__all__ = ["BackwardWatcher", "SCALER_SKIP_ACTIONS", "watch_gradients"]

SCALER_SKIP_ACTIONS = ("count", "trip")
_INPUT, _OUTPUT = _graph._INPUT, _graph._OUTPUT
_INPUT_LABELS = tuple(f"grad_input[{i}]" for i in range(16))

# Watchers alive in this process, oldest first; the global optimizer hook and the GradScaler
# wrapper serve all. A list (not a set): every rank of a job must check its watchers in the same
# order, because a check in a distributed job is a collective.
_watchers = []  # weak references
_lock = threading.Lock()
_steps_taken = 0  # optimizer steps that actually ran (the pre-hook fired), process-wide


class _GradTap:
    """The one gradient hook of a tensor: who consumed/returned it, recorded when grad arrives."""

    __slots__ = ("watcher", "entries")

    def __init__(self, watcher):
        self.watcher = watcher
        self.entries = []  # (kind, module name, class name, label), in forward order

    def add(self, entry):
        if entry not in self.entries:
            self.entries.append(entry)

    def __call__(self, grad):
        watcher = self.watcher
        if watcher.closed or grad is None:
            return None
        watcher._record(*self.label(), grad)
        return None

    def label(self):
        """(module name, class name, label) for this gradient (graph.gradient_label)."""
        return _graph.gradient_label(self.entries)


def _tensors(value, prefix):
    """(label, tensor) for tensors in value: a tensor, or lists/tuples/dicts/dataclasses of them,
    any depth, labelled as the forward frames label them (frames.container_items)."""
    if isinstance(value, torch.Tensor):
        return [(prefix, value)]
    items = container_items(value, prefix)
    return [] if items is None else [found for label, item in items for found in _tensors(item, label)]


class BackwardWatcher(Feature):
    """Records gradients of a watched model into its inspector's ring.

    Args:
        inspector: the :class:`numguard.inspector.Inspector` watching ``model``; used through
            ``record_frame(..., section="backward")``, ``check(where=...)`` and ``module_names``.
        model: the root module.
        scaler_skips: "count" (default): a step that GradScaler skips for inf/NaN gradients is
            counted (``scaler_skipped_steps``) and is not a trip; "trip": it is a trip.
    """

    def __init__(self, inspector, model, scaler_skips="count"):
        if model is None:
            raise ValueError("numguard.backward: the watched model is gone")
        if scaler_skips not in SCALER_SKIP_ACTIONS:
            raise ValueError(f"scaler_skips={scaler_skips!r} is not valid: use one of "
                             f"{', '.join(SCALER_SKIP_ACTIONS)}")
        self.inspector = inspector
        self.operations = None   # ops=True: the OperationRecorder each backward enters (watch_gradients)
        self.scaler_skips = scaler_skips
        self.scaler_skipped_steps = 0
        self.closed = False
        self.recorded_since_check = False
        self.steps_seen = 0              # optimizer steps (of this model's optimizers) seen
        self.trains_in_eval = False      # an optimizer step followed a forward in eval() mode
        self._eval_forward = False       # the last forward ran in eval() mode with gradients on
        self._step_start = None          # the inspector's record position at this step's 1st gradient
        self.last_scaler = None          # weak reference to the GradScaler stepping this model, if any
        self._model_ref = weakref.ref(model)
        self._root_name = inspector.module_names.get(model, "")
        self._root_class = type(model).__name__
        prefix = ""
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            # torch.compile's wrapper: its model's names and class, as the frames inside its graph
            self._root_class = type(model._orig_mod).__name__
            prefix = "_orig_mod."
        self._param_names = {}  # id(param) -> qualified name
        for name, param in model.named_parameters():
            self._param_names.setdefault(id(param), name[len(prefix):] if name.startswith(prefix) else name)
        self._params_of = weakref.WeakKeyDictionary()  # optimizer -> (version, [(label, param)])
        self._handles = []
        for module, name in list(inspector.module_names.items()):
            if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
                continue  # torch.compile's wrapper: the model it holds sees the same tensors
            class_name = type(module).__name__
            hook = self._make_forward_hook(name, class_name)
            self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
            self._handles.append(module.register_forward_pre_hook(
                self._make_graph_pre_hook(name, class_name), with_kwargs=True))
        _register(self)

    # -- activation gradients ------------------------------------------------------------------
    def _make_forward_hook(self, name, class_name):
        is_compiling = torch.compiler.is_compiling
        is_grad_enabled = torch.is_grad_enabled
        Tensor = torch.Tensor
        entries = {}  # label -> (kind, name, class, label), made once per module and label

        def entry(kind, label):
            found = entries.get(label)
            if found is None:
                found = entries[label] = (kind, name, class_name, label)
            return found

        def forward_hook(module, args, kwargs, output):
            if self.closed or not is_grad_enabled():
                return None
            if is_compiling():
                # Traced into the graph: taps as autograd Functions (numguard.inspector.graph).
                try:
                    return _graph.tap_outputs_in_graph(self.inspector, name, class_name, args, kwargs, output)
                except Exception:  # noqa: BLE001 - numguard's failure must not fail the compile
                    return None
            try:
                for i, value in enumerate(args):
                    if isinstance(value, Tensor):
                        if value.requires_grad and value.grad_fn is not None:
                            self._tap(value, entry(_INPUT, _INPUT_LABELS[i] if i < 16
                                                   else f"grad_input[{i}]"))
                    elif isinstance(value, (list, tuple, dict)):
                        self._tap_nested(value, f"grad_input[{i}]", _INPUT, entry)
                if kwargs:
                    self._tap_nested(kwargs, "grad_input", _INPUT, entry)
                if isinstance(output, Tensor):
                    if output.requires_grad:
                        self._tap(output, entry(_OUTPUT, "grad_output[0]"))
                else:
                    self._tap_nested(output, "grad_output", _OUTPUT, entry)
            except Exception as exc:  # numguard's failure must not kill the job
                self._give_up(f"tapping the gradients of {name or 'the root'} ({class_name})", exc)
            return None

        return forward_hook

    def _make_graph_pre_hook(self, name, class_name):
        is_compiling = torch.compiler.is_compiling
        is_grad_enabled = torch.is_grad_enabled

        def graph_pre_hook(module, args, kwargs):
            # Eager mode taps in the forward hook (a tensor hook sees the whole gradient); inside a
            # graph an input must go through its tap before the module consumes it.
            if self.closed or not is_compiling() or not is_grad_enabled():
                return None
            try:
                return _graph.tap_inputs_in_graph(self.inspector, name, class_name, args, kwargs)
            except Exception:  # noqa: BLE001 - numguard's failure must not fail the compile
                return None

        return graph_pre_hook

    def _tap_nested(self, value, prefix, kind, entry):
        for label, tensor in _tensors(value, prefix):
            if tensor.requires_grad and (kind == _OUTPUT or tensor.grad_fn is not None):
                self._tap(tensor, entry(kind, label))

    def _tap(self, tensor, entry):
        tap = getattr(tensor, "_numguard_grad_tap", None)
        if tap is None or tap.watcher is not self:
            tap = _GradTap(self)
            tensor.register_hook(tap)
            tensor._numguard_grad_tap = tap
        tap.add(entry)

    def _record(self, name, class_name, label, grad):
        if self._step_start is None:
            self._step_start = self.inspector.ring_position()
        try:
            self.inspector.record_frame(name, class_name, [label], [grad], section="backward")
            self.recorded_since_check = True
        except Exception as exc:  # numguard's failure must not kill the job
            self._give_up(f"recording the gradient {label} of {name or 'the root'}", exc)

    def _give_up(self, what, exc):
        warnings.warn(f"numguard: backward watching stopped: {what} failed "
                      f"({type(exc).__name__}: {exc}); forward watching goes on", RuntimeWarning,
                      stacklevel=3)
        self.close()

    # -- parameter gradients, before the optimizer steps ---------------------------------------
    def _params_in(self, optimizer):
        version = sum(len(group["params"]) for group in optimizer.param_groups)
        cached = self._params_of.get(optimizer)
        if cached is not None and cached[0] == version:
            return cached[1]
        params = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                name = self._param_names.get(id(param))
                if name is not None:
                    params.append((f"{name}.grad", param))
        self._params_of[optimizer] = (version, params)
        return params

    def before_optimizer_step(self, optimizer):
        """Record the parameter gradients this optimizer is about to apply, then check: a trip
        raises here, before any weight is written."""
        if self.closed:
            return
        params = self._params_in(optimizer)
        if not params and not self.recorded_since_check:
            return
        labels, grads = [], []
        for label, param in params:
            grad = param.grad
            if grad is not None:
                # A sharded parameter's gradient: this rank's shard. A sparse one (an Embedding or
                # EmbeddingBag with sparse=True, SparseAdam) is recorded through its values.
                labels.append(label)
                grads.append(local_shard(grad))
        if grads:
            try:
                self.inspector.record_frame(self._root_name, self._root_class, labels, grads,
                                            section="backward")
            except Exception as exc:  # numguard's failure must not kill the job
                self._give_up("recording the parameter gradients", exc)
                return
            dense = [i for i, g in enumerate(grads) if g.layout == torch.strided]
            if len(dense) < len(grads):  # norms of dense gradients only (NOTE: [gradient norm spikes])
                labels, grads = [labels[i] for i in dense], [grads[i] for i in dense]
            for feature in self.inspector.features:
                feature.parameter_gradients(labels, grads)
        self.steps_seen += 1
        self.trains_in_eval = self.trains_in_eval or self._eval_forward
        self._eval_forward = False
        self.recorded_since_check = False
        self._step_start = None
        if self.steps_seen % self.inspector.check_every == 0:
            # check="async" reads this check's flag one step late (the inspector warned of it).
            self.inspector.check("before optimizer step")

    def on_scaler_skip(self, scaler, optimizer):
        """GradScaler skipped ``optimizer``'s step: its (scaled) gradients held inf/NaN."""
        if self.closed or not self._params_in(optimizer):
            return
        self.scaler_skipped_steps += 1
        import logging

        logging.getLogger("numguard").info(
            "numguard: GradScaler skipped the optimizer step of batch_number=%s (inf/NaN in the "
            "scaled gradients); %d step(s) skipped so far (scaler_skips=%r)",
            self.inspector.batch_number, self.scaler_skipped_steps, self.scaler_skips)
        start, self._step_start = self._step_start, None
        self.recorded_since_check = False
        if self.scaler_skips == "trip":
            self.inspector.check_now("GradScaler skipped the optimizer step")
            return
        # The overflowing gradient records of this step are the scaler's business, not a trip. A
        # trip recorded before them (in the forward) still is one. Skips are rare and the scaler
        # has just waited for the device itself, so one read of the state costs nothing here.
        # Without an eager gradient in this step (a compiled model's are recorded in its graphs),
        # the step started at the current position.
        self.inspector.forget_trip_from(self.inspector.ring_position() if start is None else start,
                                        "before optimizer step (GradScaler skipped it)")

    def takes_batch_end_check(self) -> bool:
        """Whether the inspector's batch-end check is left to the optimizer step (NOTE: [one read
        per step]): once this model is seen training, the step's check reads the same flag and
        covers the forward, the backward and the parameter gradients with one device->host read.
        Forwards under no_grad are still checked at their end, and so are forwards of a model in
        eval() mode (an evaluation that did not turn gradients off: no optimizer step will follow
        it) until an optimizer step was seen to follow one: a model trained in eval() mode (frozen
        BatchNorm, no dropout) then pays one read per step as in train() mode, and its evaluations
        with gradients on are checked at the next step, as a train()-mode model's are."""
        model = self._model_ref()
        self._eval_forward = torch.is_grad_enabled() and model is not None and not model.training
        if not self.steps_seen or self.closed or not torch.is_grad_enabled():
            return False
        return not self._eval_forward or self.trains_in_eval

    def close(self):
        """Remove every hook this watcher added (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        _unregister(self)


# -- process-wide hooks -------------------------------------------------------------------------
def _optimizer_pre_hook(optimizer, args, kwargs):
    global _steps_taken
    _steps_taken += 1
    watchers = _live_watchers()
    # torch passes step()'s own arguments, the optimizer first: (optimizer, closure?)
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    if closure is None:
        for watcher in watchers:
            watcher.before_optimizer_step(optimizer)
        return None
    # A closure (LBFGS, ...) computes the gradients inside step(): check after each evaluation,
    # before the optimizer applies what it returned.
    def checked_closure(*c_args, **c_kwargs):
        result = closure(*c_args, **c_kwargs)
        for watcher in watchers:
            watcher.before_optimizer_step(optimizer)
        return result

    if len(args) > 1:
        return (args[0], checked_closure) + tuple(args[2:]), kwargs
    return args, dict(kwargs, closure=checked_closure)


def _scaler_step(scaler, optimizer, *args, **kwargs):
    before = _steps_taken
    for watcher in _live_watchers():  # the loss scale of the gradients seen (precision advice)
        if watcher.last_scaler is None or watcher.last_scaler() is not scaler:
            watcher.last_scaler = weakref.ref(scaler)
    # The original stays on the replacement after a restore: a reference kept elsewhere still works.
    result = _scaler_step.__numguard_original__(scaler, optimizer, *args, **kwargs)
    if _steps_taken == before and scaler.is_enabled():
        for watcher in _live_watchers():
            watcher.on_scaler_skip(scaler, optimizer)
    return result


def _autograd_backward(*args, **kwargs):
    # With ops=True, the backward's operations are recorded too: the dispatch mode must be active
    # when the backward starts (autograd hands it to the threads that run the backward).
    entered = []
    for watcher in _live_watchers():
        operations = watcher.operations
        if not watcher.closed and operations is not None and operations.enter_backward():
            entered.append(operations)
    try:
        return _autograd_backward.__numguard_original__(*args, **kwargs)
    finally:
        for operations in reversed(entered):
            operations.leave_backward()


def _live_watchers():
    return [watcher for watcher in (ref() for ref in list(_watchers)) if watcher is not None]


_BACKWARD = "torch.autograd.backward"
_SCALER_STEP = "torch.amp.GradScaler.step"
_OPTIMIZER_HOOK = "torch.optim optimizer step pre-hook"


def _register(watcher):
    with _lock:
        _watchers.append(weakref.ref(watcher))
        if getattr(watcher.inspector, "ops", False):
            _patches.replace(torch.autograd, "backward", _autograd_backward, target=_BACKWARD,
                             why="watch(ops=True, backward=True): record the backward's operations")
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _patches.add_hook(register_optimizer_step_pre_hook, _optimizer_pre_hook, target=_OPTIMIZER_HOOK,
                          why="watch(backward=True): check the gradients before the optimizer writes a weight")
        scaler_class = getattr(getattr(torch, "amp", None), "GradScaler", None)
        if scaler_class is not None:
            _patches.replace(scaler_class, "step", _scaler_step, target=_SCALER_STEP,
                             why="watch(backward=True): count the steps GradScaler skips for inf/NaN gradients")


def _unregister(watcher):
    with _lock:
        _watchers[:] = [ref for ref in _watchers if ref() is not None and ref() is not watcher]
        # What no open watcher needs is undone now: a watcher left open elsewhere (a framework's
        # run that raised before its end hook) keeps only what it uses.
        live = [w for w in _live_watchers() if not w.closed]
        if not any(getattr(w.inspector, "ops", False) for w in live):
            _patches.restore(_BACKWARD)
        if not live:
            for target in (_OPTIMIZER_HOOK, _SCALER_STEP):
                _patches.restore(target)


def watch_gradients(inspector, model, options, operations=None):
    """The BackwardWatcher of watch(backward=True), warning when the configured checks let a
    NaN/Inf gradient reach the optimizer. `operations`: the OperationRecorder of ops=True, which
    each backward enters."""
    watcher = BackwardWatcher(inspector, model, scaler_skips=options.scaler_skips)
    watcher.operations = operations
    if options.check == "async" or options.check_every > 1:
        warnings.warn(
            f"numguard: backward=True with check={options.check!r}, check_every={options.check_every}: a "
            "NaN/Inf gradient of a step that is not checked synchronously reaches the optimizer, and "
            "is reported at the next check (the weights may already hold it). Use check='sync', "
            "check_every=1 to raise before any weight is written.", InspectorWarning, stacklevel=4)
    return watcher
