"""Module frames recorded inside compiled graphs (torch.compile).

While dynamo traces a watched module's forward hook, the hook records its frame with
``numguard.ops.record_at_cursor_``: one op traced into the graph per module call. Nothing in it
depends on a host counter: the frame's base position is read from a device cursor and advanced on
the device, and each call leaves (slot, start, batch) in a small device log. The frame's host
metadata (module, labels, kinds, dtypes, shapes) is registered once, while dynamo traces, under a
slot id that is a constant of the graph (``_slot_for``), so running the graph costs no Python per
frame beyond the op call, causes no graph break and no recompilation.

Graph records share the eager ring's recording state (trip flag, first trip position, headroom
flags, freeze on trip): the batch-end check's one read of the state covers them. Their positions
start at ``schema.GRAPH_POSITION_BASE``, so a trip position says which ring holds the offender.
Only then (after a trip) does the host read the cursor, the log and the graph ring, rebuild the
frames and merge them with the eager ones (``report_view``).

Gradients (``backward=True``): while dynamo traces a watched module's hooks, the tensors it receives
and returns (those requiring grad) pass through :class:`GradientTap`, an identity
``torch.autograd.Function`` whose backward records the incoming gradient with the same op, under a
gradient slot registered at trace time (``_gradient_slot_for``). As in eager mode a tensor gets one
tap however many modules see it (the tap's slot rides on the traced tensor as an attribute), and
the modules that consumed or returned it are added to the slot's entries in the order eager mode's
forward hooks see them, so the report names the same module and ``grad_input[i]``/``grad_output[i]``
label (``gradient_label``). Differences from eager mode: a tensor that no watched module returned
is tapped where the first watched module receives it, so its record is that module's share of the
gradient (eager mode records the tensor's whole gradient); outputs inside containers other than
tuples, lists and dicts (e.g. a ModelOutput) are not tapped; gradient records inside graphs skip
the headroom check.
"""
from __future__ import annotations

import itertools
import weakref
from typing import NamedTuple

import torch
from torch._dynamo.comptime import comptime

from .. import ops, schema
from . import frames as _frames
from .features import Feature
from .ring import outside_inference_mode

GRAPH_RING_RECORDS = 1 << 14  # records (1 MiB); older graph frames are overwritten beyond this
GRAPH_LOG_ROWS = 1 << 12      # module calls remembered
_RECORDABLE = frozenset(getattr(torch, name) for name in schema.RECORDABLE_DTYPES if hasattr(torch, name))
_COMPILED_PREFIX = "_orig_mod"  # torch.compile's OptimizedModule holds the model under this name


def _compiled(module):
    """Whether `module` runs compiled code: torch.compile's wrapper, or compiled in place."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule) or \
        getattr(module, "_compiled_call_impl", None) is not None


def _shown_name(name):
    """A module name as reports show it: without torch.compile's wrapper segments."""
    return ".".join(part for part in name.split(".") if part != _COMPILED_PREFIX)


def untraced_message(missing, limit=8):
    """The warning for GraphRecorder.untraced_submodules' answer: which frames are missing, and
    what to do."""
    parts = []
    for name, inside in missing:
        shown = ", ".join(n or "(root)" for n in inside[:limit]) + (
            f", ... ({len(inside)} modules)" if len(inside) > limit else "")
        what = "the compiled model" if not name else f"compiled module {name!r}"
        parts.append(f"{what}: {shown}")
    return ("numguard: compiled before watch() added numguard's hooks (dynamo does not recompile for hooks), "
            "so these modules recorded no frame in the first watched batch: " + "; ".join(parts)
            + ". A NaN/Inf made inside them is reported at the compiled module's output (and its weights) "
            "only, not at the module that made it. Call watch() before the compiled model's first call, "
            "or torch._dynamo.reset() before watch().")


def modules_in_graphs(inspector) -> list:
    """The watched modules that run inside compiled graphs (names as reports show them): those
    whose hooks dynamo traced into a graph, and those inside a compiled module (torch.compile(m),
    m.compile()). What a feature measuring eagerly in its own hooks cannot see."""
    graph = getattr(inspector._reporter, "graph", None)
    names = {slot.owner_name for slot in _slots if graph is not None and slot.recorder == graph.key}
    all_names = [owner.name for owner in inspector._owners]
    for owner in inspector._owners:
        module = owner.ref() if owner.ref is not None else None
        if module is not None and _compiled(module):
            prefix = owner.name + "." if owner.name else ""
            names.update(n for n in all_names if n.startswith(prefix) and n != owner.name)
    order = {}
    for n in all_names:  # the model's order, under the names reports show
        order.setdefault(_shown_name(n), len(order))
    shown = {_shown_name(n) for n in names} - {""}
    return sorted(shown, key=lambda n: order.get(n, len(order)))


