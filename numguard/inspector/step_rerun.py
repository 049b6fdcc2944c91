"""numguard.rerun_step(fn): rerun a whole training step (forward and backward) when it trips, to tell
a transient fault from a reproducible one where watch(rerun=True) cannot (a NaN/Inf first seen in
the backward).

    @numguard.rerun_step
    def step(batch):                      # forward + backward; no optimizer step inside
        loss = model(batch).loss
        loss.backward()
        return loss

    loss = step(batch); optimizer.step(); optimizer.zero_grad()

At entry the step keeps the random generators' states (CPU and every initialized CUDA device), the
buffers of every watched model (BatchNorm's running statistics and batch count: a corrupted
forward must not leave them behind, nor a rerun count its batch twice) and their parameter
gradients (a copy only of the gradients that exist already: with gradient accumulation, one set
of gradients; after zero_grad(set_to_none=True), nothing).
At its end every open Inspector is checked (one read each), so that a trip in the backward is
found inside the step. When the step raises numguard.NonFiniteError, the gradients, generators and
batch counters are put back and the step runs once more on the same arguments:
- it passes: "transient"; with `recover=True` (the default) its result is returned, the step goes
  on and a NonFiniteWarning carries the numguard.Attribution; with recover=False the first error
  is raised with `.attribution` set;
- it raises again: "reproducible", and the first error is raised with `.attribution` set.
The step function must take its batch as an argument (a step that draws the next batch itself
would rerun another batch). Other exceptions pass through untouched.
"""
from __future__ import annotations

import functools
import socket
import warnings

import torch

from .. import process as _process
from ..errors import Attribution, NonFiniteError, NonFiniteWarning
from . import core as _core


def _open_inspectors():
    return [insp for insp in list(_core._roots.values()) if not insp._batch.closed]


def _tensors(inspectors, of):
    """The distinct tensors `of(model)` gives for every watched model."""
    seen, out = set(), []
    for insp in inspectors:
        model = insp.model
        if model is None:
            continue
        for t in of(model):
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


class _StepState:
    """What a step changes that its rerun must start from again."""

    def __init__(self, inspectors):
        self.inspectors = inspectors
        self.batches = [(insp, insp._batch.done) for insp in inspectors]
        self.params = _tensors(inspectors, torch.nn.Module.parameters)
        self.grads = [None if p.grad is None else p.grad.detach().clone() for p in self.params]
        self.buffers = [(b, b.detach().clone()) for b in _tensors(inspectors, torch.nn.Module.buffers)]
        self.cpu_rng = torch.random.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and \
            torch.cuda.is_initialized() else None

    def restore(self):
        with torch.no_grad():
            for p, g in zip(self.params, self.grads):
                if g is None:
                    p.grad = None
                elif p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
            for b, copy in self.buffers:
                b.copy_(copy)
        torch.random.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        for insp, done in self.batches:
            insp._batch.done = done


def _run_and_check(fn, args, kwargs):
    out = fn(*args, **kwargs)
    for insp in _open_inspectors():
        insp.check_now("the end of numguard.rerun_step")
    return out


def _device_of(inspectors):
    for insp in inspectors:
        return str(insp._ring.device)
    return "cpu"


def rerun_step(fn=None, *, recover: bool = True):
    """Decorate a training step function (forward and backward) so that a NaN/Inf it raises is
    judged by running the step again (see numguard.inspector.step_rerun)."""
    if fn is None:
        return functools.partial(rerun_step, recover=recover)
    if not callable(fn):
        raise TypeError(f"numguard.rerun_step: {fn!r} is not callable; decorate the step function "
                        "(forward and backward) itself")

    @functools.wraps(fn)
    def step(*args, **kwargs):
        inspectors = _open_inspectors()
        state = _StepState(inspectors)
        try:
            return _run_and_check(fn, args, kwargs)
        except NonFiniteError as first:
            batch = first.batch_number
            state.restore()
            where = (_process.rank(default=None), socket.gethostname(), _device_of(inspectors), batch)
            try:
                out = _run_and_check(fn, args, kwargs)
            except NonFiniteError as again:
                first.attribution = Attribution(
                    "reproducible", *where,
                    f"the step was run again on the same arguments (gradients, buffers and random state restored) and "
                    f"tripped again in {again.module or '(root module)'} [{', '.join(again.labels)}]: look at "
                    "this batch's data and at that module; no data-parallel peer was asked to run it")
                for insp in inspectors:
                    insp.verdicts.append(first.attribution)
                raise first from None
            first.attribution = Attribution(
                "transient", *where,
                "the step was run again on the same arguments (gradients, buffers and random state restored) "
                "and gave finite values: the first run was corrupted on the way (a bit flip, a race)"
                + ("; its result was returned and training goes on" if recover else ""))
            for insp in inspectors:
                insp.verdicts.append(first.attribution)
            if not recover:
                raise first from None
            warnings.warn(NonFiniteWarning(f"{first}; rerun verdict: {first.attribution}", first.attribution),
                          stacklevel=2)
            return out

    return step


__all__ = ["rerun_step"]
