"""Shared helpers for the inspector tests: tiny random-init Transformers models, a host-sync counter,
and Transformers' DebugUnderflowOverflow run side by side with numguard's."""
from __future__ import annotations

import contextlib
import io
import warnings

import pytest
import torch

import numguard
from numguard.testing import SyncCounter  # noqa: F401  (one sync counter for tests and benchmarks)


transformers = pytest.importorskip("transformers")


def quiet(**kw):
    """watch() options with the report printed nowhere (it is still on the exception)."""
    kw.setdefault("report_to", None)
    return kw


def all_hooks(model):
    """Every hook of every kind on the modules of `model`."""
    total = 0
    for m in model.modules():
        for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                     "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_state_dict_hooks",
                     "_load_state_dict_pre_hooks"):
            total += len(getattr(m, name, {}))
    return total


class MLP(torch.nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.a = torch.nn.Linear(d, d)
        self.act = torch.nn.ReLU()
        self.b = torch.nn.Linear(d, d)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


def tiny_gpt2(dtype=torch.float32, layers=2, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = GPT2Config(vocab_size=64, n_embd=16, n_layer=layers, n_head=2, n_positions=32,
                         bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(cfg)
    return model.to(dtype)


def tiny_t5(dtype=torch.float32, seed=0):
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1,
                       num_heads=2, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        model = T5ForConditionalGeneration(cfg)
    return model.to(dtype)


def overflow_value(dtype):
    return 30000.0 if dtype == torch.float16 else 3e38


def make_overflow(weight, dtype):
    """Fill `weight` with +-v (v close to the dtype's max) so the layer's output overflows."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        signs = torch.randint(0, 2, weight.shape, generator=g).float() * 2 - 1
        weight.copy_((signs * overflow_value(dtype)).to(weight.dtype))


def clear_hooks(model):
    for m in model.modules():
        m._forward_hooks.clear()
        m._forward_pre_hooks.clear()
        m._forward_hooks_with_kwargs.clear()
        m._forward_hooks_always_called.clear()


def run_batches(model, make_detector, batches, seed=1):
    """Run `batches` (callables taking the model) under a detector; return (stdout, exception)."""
    buf = io.StringIO()
    torch.manual_seed(seed)
    detector = make_detector(model)
    err = None
    with contextlib.redirect_stdout(buf), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            for batch in batches:
                batch(model)
        except ValueError as exc:
            err = exc
    return buf.getvalue(), err, detector


def hf_vs_numguard(model, batches, numguard_kwargs=None, hf_kwargs=None):
    """Run the same batches under Transformers' DebugUnderflowOverflow and numguard's watch
    (extras off: Transformers' lines only), each on a fresh copy of `model`."""
    import copy
    from transformers.debug_utils import DebugUnderflowOverflow as HF
    original = model
    model = copy.deepcopy(original)
    hf_out, hf_err, _ = run_batches(model, lambda m: HF(m, **(hf_kwargs or {})), batches)
    model = copy.deepcopy(original)
    kw = dict(extras=False)
    kw.update(numguard_kwargs or {})
    ng_out, ng_err, insp = run_batches(model, lambda m: numguard.watch(m, **kw), batches)
    insp.close(check=False)
    return hf_out, hf_err, ng_out, ng_err


def train_steps(model, steps, ids, optimizer=None):
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        out = model(ids, labels=ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return optimizer


def watched_training_syncs(steps, **options):
    """A tiny GPT-2 trained one step unwatched, then watched (quiet, `options`) for one warm-up
    step and `steps` steps under a SyncCounter: (inspector, counter), the inspector still open."""
    model = tiny_gpt2(torch.float32)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    opt = train_steps(model, 1, ids)
    insp = numguard.watch(model, **quiet(**options))
    train_steps(model, 1, ids, opt)
    with SyncCounter()() as counter:
        train_steps(model, steps, ids, opt)
    return insp, counter