def warn_graph_blind(inspector, feature, what, limit=6):
    """Warn once (per feature) when watched modules run inside compiled graphs, where `feature`'s
    own eager hooks do not run: `what` says what that costs. True when it warned."""
    names = modules_in_graphs(inspector)
    if not names:
        return False
    shown = ", ".join(repr(n) for n in names[:limit]) + (f", ... ({len(names)} modules)" if len(names) > limit else "")
    inspector._warn_once((feature, "compiled"), f"numguard: {feature}= under torch.compile: {shown} run inside "
                                                f"compiled graphs, {what}")
    return True


class GraphBlindWarning:
    """warn_graph_blind for one feature, asked at every batch end: it looks at the watched modules
    again only when dynamo was asked to compile a frame since it last looked (what
    modules_in_graphs answers cannot change otherwise; a look walks every watched module, too much
    for every batch of a large model), and warns once."""

    def __init__(self, feature, what):
        self.feature, self.what = feature, what
        self.warned = False
        self.frames = None   # dynamo's count of frames it was asked to compile, at the last look

    def check(self, inspector):
        if self.warned:
            return
        frames = torch._dynamo.utils.counters["frames"]["total"]
        if frames != self.frames:
            self.frames = frames
            self.warned = warn_graph_blind(inspector, self.feature, self.what)


def watch_wrapper_calls(inspector, model, roots) -> list:
    """Hooks on torch.compile wrappers of `model` made before watch(model) (NOTE: [wrappers
    compiled before watch]); their handles. Wrappers made later are hooked as they are made, for
    the inspector `roots` (root module -> its open Inspector) holds for their model."""
    wrapper_class = torch._dynamo.eval_frame.OptimizedModule
    if isinstance(model, wrapper_class):
        return []
    _follow_new_wrappers(wrapper_class, roots)
    if not torch._dynamo.utils.counters["frames"]["ok"]:
        return []   # nothing compiled yet: a wrapper's first call will trace numguard's hooks
    handles = []
    for wrapper in compiled_wrappers(model):
        handles += _hook_wrapper(inspector, model, wrapper)
    return handles


def _hook_wrapper(inspector, model, wrapper) -> list:
    """Hooks on `wrapper` (outside its graph) that warn when one of its calls ran no hook of the
    model (the batch count did not move); their handles."""
    batches = []

    def before(module, args):
        batches.append(inspector._batch.done)

    def after(module, args, output):
        if batches and batches.pop() == inspector._batch.done and not inspector._batch.closed:
            inspector._warn_once(("compiled", "wrapper"), WRAPPER_MESSAGE.format(cls=type(model).__name__))
    return [wrapper.register_forward_pre_hook(torch.compiler.disable(before)),
            wrapper.register_forward_hook(torch.compiler.disable(after))]


def _follow_new_wrappers(wrapper_class, roots) -> None:
    """Hook each torch.compile wrapper made after watch() of a watched root as it is made: dynamo
    keeps code compiled before watch() with the model, not with the wrapper that compiled it, so
    a new wrapper can run it too (NOTE: [wrappers compiled before watch])."""
    from .. import patches

    original = wrapper_class.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        try:
            model = self.__dict__.get("_modules", {}).get("_orig_mod")
            inspector = roots.get(model) if isinstance(model, torch.nn.Module) else None
            if inspector is not None and not inspector._batch.closed and torch._dynamo.utils.counters["frames"]["ok"]:
                inspector._handles += _hook_wrapper(inspector, model, self)
        except Exception as exc:   # numguard's failure must not fail torch.compile; it says so
            import warnings

            from ..errors import InspectorWarning
            warnings.warn(f"numguard: could not hook this torch.compile wrapper ({type(exc).__name__}: {exc}); if it "
                          "runs code compiled before watch(), its calls are not watched", InspectorWarning, stacklevel=2)

    patches.replace(wrapper_class, "__init__", init, target=_NEW_WRAPPERS,
                    why="hook torch.compile wrappers of watched models made after watch()")


def stop_following_new_wrappers() -> None:
    """Undo _follow_new_wrappers (no watched root is left)."""
    from .. import patches

    patches.restore(_NEW_WRAPPERS)


