"""Replay on trip (``watch(model, replay=True)`` / ``NUMGUARD_REPLAY=1``): name the first bad
operation without paying for operation mode at every step.

While watching, a forward pre-hook on each module keeps the inputs of its last call (references,
not copies: nothing is copied on the device; lists, tuples and dicts item by item, so a forward
that changes a container argument, e.g. a cache update, does not change what is replayed), the
version counters of the tensors among them and the state of the random generator of the model's
device. After a trip, the first module with a non-finite value is run again on those inputs, with
gradients off, the generator state restored and its parameters and buffers put back afterwards
(a forward may change them: an EMA, running statistics, ``weight.data.mul_``), under a dispatch
mode that looks at each operation's output: the first operation whose output is non-finite is
added to the report.

The replay says so instead of guessing when it cannot be trusted: an input (or a tensor inside a
container argument) changed in place after the call (its version counter moved; the replay
names it, e.g. ``input[1][0]``), the module's last call is not the call that tripped (a later
call, or a later batch), or the replay gives finite values (the NaN/Inf did not reproduce:
dropout or another random draw, a data race, or state the module changed: parameters a forward
changes are put back after the replay, but the replay starts from the values they had at the
trip, after the call that tripped changed them).

Memory: the kept references hold each module's last inputs (at most one call per module) only
until the check that finds their batch healthy, which lets them go. With gradients on, autograd
holds most of them for the backward anyway; under no_grad the tensor arguments are held weakly
(holding them would keep a whole forward's activations alive), so a replay needs them to still be
alive at the trip, and says so when they are not.
"""
from __future__ import annotations

import functools
import itertools
import weakref

import torch

from . import frames as _frames
from . import operations as _operations
from .features import Feature

_Tensor = torch.Tensor
_OptimizedModule = torch._dynamo.eval_frame.OptimizedModule


def _generator(device):
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else
                                             torch.cuda.current_device()]
    return torch.default_generator


class InputKeeper(Feature):
    """The last call of each watched module: (args, kwargs, batch, generator state), its tensors
    kept with their version counters (_keep_value)."""

    def __init__(self, inspector, device):
        self.inspector = inspector
        self.calls = {}   # owner index -> (args, kwargs, batch, rng state)
        self.generator = _generator(device)

    def hooks(self, owner, module):
        return module.register_forward_pre_hook(functools.partial(self._keep, owner), with_kwargs=True)

    def _keep(self, owner, module, args, kwargs):
        # One tuple per call: references, version counters, the generator state (no device work).
        if _is_compiling():
            # NOTE: [replay under torch.compile] Reading the generator state while dynamo traces
            # breaks the graph at every watched module, and references kept from inside a graph
            # would be tensors of the trace: modules inside compiled graphs keep nothing, and a
            # trip in one says that replay is not available for them.
            return None
        try:
            weak = not _grad_enabled()
            # Without autograd holding them, a strong reference would keep every activation of the
            # forward alive until the check: under no_grad tensors are kept weakly (a freed input:
            # no replay).
            args = tuple(_keep_value(x, weak) for x in args)
            kwargs = {k: _keep_value(v, weak) for k, v in kwargs.items()}
            self.calls[owner.index] = (args, kwargs, self.inspector._batch.done,
                                       self.generator.get_state())
        except Exception:   # numguard's failure must not fail the call: this one is not replayable
            self.calls.pop(owner.index, None)
        return None

    def release_through(self, batch):
        """Forget the calls of batches up to `batch` (a check found them healthy), so that the
        kept references do not hold a batch's activations alive longer than the batch."""
        calls = self.calls
        if all(call[2] <= batch for call in calls.values()):
            calls.clear()
        else:
            self.calls = {k: call for k, call in calls.items() if call[2] > batch}

    def install(self, owners, handles):
        """Keep the inputs of every watched module (its pre-hooks go to `handles`)."""
        for owner in owners:
            module = owner.ref()
            if module is not None:
                handles.append(self.hooks(owner, module))

    def device_moved(self, device):
        self.generator = _generator(device)
        self.calls.clear()

    def frames_confirmed(self, ring, start, boundary):
        if boundary > 0:  # inputs of confirmed batches can no longer be replayed: let them go now
            self.release_through(ring.frames[boundary - 1].batch)

    def annotate_report(self, report, offender, frames):
        replayed = replay(self.inspector, self, offender, report)
        if replayed is not None:
            report["replay"] = replayed


_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling
COMPILED_REASON = ("replay is not available for modules of a compiled model (torch.compile): numguard "
                   "keeps no inputs inside compiled graphs (that would break the graph at every module); "
                   "to name the operation, run the failing batch without torch.compile under "
                   "watch(model, ops=True) or replay=True")


class _Weak(weakref.ref):
    """A kept input held weakly (a forward under no_grad)."""
    __slots__ = ()


class _Kept:
    """A tensor argument as the call saw it: the tensor (or a weak reference) and its version
    (None for an inference tensor, which has no version counter)."""
    __slots__ = ("ref", "version")

    def __init__(self, x, weak):
        self.version = None if x.is_inference() else x._version
        self.ref = _Weak(x) if weak and type(x) is _Tensor else x

    def tensor(self):
        """The kept tensor, or None when it was held weakly and freed."""
        return self.ref() if type(self.ref) is _Weak else self.ref


