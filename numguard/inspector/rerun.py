"""Rerun and attribution (``watch(model, rerun=True)`` / NUMGUARD_RERUN=1): after a trip, run the
batch's forward again to tell a glitch of the device from a fault in the data or the model.

NOTE: [rerun verdict]
At each root call the inputs are kept by reference (as replay keeps a module's: tensors with their
version counters, containers item by item; nothing is copied on the device) with the state of
the random generators (CPU and the model's device). When a check finds a NaN/Inf in a batch whose
call is kept, the root forward runs again on those inputs, on the same device, under the same
grad and autocast mode (the rerun runs inside the check), with the generators put back to their
state at the call, and the module's buffers put back afterwards (a rerun must not count
BatchNorm's running statistics twice). During the rerun every watched module's outputs are looked
at (on the device; read once after the rerun), and:
- every output finite: the same computation on the same inputs gave another answer, so the first
  result was corrupted on the way (a bit flip in a register or in memory, a race): "transient";
- a module's output non-finite again: the fault repeats on this device: "reproducible" (the data
  or the model: the batch and the module are named). In a multi-rank job a data-parallel peer then
  runs the same inputs: "device" when it does not reproduce it, "reproducible" when it does, and
  every rank learns the verdict (NOTE: [device verdict] in numguard.inspector.peer_verdict).
A spike (an output's abs max, or the loss) is judged the same way by the spiked value in the
rerun: back at or above the geometric middle of spike and baseline, "reproducible"; else
"transient". A rerun that cannot run (inputs changed in place or freed, or overwritten in a way
their version counters do not show: a device fingerprint of the inputs, 2-norms and sums, made at
the call and compared at the rerun; a sharded model whose forward runs collectives; the rerun
raising) gives no verdict and says why.

NOTE: [inputs the model writes]
A model that changes its own input in place during its forward (``x.mul_(2)``, a cache it fills)
leaves nothing to rerun from: the kept references hold the changed values. The root's return sees
the version counter moved during the call; from the next call on, the root's tensor inputs are
copied at each call (one copy on the device per input, no wait) and the copies are kept instead.
A trip in the batch that showed it gets no verdict and says so. Inference tensors
(``torch.inference_mode``) have no version counter: they are kept as they are, the fingerprint
alone tells whether they changed, and the rerun runs in inference mode as the call did.

Recovery (``recover=True``, the default with rerun): a transient fault found at the root's return
(``check="sync"``; in a multi-rank job when every rank that tripped can recover its batch, agreed
in the trip's handling: NOTE: [device verdict]) is recovered: the rerun's output, with its
autograd graph, is returned in place of the corrupted one, the step goes on, and a
NonFiniteWarning with the verdict says so. A fault found later (at the optimizer
step with backward=True, with check="async" or check_every > 1) is not recovered, and the verdict
says why.

Memory: the kept references hold the inputs of the batches not yet checked (at most
``check_every + 1``, one more with spikes) until their check; a DDP-wrapped model is rerun through
its ``.module`` (DDP's forward would start collectives the other ranks never join).
"""
from __future__ import annotations

import collections
import functools
import itertools
import socket

import torch
from torch.nn.parameter import is_lazy

from .. import patches as _patches
from .. import process as _process
from ..errors import Attribution
from . import norm_stats as _norm_stats
from . import operations as _operations
from . import replay as _replay
from . import spikes as _spikes
from .features import Feature
from .peer_verdict import PeerVerdicts

try:
    from torch.nn.parallel import DistributedDataParallel as _DDP
except Exception:  # noqa: BLE001 - a torch without distributed
    _DDP = ()

_Tensor = torch.Tensor
_VALUE, _STATISTICS = "the non-finite value in", "the non-finite running statistics of"
# What a forward writes: module frames, its operations (ops=True), the running statistics it
# updates (NOTE: [running statistics]); a rerun of the forward judges a trip in any of them.
_FORWARD_SECTIONS = ("forward", _operations.SECTION, _norm_stats.SECTION)
_NOT_KEPT = 64   # the batches whose reason for keeping no call is remembered
BRACKETED = ("the batch was bracketed by inspector.batch(), as the Lightning callback brackets each step: a rerun "
             "reruns one call of the root module, not a whole step; wrap the step in numguard.rerun_step(fn) "
             "to rerun it")