_NEW_WRAPPERS = "torch._dynamo.OptimizedModule.__init__"


def compiled_wrappers(model) -> list:
    """The torch.compile wrappers (OptimizedModule) of `model` alive now, found from the model up:
    a wrapper's `_modules` dict holds the model as "_orig_mod", and the wrapper holds that dict
    (through its instance __dict__ once that exists). One pass over the heap's containers
    (gc.get_referrers) when no wrapper holds the model, three when one does; a walk over every
    object (gc.get_objects) cost several times more on a large heap."""
    import gc

    wrapper_class = torch._dynamo.eval_frame.OptimizedModule
    # type(), not isinstance(): a dead weak proxy raises on isinstance
    level = [r for r in gc.get_referrers(model) if issubclass(type(r), dict) and r.get("_orig_mod") is model]
    found = []
    for _ in range(2):   # the wrapper itself, or its __dict__ and then the wrapper
        if not level:
            break
        up = []
        for r in gc.get_referrers(*level):
            if issubclass(type(r), wrapper_class):
                if r._orig_mod is model and not any(r is w for w in found):
                    found.append(r)
            elif type(r) is dict and any(r.get("_modules") is held for held in level):
                up.append(r)
        level = up
    return found


# NOTE: [wrappers compiled before watch] A wrapper of torch.compile that ran before watch(model)
# runs its compiled code without numguard's hooks (dynamo does not guard on hooks), so a call
# through it never reaches the model's hooks and nothing of it is watched, not even its output.
# numguard cannot put its hooks into that code; it hooks the wrapper itself (its hooks run outside
# the graph) and says so at the first call that bypassed the model's. Dynamo keeps that code with
# the model, so a wrapper made after watch() (the first one deleted) runs it too: wrappers of a
# watched root are hooked as they are made.
WRAPPER_MESSAGE = (
    "numguard: this {cls} was called through a torch.compile wrapper that compiled before watch() "
    "added numguard's hooks (dynamo does not recompile for hooks): that call ran without them and is NOT "
    "watched (a NaN/Inf in it is not reported). Watch the wrapper (numguard.watch(compiled)), call watch() "
    "before the wrapper's first call, or torch._dynamo.reset() before watch().")


class Slot(NamedTuple):
    """What one traced module call records: the host metadata of its frame."""
    recorder: str        # GraphRecorder.key
    owner_name: str      # the Owner's name in its inspector (a string: an int attribute may turn
                         # symbolic under dynamic shapes, and a slot id must be a constant)
    labels: tuple
    kinds: tuple
    dtypes: tuple
    n_records: int       # tensors, plus the module's weight flag
    section: str = "forward"
    entries: list = None  # gradient slots: (kind, module, class, label) of the modules that consumed
                          # or returned the tapped tensor, in eager hook order (filled while tracing)


_slots: list = []
_slot_ids: dict = {}
_slot_shapes: dict = {}        # slot id -> shapes of its tensors (from the latest trace)
_recorders = weakref.WeakValueDictionary()
_keys = itertools.count()


@torch._dynamo.assume_constant_result
def _slot_for(recorder, owner_name, labels, kinds, dtypes, with_flag):
    """The slot id of a frame layout, registered on first sight. Dynamo calls this while it
    traces and puts the result in the graph as a constant: it never runs when the graph runs.
    (Shapes are not an argument: a dynamic dimension is no constant; _note_shapes reads them.)"""
    key = (recorder, owner_name, labels, kinds, dtypes, with_flag)
    slot = _slot_ids.get(key)
    if slot is None:
        slot = _slot_ids[key] = len(_slots)
        _slots.append(Slot(recorder, owner_name, labels, kinds, dtypes, len(dtypes) + bool(with_flag)))
        graph = _recorders.get(recorder)
        if graph is not None:
            graph.used = True
    return slot


_INPUT, _OUTPUT = 0, 1   # gradient entry kinds: the module consumed / returned the tensor
_TAP_ATTRIBUTE = "_numguard_graph_tap"   # the gradient slot of a tensor tapped in the graph being traced
_gradient_fallback: dict = {}  # gradient slot -> the entry of the hook that tapped it (no entry added yet)


