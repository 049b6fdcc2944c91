"""The running statistics of normalization layers are checked after each training forward (NOTE:
[running statistics] in numguard/inspector/norm_stats.py): a batch whose outputs are finite but
that made BatchNorm's running_var Inf trips there; healthy runs, masks in other buffers and
evaluation stay silent; the drop-in keeps Transformers' rule."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import numguard
from numguard.testing import SyncCounter


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1))


def _batches(huge_at=None):
    out = []
    for i in range(4):
        x = torch.randn(8, 4)
        if i == huge_at:
            x[0, 0] = 1e20   # its square passes float32's max in the variance; the outputs stay finite
        out.append(x)
    return out


@pytest.mark.parametrize("backward", [False, True])
def test_an_inf_running_var_with_finite_outputs_trips_at_its_batch(backward):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    insp = numguard.watch(model, report_to=None, backward=backward)
    outputs = []
    with pytest.raises(numguard.NonFiniteError) as info:
        for x in _batches(huge_at=2):
            out = model(x)
            outputs.append(out)
            out.sum().backward()
            opt.step()
    insp.close(check=False)
    assert bool(torch.isfinite(outputs[-1]).all())          # nothing a module returned shows it
    assert not bool(torch.isfinite(model[1].running_var).all())
    assert info.value.batch_number == 2 and info.value.labels == ["1.running_var"]
    assert "1.running_var" in info.value.report and "Last 3 buffers frames:" in info.value.report


def test_healthy_training_and_evaluation_are_silent_and_add_no_host_sync():
    def run(extras):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        insp = numguard.watch(model, report_to=None, extras=extras)
        counts = []
        for x in _batches():
            counter = SyncCounter()
            with counter():
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            counts.append(counter.numguard)
        model.eval()
        with torch.no_grad():
            model(torch.randn(2, 4))
        insp.close()
        assert insp.trips == 0
        return counts
    assert run(True) == run(False)


def test_a_minus_inf_mask_in_another_buffer_is_not_a_trip():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.BatchNorm1d(4)
            self.register_buffer("mask", torch.full((4, 4), -float("inf")).triu(1))

        def forward(self, x):
            h = self.norm(x)
            return torch.softmax(h.unsqueeze(2) * h.unsqueeze(1) + self.mask, dim=-1)
    model = Masked()
    with numguard.watch(model, report_to=None) as insp:
        for x in _batches():
            model(x)
    assert insp.trips == 0


def test_layers_in_eval_mode_are_not_recorded():
    model = _model()
    insp = numguard.watch(model, report_to=None)
    model(torch.randn(8, 4))
    recorded = len(insp._ring.frames)
    model.eval()
    model(torch.randn(8, 4))
    assert len(insp._ring.frames) - recorded == recorded - 1   # the same frames, less the statistics'
    insp.close()


def test_the_dropin_keeps_transformers_rule():
    from numguard.inspector.dropin import DebugUnderflowOverflow
    model = _model()
    debug = DebugUnderflowOverflow(model)
    for x in _batches(huge_at=2):
        model(x)
    assert not bool(torch.isfinite(model[1].running_var).all())
    assert debug.trips == 0 and not debug.detected_overflow   # Transformers does not look there either
    debug.close()