class _Call:
    """A root call kept for a rerun: its inputs (replay's kept values), the generators' states."""
    __slots__ = ("batch", "args", "kwargs", "grad", "inference", "cpu_rng", "device_rng", "output", "versions",
                 "before", "changed", "fingerprint", "copied", "written")

    def __init__(self, batch, args, kwargs, grad, cpu_rng, device_rng):
        self.batch, self.args, self.kwargs, self.grad = batch, args, kwargs, grad
        self.inference = torch.is_inference_mode_enabled()
        self.cpu_rng, self.device_rng = cpu_rng, device_rng
        self.output = None   # the first run's output, once the call returned
        self.versions = ()   # (buffer, version counter) at the call
        self.before = {}     # id(buffer) -> its copy at the call, for the buffers forwards update
        self.changed = None  # ids of the buffers the call changed, once it returned
        self.fingerprint = None  # _fingerprint of the inputs at the call
        self.copied = False      # the inputs kept are copies (the model writes its own inputs)
        self.written = None      # the label of an input the call itself changed in place


def rerun_target(model):
    """(the module a rerun calls, or None; why not): a DDP model's ``.module`` (DDP's forward
    would start collectives the other ranks never join); none when its forward runs collectives
    of its own (FSDP, SyncBatchNorm in training)."""
    if model is None:
        return None, "the model is gone"
    if isinstance(_DDP, type) and isinstance(model, _DDP):
        model = model.module
    for m in model.modules():
        name = type(m).__name__
        if name in ("FullyShardedDataParallel", "FSDPModule") or name.startswith("FSDP"):
            return None, ("the model is sharded (FSDP): its forward runs collectives the other ranks "
                          "would not join, so it was not rerun alone")
        if isinstance(m, torch.nn.SyncBatchNorm) and m.training:
            return None, ("the model's SyncBatchNorm runs collectives in its forward that the other ranks "
                          "would not join, so it was not rerun alone")
    return model, ""