def gradient_label(entries):
    """(module name, class name, label) of a tapped tensor's gradient, from the (kind, module,
    class, label) entries of the modules that saw it in forward hook order: the innermost module
    that consumed the tensor without returning it unchanged (its backward made this gradient),
    else the first consumer, else the innermost module that returned it."""
    chosen = None
    if len(entries) > 1:
        returned = {entry[1] for entry in entries if entry[0] == _OUTPUT}
        for entry in entries:
            if entry[0] == _INPUT and entry[1] not in returned:
                chosen = entry
                break
    if chosen is None:
        for entry in entries:
            if entry[0] == _INPUT:
                chosen = entry
                break
    if chosen is None:
        chosen = entries[0]
    return chosen[1], chosen[2], chosen[3]


@torch._dynamo.assume_constant_result
def _gradient_slot_for(recorder, owner_name, class_name, kind, label, dtype):
    """A new gradient slot (one per tap and trace: its entries depend on what consumes the tensor
    later in the trace). Runs only while dynamo traces; -1 (not recorded) if anything fails."""
    try:
        slot = len(_slots)
        _slots.append(Slot(recorder, owner_name, (label,), (_frames.TENSOR,), (dtype,), 1, "backward", []))
        _gradient_fallback[slot] = (kind, owner_name, class_name, label)
        graph = _recorders.get(recorder)
        if graph is not None:
            graph.used = True
        return slot
    except Exception:  # noqa: BLE001 - numguard's failure must not fail a compile
        return -1


@torch._dynamo.assume_constant_result
def _add_gradient_entry(slot, kind, owner_name, class_name, label):
    """At trace time: a module consumed (kind _INPUT) or returned (_OUTPUT) the tensor tapped
    under `slot`. Returns the slot."""
    try:
        entries = _slots[slot].entries
        entry = (kind, owner_name, class_name, label)
        if entry not in entries:
            entries.append(entry)
    except Exception:  # noqa: BLE001 - labels are report detail, never worth failing a compile
        pass
    return slot


@torch.library.custom_op("numguard::record_gradient_", mutates_args=("grad",))
def _record_gradient(grad: torch.Tensor, recorder: str, slot: int) -> None:
    """A gradient tap's record, run when the compiled backward runs.

    NOTE: [gradient op] An op of its own, opaque to the graph, that finds its recorder's tensors
    by name: were the ring, state, cursor and log inputs of the backward, dynamo would save them
    in the forward, and autograd refuses a saved tensor that changed before the backward (the
    forward's own records change them). The schema says it writes `grad` (it does not) so that the
    compiled backward keeps the call: an op without outputs or writes would be dropped as dead."""
    graph = _recorders.get(recorder)
    if graph is None or graph.closed:
        return
    try:
        inspector = graph._inspector()
        if inspector is not None and not inspector._batch.closed:
            _record_gradient_now(graph, inspector, grad, slot)
    except Exception as exc:  # numguard's failure must not kill the job
        graph.closed = True
        import warnings

        warnings.warn(f"numguard: gradients inside compiled graphs are not recorded any more after an internal "
                      f"error ({type(exc).__name__}: {exc}); the parameter gradients are still checked",
                      RuntimeWarning, stacklevel=2)


def _record_gradient_now(graph, inspector, grad, slot):
    ring = graph.ring
    ops.record_at_cursor_(ring, inspector._ring.state, graph.cursor, graph.log, [_recordable(grad, ring.device)],
                          slot, 0.0)


@_record_gradient.register_fake
def _record_gradient_fake(grad, recorder, slot):
    return None


class GradientTap(torch.autograd.Function):
    """Identity in the forward; the backward records the gradient (no host sync) under the
    gradient slot given to the forward and passes it on unchanged."""

    @staticmethod
    def forward(ctx, x, recorder, slot):
        ctx.recorder = recorder
        ctx.slot = slot
        # A copy, not a view: a view made by a Function may not be changed in place afterwards
        # (models do, e.g. Transformers' GPT-2), and autograd refuses it.
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        torch.ops.numguard.record_gradient_(grad, ctx.recorder, ctx.slot)
        return grad, None, None


def _tap(inspector, graph, x, name, class_name, kind, label):
    """x through a GradientTap with a new gradient slot (x itself when it needs no tap)."""
    if x.layout != torch.strided or x.is_quantized or x.is_nested:
        return x  # a strided gradient is what record_at_cursor_ takes
    slot = _gradient_slot_for(graph.key, name, class_name, kind, label, x.dtype)
    if slot < 0:
        return x
    xs = [x]
    comptime(_note_shapes)
    tapped = GradientTap.apply(x, graph.key, slot)
    setattr(tapped, _TAP_ATTRIBUTE, slot)
    return tapped


