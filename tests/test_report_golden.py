"""Golden file: the full text of a report (Transformers' lines, numguard's keyword-input and
container lines, a backward section, the summary and the headroom section) is stable."""
import os

import pytest
import torch
from torch import nn

import numguard

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "golden")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x, scale=None):
        y = self.proj(x) * scale
        return {"hidden": self.norm(y), "raw": y}


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.block = Block()
        self.head = nn.Linear(4, 2, bias=False)
        self.boost = 1.0

    def forward(self, ids):
        h = self.embed(ids)
        out = self.block(h, scale=torch.tensor(3000.0, dtype=h.dtype))
        return self.head(out["raw"] * self.boost)


def build():
    model = Small()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.linspace(-1.0, 1.0, p.numel()).view_as(p) * (i + 1) / 4)
    return model.half()


def forward_trip_report():
    """A healthy batch 0, then the head overflows in batch 1, found at the check after batch 1."""
    model = build()
    insp = numguard.watch(model, max_frames_to_save=4, report_to=None, check_every=2, headroom=0)
    with torch.no_grad():
        model(torch.tensor([[0, 1, 2]]))
        model.boost = 30.0
        with pytest.raises(numguard.NonFiniteError) as info:
            model(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    insp.close(check=False)
    return info.value.report


def backward_trip_report():
    """A healthy forward, then a NaN gradient recorded in the backward section."""
    model = build()
    insp = numguard.watch(model, max_frames_to_save=3, report_to=None, headroom=0)
    with torch.no_grad():
        model(torch.tensor([[0, 1, 2]]))
    grad = torch.tensor([0.5, float("nan")], dtype=torch.float16)
    insp.record_frame("head", "Linear", ["grad_output[0]"], [torch.ones(2, dtype=torch.float16)], section="backward")
    insp.record_frame("block.proj", "Linear", ["grad_output[0]", "note"], [grad, None], section="backward")
    with pytest.raises(numguard.NonFiniteError) as info:
        insp.check("before optimizer step")
    insp.close(check=False)
    return info.value.report


def check_golden(name, text):
    path = os.path.join(GOLDEN_DIR, name)
    if os.environ.get("NUMGUARD_UPDATE_GOLDEN") == "1":
        with open(path, "w") as f:
            f.write(text)
    with open(path) as f:
        expected = f.read()
    assert text == expected


def test_forward_report_matches_golden_file(backend):
    check_golden("report_forward.txt", forward_trip_report())


def test_backward_report_matches_golden_file(backend):
    check_golden("report_backward.txt", backward_trip_report())