def output_tensors(value, out):
    """The tensors inside an output (tuples, lists, dicts and ModelOutput, dataclass fields)."""
    if isinstance(value, _Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            output_tensors(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            output_tensors(v, out)
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            output_tensors(getattr(value, name, None), out)
    return out


def _fingerprint(values):
    """A device summary of the tensors in a call's inputs (the 2-norms of the floating ones, the
    sums of the others, their bits as float64), to tell at a rerun whether they were overwritten
    in a way their version counters do not show (a numpy, ``.data`` or DLPack write into a reused
    buffer). None when there is nothing to summarize or it cannot be made (mixed devices, a tensor
    subclass). A few launches per call whatever the number of inputs, no wait."""
    try:
        args, kwargs = values
        # one tensor argument (the common case) without the walk through containers
        one = not kwargs and len(args) == 1 and type(args[0]) is _Tensor
        tensors = [args[0]] if one else output_tensors(values, [])
        xs = [x.detach() if x.requires_grad else x for x in tensors if type(x) is _Tensor
              and x.layout == torch.strided and x.numel() and not x.is_complex()]
        floats = [x for x in xs if x.is_floating_point()]
        others = [x for x in xs if not x.is_floating_point()]
        parts = []
        if len(floats) == 1:   # one input (the common case): one launch
            parts.append(torch.linalg.vector_norm(floats[0], dtype=torch.float64).view(1))
        elif floats:
            parts.append(torch.stack(torch._foreach_norm(floats, 2, dtype=torch.float32)).double())
        if others:
            sums = [x.sum(dtype=torch.int64) for x in others]
            parts.append((sums[0].view(1) if len(sums) == 1 else torch.stack(sums)).view(torch.float64))
        return (parts[0] if len(parts) == 1 else torch.cat(parts)) if parts else None
    except Exception:  # noqa: BLE001 - no fingerprint: the version counters alone tell
        return None


def _copy_tensors(value):
    """`value` with every tensor in it (tuples, lists, dicts) copied on its device, detached, no wait."""
    if isinstance(value, _Tensor):
        with torch.no_grad():
            return value.detach().clone().requires_grad_(value.requires_grad)
    if type(value) in (list, tuple):
        return type(value)(_copy_tensors(v) for v in value)
    if type(value) is dict:
        return {k: _copy_tensors(v) for k, v in value.items()}
    return value


def _bits(x):
    """A tensor's bytes as one flat uint8 tensor (NaN == NaN, -0.0 != 0.0)."""
    x = x.detach().contiguous()
    return x.reshape(-1).view(torch.uint8) if x.numel() else x.reshape(-1).to(torch.uint8)


def identical(a, b) -> bool:
    """Whether two outputs hold the same tensors bit for bit (shapes, dtypes and bytes)."""
    xs, ys = output_tensors(a, []), output_tensors(b, [])
    if len(xs) != len(ys):
        return False
    for x, y in zip(xs, ys):
        if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
            return False
        if not torch.equal(_bits(x), _bits(y)):
            return False
    return True


def _statistics_flags(norms, names):
    """((name, class, what), device bool) for the running statistics a rerun updated (NOTE:
    [running statistics]) of the BatchNorm-like modules `norms`: non-finite again, the rerun
    reproduced a trip in them."""
    found = []
    for m in norms:
        if not (m.training and m.track_running_stats) or id(m) not in names:
            continue
        stats = [b.detach() for b in (m.running_mean, m.running_var) if b is not None and b.is_floating_point()]
        if stats:
            found.append(((*names[id(m)], _STATISTICS), torch.stack([~torch.isfinite(b).all() for b in stats]).any()))
    return found


def _unrestored(call):
    """How many buffers the call changed that were not copied at the call."""
    return sum(1 for i in (call.changed or ()) if i not in call.before)


def _why_not_recovered(opts, found_at_return, unrestored) -> str:
    """Why a transient fault was not recovered, under the watch options `opts`."""
    if found_at_return and unrestored:
        return (f"the corrupted forward changed {unrestored} buffer(s) numguard held no copy of (the first "
                "batch's, or buffers a forward had not changed before)")
    if opts.backward:
        return ("with backward=True a training forward is checked with its optimizer step, after the backward "
                "has used the corrupted output; decorate the step (forward and backward) with "
                "@numguard.rerun_step to recover it")
    return (f"the fault was found after the batch had returned (check={opts.check!r}, "
            f"check_every={opts.check_every}); a forward is recovered when it is checked at its return "
            "(check='sync', check_every=1)")


class RootRerun(Feature):
    """The root's kept calls and the rerun that judges a trip (NOTE: [rerun verdict])."""

    def __init__(self, inspector, device, recover=True):
        self.inspector = inspector
        self.recover = recover
        self.device = device
        self.generator = self._device_generator(device)   # None on the CPU (its state is kept anyway)
        self.calls = collections.OrderedDict()   # batch -> _Call
        opts = inspector.options
        self.keep = opts.check_every + 1 + (1 if opts.spikes else 0)
        self.running = False
        self.replacement = None                  # a recovered output, returned by the root's hook
        self.returning = None                    # the batch whose root call is returning now
        self.model_ref = inspector._model_ref
        self.results = inspector.verdicts        # every verdict, as Attribution
        self.updated = ()                        # buffers the last call changed (copied at each call)
        self.buffers = None                      # (module, name) of the model's buffers (_buffer_versions)
        self.norms = []                          # the model's BatchNorm-like modules
        self.peers = PeerVerdicts(self)          # multi-rank: the peer's rerun (NOTE: [device verdict])
        self.lazy = False                        # lazy modules not yet made (nn.LazyLinear, ...)
        self.copy_inputs = False                 # the model writes its own inputs: keep copies of them
        self.not_kept = collections.OrderedDict()   # batch -> why its call could not be kept (the last few)
        self.registration = []                   # numguard.patches of the registration hooks

    def install(self, model, handles):
        """A pre-hook keeping the root's inputs, a first forward hook keeping its output, and a
        last one returning a recovered output."""
        # BatchNorm's kernels update its running statistics without moving their version counters.
        self.norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)]
        self.lazy = any(isinstance(m, torch.nn.modules.lazy.LazyModuleMixin) for m in model.modules())
        # process-wide hooks: through the one list of numguard's patches, undone at close()
        self.registration = [_patches.add_hook(register, self._relist, target=f"{register.__name__} (rerun=True, "
                                               f"inspector {id(self.inspector):#x})",
                                               why="list the model's buffers again when one is registered")
                             for register in (torch.nn.modules.module.register_module_buffer_registration_hook,
                                              torch.nn.modules.module.register_module_module_registration_hook)]
        handles.append(model.register_forward_pre_hook(
            torch.compiler.disable(self._keep), with_kwargs=True))
        handles.append(model.register_forward_hook(
            torch.compiler.disable(self._returned), prepend=True))
        handles.append(model.register_forward_hook(torch.compiler.disable(self._swap)))

    # -- keeping the calls (no device work) ------------------------------------------------------
    def begin_batch(self, batch):
        if self.inspector._hooks.bracketing:   # the step is the batch, not a root call: nothing kept
            self._cannot_keep(batch, BRACKETED)

    def _keep(self, module, args, kwargs):
        insp = self.inspector
        if self.running or insp._batch.depth != 1 or insp._batch.closed:
            return None
        self.replacement = self.returning = None
        if self.lazy:
            # A lazy module's first forward makes its weights and statistics (drawing from the random
            # generator): the state that call started from cannot be set again for a rerun.
            self.lazy = any(map(is_lazy, itertools.chain(module.parameters(), module.buffers())))
            if self.lazy:
                self._cannot_keep(insp._batch.done, "lazy modules made their parameters during it, so the state it "
                                                    "started from cannot be set again")
                return None
        try:
            copied = self.copy_inputs
            if copied:   # NOTE: [inputs the model writes]
                args, kwargs = _copy_tensors(args), _copy_tensors(kwargs)
            call = _Call(insp._batch.done, tuple(_replay._keep_value(a, False) for a in args),
                         {k: _replay._keep_value(v, False) for k, v in kwargs.items()},
                         torch.is_grad_enabled(), torch.random.get_rng_state(), self._device_rng_state())
            call.copied = copied
            # The buffers a forward updates (BatchNorm's statistics; learned from the last call) are
            # copied: a corrupted forward poisons them, and a rerun or a recovery starts from these.
            call.versions = self._buffer_versions(module)
            copied = [b for b, _ in call.versions if id(b) in self.updated] + [
                b for m in self.norms if m.training and m.track_running_stats
                for b in (m.running_mean, m.running_var, m.num_batches_tracked)
                if b is not None and id(b) not in self.updated]
            if copied:   # one multi-tensor launch per device and dtype, no wait
                call.before = dict(zip(map(id, copied), torch._foreach_mul([b.detach() for b in copied], 1)))
            call.fingerprint = _fingerprint([args, kwargs])
            self.calls[call.batch] = call
            while len(self.calls) > self.keep:
                self.calls.popitem(last=False)
        except Exception as exc:  # numguard's failure must not fail the call: no rerun of this one
            self.calls.pop(insp._batch.done, None)
            self._cannot_keep(insp._batch.done, f"{type(exc).__name__}: {exc}")
        return None

    def _cannot_keep(self, batch, why):
        self.not_kept[batch] = why
        while len(self.not_kept) > _NOT_KEPT:   # a check folds a few batches (accumulation, check_every)
            self.not_kept.popitem(last=False)

    def _buffer_versions(self, module):
        """(buffer, version counter) of the model's buffers. They are listed once, and again after
        any buffer or module is registered (setattr, register_buffer, add_module): a walk of every
        module at every call cost more than the rest of keeping it."""
        if self.buffers is None:
            self.buffers = [(m, name) for m in module.modules() for name in m._buffers]
        return [(b, b._version) for m, name in self.buffers if (b := m._buffers.get(name)) is not None]

    def _relist(self, *registered):
        self.buffers = None

    def _returned(self, module, args, output):
        insp = self.inspector
        if self.running or insp._batch.depth != 1:
            return None
        call = self.calls.get(insp._batch.done)
        if call is not None:
            call.output = output
            self.updated = {id(b) for b, v in call.versions if b._version != v}
            call.changed = self.updated | set(call.before)
            self.returning = call.batch
            if not call.copied:
                call.written = _replay.changed_in_place(call.args, call.kwargs)
                self.copy_inputs = call.written is not None
        return None

    def _swap(self, module, args, output):
        out, self.replacement, self.returning = self.replacement, None, None
        return out

    @staticmethod
    def _device_generator(device):
        return _replay._generator(device) if device.type == "cuda" else None

    def _device_rng_state(self):
        return None if self.generator is None else self.generator.get_state()

    def device_moved(self, device):
        self.device = device
        self.generator = self._device_generator(device)
        self.calls.clear()

    def frames_confirmed(self, ring, start, boundary):
        if boundary > 0:
            healthy = ring.frames[boundary - 1].batch
            # A spike is read one check later, in any batch of this fold.
            keep_from = ring.frames[start].batch if self.inspector.options.spikes and start < boundary else healthy + 1
            for b in [b for b in self.calls if b < keep_from]:
                del self.calls[b]

    def close(self):
        self.calls.clear()
        self.replacement = None
        for patch in self.registration:
            _patches.restore(patch)

    # -- the rerun -------------------------------------------------------------------------------
    def annotate_report(self, report, offender, frames):
        frame = frames[offender]
        if frame.section not in _FORWARD_SECTIONS:
            result = {"verdict": None, "batch": frame.batch, "reason": (
                f"the first non-finite value is in the {frame.section} pass; watch(rerun=True) reruns the "
                "forward: wrap the step in numguard.rerun_step(fn) to rerun its backward too")}
        else:
            result = self.rerun(frame.batch, found_at_return=self._at_return(report, frame.batch))
        report["rerun"] = result

    def _at_return(self, report, batch):
        insp = self.inspector
        return (self.returning == batch and insp.options.check == "sync" and insp._batch.depth == 0
                and insp._batch.done == batch + 1)

    def rerun_spike(self, spike, module):
        """(verdict as an Attribution or None, why there is none) of a rerun of the batch of an
        output or loss spike (a dict of numguard.inspector.spikes) and
        judge it by the spiked module's output abs max (the root's |loss|) in the rerun: at or above
        the geometric middle of the spike and its baseline, the spike repeats ("reproducible");
        below it, "transient". Gradient spikes are not rerun (a forward does not give them)."""
        if spike.get("quantity") not in ("output abs max", _spikes.LOSS) or module is None:
            return None, ""
        result = self.rerun(spike["batch"], watch_module=module, spike=spike)
        if self.peers.active():
            return self.peers.spike_claimed(result, self.attribution(result))
        return self.attribution(result), result.get("reason", "")

    def rerun(self, batch, found_at_return=False, watch_module=None, spike=None) -> dict:
        """Rerun the root forward of `batch`; the report's "rerun" field (verdict, or why none).
        `watch_module`, `spike`: judge by this module's output abs max against the spike's."""
        result = {"verdict": None, "batch": batch, "reason": "", "recovered": False}
        call = self.calls.get(batch)
        model, reason = self.target()
        if call is None or self.model_ref() is None:
            why = self.not_kept.get(batch)
            result["reason"] = (f"the inputs of batch {batch} could not be kept at its call ({why})" if why else
                                f"the inputs of batch {batch} are no longer kept (they are kept until the "
                                "check after their batch)")
            return result
        if call.written is not None:
            result["reason"] = (f"{call.written} was changed in place during the call (the model writes its own "
                                "input), so its values are no longer those the model saw; numguard keeps a copy of "
                                "the inputs at each call from now on, so a later batch can be rerun")
            return result
        if model is None:
            result["reason"] = reason
            return result
        try:
            args, kwargs = _replay._resolve(call.args, call.kwargs, fingerprinted=call.fingerprint is not None)
        except _replay._NotReplayable as exc:
            result["reason"] = str(exc)
            return result
        if call.fingerprint is not None:
            now = _fingerprint([args, kwargs])
            if now is None or not torch.equal(_bits(now), _bits(call.fingerprint)):  # one read, at a rerun only
                result["reason"] = (f"the inputs of batch {batch} were overwritten since the call without their "
                                    "version counters moving (a numpy, .data or DLPack write into a reused buffer, "
                                    "or an in-place change of an inference tensor, which has no version counter), "
                                    "so a rerun would not see what the model saw")
                return result
        try:
            output, reproduced, watched, rerun_buffers = self._run(
                model, call, args, kwargs, watch_module, loss=spike is not None and spike["quantity"] == _spikes.LOSS)
        except Exception as exc:  # the rerun never hides the trip
            result["reason"] = f"the rerun raised {type(exc).__name__}: {exc}"
            return result
        same = None
        if call.output is not None:
            try:
                same = identical(call.output, output)
            except Exception:  # noqa: BLE001 - a comparison numguard cannot make is left out
                same = None
        result.update(identical=same, watched_abs_max=watched)
        if spike is not None:
            if watched is None:
                result["reason"] = f"the rerun did not call {spike['module'] or '(root module)'}"
                return result
            middle = (spike["value"] * max(spike["baseline"], 1e-300)) ** 0.5
            where = f"{spike['module'] or '(root module)'} ({spike['class']})"
            what = "a loss" if spike["quantity"] == _spikes.LOSS else "an output abs max"
            if watched >= middle:
                result.update(verdict="reproducible", module=spike["module"], **{"class": spike["class"]})
                result["detail"] = (f"a rerun of batch {batch} gave {where} {what} of {watched:.3e} "
                                    f"again (spike {spike['value']:.3e}, baseline {spike['baseline']:.3e})"
                                    + (": the spike comes from the data or the model; look at this batch"
                                       if not self.peers.active() else ""))
            else:
                result["verdict"] = "transient"
                result["detail"] = (f"a rerun of batch {batch} gave {where} {what} of {watched:.3e} "
                                    f"(spike {spike['value']:.3e}, baseline {spike['baseline']:.3e}): the spike "
                                    "did not repeat, the first result was corrupted on the way")
            self._verdict(model, call, args, kwargs, output, result, spike)
            return result
        if reproduced is None:
            result["verdict"] = "transient"
            result["detail"] = (f"a rerun of batch {batch} on the same inputs and device (random state restored) "
                                "gave finite values everywhere: the first result was corrupted on the way "
                                "(a bit flip in a register or memory, a race), not by the data or the model")
            unrestored = _unrestored(call)
            if found_at_return and self.recover and not unrestored:
                if self.peers.active():   # every rank agrees first (NOTE: [device verdict])
                    self.peers.tentative = (output, rerun_buffers)
                else:
                    self.commit(result, output, rerun_buffers)
            elif self.recover:
                result["detail"] += "; not recovered: " + _why_not_recovered(self.inspector.options, found_at_return,
                                                                              unrestored)
        else:
            name, cls, what = (*reproduced, _VALUE)[:3]
            result["verdict"] = "reproducible"
            result["module"], result["class"] = name, cls
            bits = {True: "bit for bit", False: "not bit for bit", None: ""}[same]
            result["detail"] = (f"a rerun of batch {batch} on the same inputs and device (random state restored) "
                                f"reproduced {what} {name or '(root module)'} ({cls})"
                                + (f", its output {bits} the first run's" if bits else "")
                                + ("" if self.peers.active() else
                                   ": look at this batch's data and at that module; no data-parallel peer was "
                                   "asked to run it, so a device that fails the same way every time cannot be "
                                   "told apart"))
        self._verdict(model, call, args, kwargs, output, result, spike)
        return result

    def _verdict(self, model, call, args, kwargs, output, result, spike):
        """Keep a verdict: in a multi-rank job for the ranks to settle (NOTE: [device verdict])."""
        if self.peers.active():
            self.peers.noted(model, call, args, kwargs, output, result, spike)
        else:
            self.results.append(self.attribution(result))

    def target(self):
        """(the module a rerun calls, or None; why not): see rerun_target."""
        return rerun_target(self.model_ref())

    def peer_call(self, batch, cpu_rng, device_rng, before):
        """A call made of what a peer sent (numguard.inspector.peer_verdict), run without gradients."""
        call = _Call(batch, (), {}, False, cpu_rng, device_rng if self.generator is not None else None)
        call.before, call.changed = before, set()
        return call

    def commit(self, result, output, rerun_buffers):
        """Return the rerun's `output` in place of the corrupted one, with the buffers as the clean
        forward left them."""
        self.replacement = output
        with torch.no_grad():
            for b, copy in rerun_buffers:
                b.data.copy_(copy)
        if result is not None:
            result["recovered"] = True
            result["detail"] += "; the rerun's output was returned in place of the corrupted one" + (
                ", and the buffers it updated were kept" if rerun_buffers else "")

    def check_read(self, status):
        self.peers.settle_requests(status)

    def attribution(self, result) -> Attribution | None:
        if not result.get("verdict"):
            return None
        if result.get("rank") is not None:   # settled across ranks: the rank whose batch it was
            return Attribution(result["verdict"], result["rank"], result.get("host") or "", result.get("device") or "",
                               result.get("batch"), result.get("detail", ""))
        return Attribution(result["verdict"], _process.rank(default=None), socket.gethostname(), str(self.device),
                           result.get("batch"), result.get("detail", ""))

    def _run(self, model, call, args, kwargs, watch_module, loss=False):
        """One forward of `model` on the kept inputs, the inspector's hooks quiet; returns the
        output, (name, class) of the first module whose output was non-finite (or None), and the
        abs max of `watch_module`'s output, or with `loss` the |loss| in it (or None)."""
        insp = self.inspector
        names = {id(o.ref()): (o.name, o.cls) for o in insp._owners if o.ref is not None and o.ref() is not None}
        flags = []          # (order, name, class, device bool: any non-finite)
        watched = []
        handles = []

        def look(key, module, args_, output):
            xs = output_tensors(output, [])
            floats = [x.detach() for x in xs if x.is_floating_point() or x.is_complex()]
            if floats:
                bad = torch.stack([~torch.isfinite(x).all() for x in floats]).any()
                flags.append((names[key], bad))
                if module is watch_module and loss:
                    found = _spikes.loss_of(output)
                    if found is not None:
                        watched.append(found.detach().abs().double().reshape(()))
                elif module is watch_module:
                    watched.append(torch.stack([x.abs().max().double() if x.numel() else
                                                x.new_zeros((), dtype=torch.float64) for x in floats]).max())
            return None

        for sub in model.modules():
            if id(sub) in names:
                handles.append(sub.register_forward_hook(functools.partial(look, id(sub))))
        saved = [(b, b.detach().clone()) for b in model.buffers()]
        with torch.no_grad():   # start from the buffers as they were at the call (those copied)
            for b in model.buffers():
                copy = call.before.get(id(b))
                if copy is not None:
                    b.data.copy_(copy)
        rerun_buffers, statistics = (), []
        cpu_state = torch.random.get_rng_state()
        dev_state = self._device_rng_state()
        batch = insp._batch
        closed, depth = batch.closed, batch.depth
        batch.closed, batch.depth = True, depth + 1   # the inspector's own hooks stay quiet
        self.running = True
        try:
            torch.random.set_rng_state(call.cpu_rng)
            if call.device_rng is not None:
                self.generator.set_state(call.device_rng)
            with torch.inference_mode(call.inference), torch.set_grad_enabled(call.grad):
                output = model(*args, **kwargs)
            rerun_buffers = [(b, b.detach().clone()) for b in model.buffers()
                             if id(b) in (call.changed or ())]
            statistics = _statistics_flags(self.norms, names)   # after the outputs: written at the forward's end
        finally:
            self.running = False
            batch.closed, batch.depth = closed, depth
            for h in handles:
                h.remove()
            torch.random.set_rng_state(cpu_state)
            if dev_state is not None:
                self.generator.set_state(dev_state)
            with torch.no_grad():
                for b, copy in saved:
                    b.data.copy_(copy)
        reproduced = None
        flags += statistics
        if flags:
            bad = torch.stack([f for _, f in flags]).tolist()   # one read, after the rerun
            for (name_cls, _), hit in zip(flags, bad):
                if hit:
                    reproduced = name_cls
                    break
        top = output_tensors(output, [])
        if reproduced is None and any(x.is_floating_point() and x.numel() and not bool(torch.isfinite(x).all())
                                      for x in top):
            reproduced = names.get(id(model), ("", type(model).__name__))
        return output, reproduced, float(watched[0]) if watched else None, rerun_buffers


RootRerun.output_tensors = staticmethod(output_tensors)

__all__ = ["RootRerun", "identical", "output_tensors"]