def _map_tensors(value, prefix, fn):
    """value with fn(label, tensor) applied to its tensors (tuples, lists and dicts followed, any
    depth; other containers kept as they are)."""
    if isinstance(value, torch.Tensor):
        return fn(prefix, value)
    if type(value) in (tuple, list):
        return type(value)(_map_tensors(item, f"{prefix}[{i}]", fn) for i, item in enumerate(value))
    if type(value) is dict:
        return {key: _map_tensors(item, _frames.key_label(prefix, key), fn) for key, item in value.items()}
    return value


def tap_inputs_in_graph(inspector, name, class_name, args, kwargs):
    """A watched module's forward pre-hook while dynamo traces it (backward=True): the inputs that
    require grad and carry no tap yet (no watched module returned them) go through a tap. Returns
    the (args, kwargs) the module receives."""
    graph = inspector._graph
    if graph is None:
        return None

    tapped = []

    def tap_input(label, x):
        if not x.requires_grad or x.is_leaf or getattr(x, _TAP_ATTRIBUTE, None) is not None:
            return x
        tapped.append(label)
        return _tap(inspector, graph, x, name, class_name, _INPUT, label)

    args, kwargs = _map_tensors(args, "grad_input", tap_input), _map_tensors(kwargs, "grad_input", tap_input)
    return (args, kwargs) if tapped else None


def tap_outputs_in_graph(inspector, name, class_name, args, kwargs, output):
    """A watched module's forward hook while dynamo traces it (backward=True): names the module as
    a consumer of its tapped inputs and taps its outputs (a tensor it returned unchanged keeps its
    tap and gets this module as a returner). Returns the output the caller receives."""
    graph = inspector._graph
    if graph is None:
        return None

    def consumed(label, x):
        slot = getattr(x, _TAP_ATTRIBUTE, None)
        if slot is not None:
            _add_gradient_entry(slot, _INPUT, name, class_name, label)
        return x

    tapped = []

    def returned(label, x):
        if not x.requires_grad:
            return x
        slot = getattr(x, _TAP_ATTRIBUTE, None)
        if slot is None:
            x = _tap(inspector, graph, x, name, class_name, _OUTPUT, label)
            slot = getattr(x, _TAP_ATTRIBUTE, None)
            if slot is None:
                return x
            tapped.append(slot)
        _add_gradient_entry(slot, _OUTPUT, name, class_name, label)
        return x

    _map_tensors(args, "grad_input", consumed)
    _map_tensors(kwargs, "grad_input", consumed)
    if isinstance(output, torch.Tensor):
        output = returned("grad_output[0]", output)
    else:
        output = _map_tensors(output, "grad_output", returned)
    # None when nothing new was tapped: the output stays the module's own (a hook that dynamo
    # traces as a frame of its own then makes no graph).
    return output if tapped else None


def _note_shapes(ctx):
    """At trace time (torch._dynamo.comptime, no graph break): the shapes of record_in_graph's
    `xs` under its `slot`, -1 for a dimension that is dynamic in the graph. The latest trace of
    a slot wins. Best effort: shapes are report detail, never worth failing a compile for."""
    try:
        slot = ctx.get_local("slot").as_python_constant()
        xs = ctx.get_local("xs")._i_will_not_complain_if_bc_breaks_VariableTracker()
        shapes = []
        for x in xs.items:
            fake = x.as_proxy().node.meta["example_value"]
            shapes.append(tuple(d if type(d) is int else -1 for d in fake.shape))
        _slot_shapes[slot] = tuple(shapes)
    except Exception:  # noqa: BLE001 - see the docstring
        pass


def _recordable(x, device):
    """`x` as record_at_cursor_ takes it (branches on dtype, layout and device only: static in a
    graph). Values that only a sanitizing copy could keep (sparse, nested, quantized) are not
    followed inside a graph: an empty stand-in keeps the line."""
    x = x.detach()
    if x.layout != torch.strided or x.is_quantized or x.is_nested:
        return torch.empty(0, device=device)
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dtype not in _RECORDABLE:
        x = x.to(torch.float64)
    if x.device != device:
        x = x.to(device)
    return x