class _Container:
    """A list, tuple or dict argument as the call saw it: its items (kept), in a container of
    numguard's own, so that a forward that changes the container (a cache update, a pop) does not
    change what the replay is given."""
    __slots__ = ("kind", "items")

    def __init__(self, kind, items):
        self.kind = kind
        self.items = items


def _keep_value(value, weak):
    """A call's argument kept for a replay: tensors with their version counter, plain lists, tuples
    and dicts item by item (no device work), anything else by reference."""
    kind = type(value)
    if kind is _Tensor or isinstance(value, _Tensor):
        return _Kept(value, weak)
    if kind is list or kind is tuple:
        return _Container(kind, [_keep_value(v, weak) for v in value])
    if kind is dict:
        return _Container(kind, {k: _keep_value(v, weak) for k, v in value.items()})
    return value


class _NotReplayable(Exception):
    """Why a kept call cannot be replayed (the replay's reason)."""


_FREED = ("its inputs were freed after the call: a forward without gradients keeps no activation "
          "alive, so numguard held them only weakly (use ops=True to name the operation in such forwards)")


def _rebuild(kept, label, fingerprinted):
    """The value a kept argument had at the call (fresh containers, the same tensors); raises
    _NotReplayable when a tensor was freed or changed in place since, or is an inference tensor
    whose changes nothing but a fingerprint of the values (`fingerprinted`) would show."""
    kind = type(kept)
    if kind is _Kept:
        x = kept.tensor()
        if x is None:
            raise _NotReplayable(_FREED)
        if kept.version is None and not fingerprinted:
            raise _NotReplayable(f"{label} is an inference tensor (made under torch.inference_mode): it has no "
                                 "version counter, so a change in place since the call could not be seen")
        if kept.version is not None and x._version != kept.version:
            raise _NotReplayable(f"{label} was changed in place after the call (its version counter moved), "
                                 "so its values are no longer those the module saw")
        return x
    if kind is _Container:
        if kept.kind is dict:
            return {k: _rebuild(v, _frames.key_label(label, k), fingerprinted) for k, v in kept.items.items()}
        return kept.kind(_rebuild(v, f"{label}[{i}]", fingerprinted) for i, v in enumerate(kept.items))
    return kept


def _resolve(args, kwargs, fingerprinted=False):
    """The kept call's arguments as the module saw them (_rebuild). `fingerprinted`: the caller
    compares a fingerprint of the values, so inference tensors (no version counter) may be used."""
    args = tuple(_rebuild(a, f"input[{i}]", fingerprinted) for i, a in enumerate(args))
    kwargs = {k: _rebuild(v, k, fingerprinted) for k, v in kwargs.items()}
    return args, kwargs


def _kept_items(kept, label):
    """(label, _Kept) of every tensor in a kept argument, labelled as _rebuild labels them."""
    if type(kept) is _Kept:
        yield label, kept
    elif type(kept) is _Container:
        items = kept.items.items() if kept.kind is dict else enumerate(kept.items)
        for key, value in items:
            yield from _kept_items(value, _frames.key_label(label, key) if kept.kind is dict else f"{label}[{key}]")


def changed_in_place(args, kwargs):
    """The label of the first kept tensor whose version counter moved since it was kept, or None."""
    for label, kept in itertools.chain(*(_kept_items(a, f"input[{i}]") for i, a in enumerate(args)),
                                       *(_kept_items(v, k) for k, v in kwargs.items())):
        x = kept.tensor()
        if x is not None and kept.version is not None and x._version != kept.version:
            return label
    return None


class ReplayRecorder(_operations.OperationRecorder):
    """Operation mode for a replay: instead of recording, it looks at each output on the host
    (a replay runs once, after a trip) and keeps the first non-finite one."""

    def __init__(self, inspector, top_owner):
        super().__init__(inspector)
        self.top = top_owner
        self.found = None   # (op, site, module owner)
        self.entered = True

    def _stats_before(self, func, args, kwargs):
        return None   # outputs are looked at directly: no input records to correct

    def _record(self, func, args, kwargs, out, before=None):
        if self.found is not None:
            return
        picked = self._pick(func, args, kwargs, out)
        if picked is None:
            return
        op, _, outs, _ = picked
        if any(x.numel() and not bool(torch.isfinite(x).all()) for x in outs):
            self.found = (op, _operations.call_site(), self.stack[-1] if self.stack else self.top)


def _later_call(frames, offender):
    owner = frames[offender].owner
    return any(f.owner is owner and f.section == "forward" for f in frames[offender + 1:])


def _compiled(module):
    return any(isinstance(m, _OptimizedModule) for m in module.modules())