def record_in_graph(inspector, owner, args, kwargs, output):
    """The module hook's work while dynamo traces it: one record_at_cursor_ op in the graph."""
    graph = inspector._graph
    if graph is None:
        return None
    if not kwargs and len(args) == 1 and isinstance(output, torch.Tensor) and isinstance(args[0], torch.Tensor):
        xs, labels, kinds = [args[0], output], _frames.ONE_IN_ONE_OUT_LABELS, _frames.ONE_IN_ONE_OUT_KINDS
        n_inputs = 1
    else:
        xs, labels, kinds, n_inputs = _frames.flatten_call(args, kwargs, output)
    ring = inspector._ring
    context = 0 if ring.inputs_trip else n_inputs  # NOTE: [context records]
    device = ring.device
    flag = owner.flag
    slot = _slot_for(graph.key, owner.name, tuple(labels), tuple(kinds), tuple(x.dtype for x in xs),
                     flag is not None)
    comptime(_note_shapes)
    xs = [_recordable(x, device) for x in xs]
    if flag is not None:
        # Its weight flag (NaN when one of its weights is non-finite) trips at this frame, as in eager mode.
        xs.append(flag)
    ops.record_at_cursor_(graph.ring, ring.state, graph.cursor, graph.log, xs, slot, owner.headroom, context)
    return None


class GraphRecorder(Feature):
    """An inspector's graph ring, cursor and log (on the model's device), and the host side that
    turns them back into frames after a trip."""

    def __init__(self, inspector, device, records=GRAPH_RING_RECORDS, log_rows=GRAPH_LOG_ROWS):
        self._inspector = weakref.ref(inspector)
        self.key = f"graph{next(_keys)}"  # a string: dynamo keeps it a constant under dynamic shapes
        _recorders[self.key] = self
        self.used = False          # a graph recording into it was traced
        self.closed = False        # its gradient op stopped after an internal error
        self._gradient_owners = {}  # (name, class) -> Owner of gradient frames in reports
        self.records = records
        self.log_rows = log_rows
        self._allocate(device)

    @outside_inference_mode
    def _allocate(self, device):
        self.ring = torch.zeros((self.records, schema.NUM_STATS), dtype=torch.float64, device=device)
        self.cursor, self.log = ops.new_graph_cursor(self.log_rows, device)
        self.floor_calls = None    # device copy of the calls logged when frames were last forgotten

    def move_to(self, device):
        """Start over on another device (the model moved after watch())."""
        self._allocate(device)

    def device_moved(self, device):
        self.move_to(device)

    def end_batch(self, batch):
        inspector = self._inspector()
        if batch == 0 and inspector is not None:  # before the check: said before a trip's report
            missing = self.untraced_submodules(inspector)
            if missing:
                inspector._warn_once(("graph",), untraced_message(missing))

    @outside_inference_mode
    def begin_batch(self, batch):
        """Tell the device which batch runs (one fill, only once a graph records into this ring)."""
        if self.used:
            self.cursor[schema.CURSOR_BATCH].fill_(batch)

    @outside_inference_mode
    def forget_frames(self):
        """Frames logged so far are not report context any more (the state was reset after a
        trip). A device copy, no host read."""
        if self.used:
            self.floor_calls = self.cursor[schema.CURSOR_CALLS].clone()

    def untraced_submodules(self, inspector):
        """After the first batch: the compiled modules (``torch.compile(m)`` or ``m.compile()``, the
        model or one inside it) that ran without numguard's hooks in their graph (compiled before
        watch(); dynamo does not guard on hooks, so it reused that code): none of their submodules
        recorded a frame, in the graph or eagerly. [(compiled module's name, [its submodules'
        names])], outermost first, names as reports show them."""
        recorded = {slot.owner_name for slot in _slots if slot.recorder == self.key}
        recorded.update(f.owner.name for f in inspector._ring.frames)
        if not recorded:
            return []  # nothing ran at all
        names = [owner.name for owner in inspector._owners]
        missing = []
        for owner in inspector._owners:
            module = owner.ref() if owner.ref is not None else None
            if module is None or not _compiled(module):
                continue
            name = owner.name
            prefix = name + "." if name else ""
            if any(name == outer or name.startswith(outer + ".") for outer, _ in missing):
                continue  # inside a compiled module already named
            wrapped = prefix + _COMPILED_PREFIX  # an OptimizedModule's model: the module itself
            inside = [n for n in names if n.startswith(prefix) and n not in (name, wrapped)]
            if not inside or any(n in recorded for n in inside):
                continue
            # A compiled model's own hooks run outside its graph; an in-place compiled submodule's
            # do not, so for it the model having run is what there is to go by.
            if name and isinstance(module, torch._dynamo.eval_frame.OptimizedModule) \
                    and not {name, wrapped} & recorded:
                continue
            missing.append((name, inside))
        return [(_shown_name(name), [_shown_name(n) for n in inside]) for name, inside in missing]

    def records_gradient_at(self, position):
        """Whether the graph record at `position` is a gradient's (host reads of the cursor and the
        log: for the rare GradScaler skip, whose overflowing gradients are no trip)."""
        if not self.owns(position):
            return False
        calls = int(self.cursor[schema.CURSOR_CALLS].item())
        log = self.log.cpu().tolist()
        for call in range(calls - 1, max(-1, calls - self.log_rows - 1), -1):
            slot_id, start, _ = log[call % self.log_rows]
            if start <= position and 0 <= slot_id < len(_slots):
                slot = _slots[slot_id]
                return position < start + slot.n_records and slot.section == "backward"
        return False

    @staticmethod
    def owns(position):
        """Whether a trip or headroom position is a graph record's."""
        return position >= schema.GRAPH_POSITION_BASE

    # -- after a trip: the host side ------------------------------------------------------------
    def _owner(self, owners, name):
        """The owner as eager mode names it: a compiled model's modules without the prefix of
        torch.compile's wrapper (its model's own frame is then the root's frame, "")."""
        inspector = self._inspector()
        owner = owners[name]
        root = inspector.model
        if root is not None and isinstance(root, torch._dynamo.eval_frame.OptimizedModule) and (
                name == _COMPILED_PREFIX or name.startswith(_COMPILED_PREFIX + ".")):
            return ShownOwner(owner, name[len(_COMPILED_PREFIX) + 1:], is_root=name == _COMPILED_PREFIX)
        return owner

    def logged_frames(self, first_batch):
        """(frames, host copy of the graph ring, end position): the logged frames of batches from
        `first_batch` on whose records are still in the ring. Host reads: cursor, log, ring."""
        end, calls, _ = self.cursor.tolist()
        log = self.log.cpu().tolist()
        host = self.ring.cpu().numpy()
        floor = int(self.floor_calls.item()) if self.floor_calls is not None else 0
        owners = {owner.name: owner for owner in self._inspector()._owners}
        frames = []
        for call in range(max(floor, calls - self.log_rows), calls):
            slot_id, start, batch = log[call % self.log_rows]
            if batch < first_batch or start < end - self.records or not 0 <= slot_id < len(_slots):
                continue
            slot = _slots[slot_id]
            if slot.owner_name not in owners:
                continue
            n = len(slot.dtypes)
            shapes = list(_slot_shapes.get(slot_id, ((),) * n))
            positions = [start + i for i in range(n)]
            if slot.section != "forward":
                name, class_name, label = gradient_label(slot.entries or [_gradient_fallback[slot_id]])
                frames.append(_frames.Frame(self._gradient_owner(owners, name, class_name), batch, start, [label],
                                            list(slot.kinds), list(slot.dtypes), shapes, slot.section, None,
                                            slot.n_records, False, False, positions, start))
                continue
            frames.append(_frames.Frame(self._owner(owners, slot.owner_name), batch, start, list(slot.labels),
                                        list(slot.kinds), list(slot.dtypes), shapes,
                                        "forward", None, slot.n_records, True, True, positions, start))
        return frames, host, end

    def _gradient_owner(self, owners, name, class_name):
        """The owner of a gradient frame as eager mode's record_frame makes it: the module's name
        (without torch.compile's wrapper prefix) and class, no weights, not a root frame."""
        shown = self._owner(owners, name).name if name in owners else name
        key = (shown, class_name)
        owner = self._gradient_owners.get(key)
        if owner is None:
            owner = self._gradient_owners[key] = _frames.Owner(-1, shown, class_name)
        return owner

    def report_view(self, ring, host_ring):
        """The frames a report of a graph trip reads (eager and graph frames in call order) and
        the host records of both rings."""
        first_batch = ring.frames[0].batch if ring.frames else self._inspector()._batch_index()
        graph_frames, graph_host, graph_end = self.logged_frames(first_batch)
        view = ReportView(ring, graph_frames)
        return view, HostRecords(host_ring, ring.pos, graph_host, graph_end)