def replay(inspector, keeper, offender, report=None) -> dict | None:
    """Re-run the module of the offending frame `offender` on its kept inputs; the report's
    "replay" field (None when there is nothing to replay: an operation frame names it already).
    `report`: the trip's report (its module and class name the offender of a compiled model)."""
    graph = inspector._graph
    if graph is not None and graph.used:
        # The offender indexes the frames merged with those of compiled graphs (NOTE: [replay
        # under torch.compile]): not replayable, and said so at the trip.
        inspector._warn_once(("replay", "compiled"), f"numguard: {COMPILED_REASON}")
        report = report or {}
        return {"module": report.get("module"), "class": report.get("class"), "reproduced": False, "op": None,
                "site": None, "op_module": None, "op_class": None, "reason": COMPILED_REASON}
    frames = inspector._ring.frames
    frame = frames[offender]
    owner = frame.owner
    if isinstance(owner, _operations.OpOwner):
        return None
    result = {"module": owner.name, "class": owner.cls, "reproduced": False, "op": None, "site": None,
              "op_module": None, "op_class": None, "reason": ""}
    module = owner.ref() if owner.ref is not None else None
    if module is not None and _compiled(module):
        inspector._warn_once(("replay", "compiled"), f"numguard: {COMPILED_REASON}")
        result["reason"] = COMPILED_REASON
        return result
    if frame.section != "forward" or module is None or owner.index < 0:
        where = f"the {frame.section} pass" if frame.section != "forward" else "a frame of record_frame"
        result["reason"] = f"the first non-finite value is in {where}; replay re-runs module forwards only"
        return result
    call = keeper.calls.get(owner.index)
    if call is None:
        result["reason"] = "no call of it was kept"
        return result
    args, kwargs, batch, rng = call
    if batch != frame.batch or _later_call(frames, offender):
        result["reason"] = ("its inputs kept are those of a later call than the one that tripped "
                            f"(batch {batch})")
        return result
    try:
        args, kwargs = _resolve(args, kwargs)
    except _NotReplayable as exc:
        result["reason"] = str(exc)
        return result
    try:
        saved = _save_state(module)
    except Exception as exc:   # e.g. no memory for a copy of its parameters
        result["reason"] = (f"could not save its parameters and buffers to restore them after the replay "
                            f"({type(exc).__name__}: {exc}), so it was not replayed")
        return result
    try:
        found = _run(inspector, keeper, module, owner, args, kwargs, rng, saved)
    except _NotRestored as exc:
        result["reason"] = str(exc)
        return result
    except Exception as exc:   # numguard's replay must never hide the trip
        result["reason"] = f"the replay raised {type(exc).__name__}: {exc}"
        return result
    if found is None:
        result["reason"] = ("its forward on the same inputs (grad off, random state restored) gave "
                            "finite values: the NaN/Inf did not reproduce (dropout or another random "
                            "draw, a data race, or state the module changed since)")
        return result
    op, site, op_owner = found
    result.update(reproduced=True, op=op, site=site, op_module=op_owner.name, op_class=op_owner.cls)
    return result


class _NotRestored(Exception):
    """The replay ran but a parameter or buffer could not be put back."""


def _save_state(module):
    """Copies of the module's parameters and buffers (its forward may change them: an EMA, a
    running statistic, a ``weight.data.mul_``), each tensor once."""
    saved, seen = [], set()
    for t in itertools.chain(module.parameters(), module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            saved.append((t, t.detach().clone()))
    return saved


def _restore_state(saved):
    """Put the parameters and buffers back as they were before the replay, through .data so that
    no version counter moves (a pending backward still finds the tensors it saved)."""
    failed = []
    with torch.no_grad():
        for t, copy in saved:
            try:
                t.data.copy_(copy)
            except Exception as exc:
                failed.append(f"{tuple(t.shape)} ({type(exc).__name__}: {exc})")
    if failed:
        raise _NotRestored("the replay could not restore the parameters or buffers of shape "
                           f"{', '.join(failed)} its forward changed; they keep the replay's values")


def _run(inspector, keeper, module, owner, args, kwargs, rng, saved):
    owners = {}
    for o in inspector._owners:
        m = o.ref() if o.ref is not None else None
        if m is not None:
            owners.setdefault(id(m), o)
    recorder = ReplayRecorder(inspector, owner)
    handles = []
    for sub in module.modules():
        sub_owner = owners.get(id(sub))
        if sub_owner is not None:
            handles.append(sub.register_forward_pre_hook(
                functools.partial(_operations_push, recorder, sub_owner)))
            handles.append(sub.register_forward_hook(
                functools.partial(_operations_pop, recorder, sub_owner), always_call=True))
    generator = keeper.generator
    state = generator.get_state()
    closed, depth = inspector._batch.closed, inspector._batch.depth
    inspector._batch.closed = True    # the inspector's own hooks stay quiet during the replay
    inspector._batch.depth = depth + 1
    try:
        generator.set_state(rng)
        with torch.no_grad(), recorder:
            module(*args, **kwargs)
    finally:
        inspector._batch.closed, inspector._batch.depth = closed, depth
        generator.set_state(state)
        for h in handles:
            h.remove()
        _restore_state(saved)
    return recorder.found


def _operations_push(recorder, owner, module, args):
    recorder.push(owner)


def _operations_pop(recorder, owner, module, args, output):
    recorder.pop(owner)