class ShownOwner(_frames.Owner):
    """A module of a compiled model under its eager name, for a report. Its headroom is the
    module's own (a module that warned stays quiet)."""
    __slots__ = ("source",)

    def __init__(self, source, name, is_root):
        self.source = source
        super().__init__(source.index, name, source.cls, source.ref, headroom=source.headroom)
        self.wnames, self.widx, self.flag = source.wnames, source.widx, source.flag
        self.is_root = self.is_top = is_root

    @property
    def headroom(self):
        return self.source.headroom

    @headroom.setter
    def headroom(self, value):
        self.source.headroom = value


def _is_compiled_wrapper(owner):
    module = owner.ref() if owner.ref is not None else None
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def _top_forward(frame):
    return frame.owner.is_top and frame.section == "forward"


class ReportView:
    """What ReportBuilder.build_report reads of a FrameRing (`frames`, `floor`, `find_offender`), with
    graph frames merged in: a batch's graph frames go before its root's (or a top module's)
    forward frame, which returns after the graph ran, and after the batch's other frames."""

    def __init__(self, ring, graph_frames):
        gradient_frames = [f for f in graph_frames if f.section != "forward"]
        graph_frames = [f for f in graph_frames if f.section == "forward"]
        merged = []
        floor = None
        g = 0
        shown_roots = {f.batch for f in graph_frames if f.owner.is_root}
        for i, frame in enumerate(ring.frames):
            while g < len(graph_frames) and graph_frames[g].batch < frame.batch:
                merged.append(graph_frames[g])
                g += 1
            if i == ring.floor:
                floor = len(merged)
            while g < len(graph_frames) and graph_frames[g].batch == frame.batch and _top_forward(frame):
                merged.append(graph_frames[g])
                g += 1
            if frame.owner.is_root and frame.batch in shown_roots and _is_compiled_wrapper(frame.owner):
                # torch.compile's wrapper: its model's own frame, recorded in the graph, is the root's.
                continue
            merged.append(frame)
        if floor is None:  # the floor is past every eager frame (a traced batch ended last)
            floor = len(merged)
        merged.extend(graph_frames[g:])
        if gradient_frames:
            at_floor = merged[floor] if floor < len(merged) else None
            merged = _place_gradients(merged, gradient_frames)
            floor = len(merged) if at_floor is None else next(i for i, f in enumerate(merged) if f is at_floor)
        self.frames = _move_batch_starts(merged, ring.frames)
        self.floor = floor

    def find_offender(self, trip_pos):
        for i in range(len(self.frames) - 1, -1, -1):
            f = self.frames[i]
            if f.start <= trip_pos < f.start + f.n_records:
                return i
        return None


def _is_parameter_gradients(frame):
    return frame.section == "backward" and bool(frame.labels) and frame.labels[-1].endswith(".grad")


def _place_gradients(frames, gradient_frames):
    """A batch's gradient frames recorded in graphs go after its forward frames and before the
    parameter gradients recorded eagerly at the optimizer step (which runs after the backward)."""
    out = []
    g = 0
    for f in frames:
        while g < len(gradient_frames) and (gradient_frames[g].batch < f.batch or (
                gradient_frames[g].batch == f.batch and _is_parameter_gradients(f))):
            out.append(gradient_frames[g])
            g += 1
        out.append(f)
    out.extend(gradient_frames[g:])
    return out


def _move_batch_starts(frames, eager_frames):
    """The "Starting batch number" line goes before a batch's first module frame, which may now
    be a graph frame."""
    starts = {}
    for f in eager_frames:
        if f.batch_start is not None:
            starts.setdefault(f.batch, f.batch_start)
    out = list(frames)
    first_hf = {}
    for i, f in enumerate(out):
        if f.hf and f.batch not in first_hf:
            first_hf[f.batch] = i
        if f.batch_start is not None:
            out[i] = f._replace(batch_start=None)
    for batch, start in starts.items():
        i = first_hf.get(batch)
        if i is not None:
            out[i] = out[i]._replace(batch_start=start)
    return out


class HostRecords:
    """The host copies of the eager ring and the graph ring, looked up by position."""

    def __init__(self, eager, eager_end, graph, graph_end):
        self.eager = eager
        self.eager_end = eager_end
        self.graph = graph
        self.graph_end = graph_end
        self.shape = eager.shape

    def record_at(self, position):
        """The record at `position` as a list of floats, or None when it was overwritten."""
        if position >= schema.GRAPH_POSITION_BASE:
            host, end = self.graph, self.graph_end
        else:
            host, end = self.eager, self.eager_end
        size = host.shape[0]
        if position < end - size:
            return None
        return [float(v) for v in host[position % size]]
