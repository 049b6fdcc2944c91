"""The model zoo: stock architectures, as users run them, under every way of watching.

``torch.nn``'s attention stack (``nn.Transformer``, ``nn.TransformerEncoder/Decoder`` with causal
and padding masks, ``nn.MultiheadAttention`` and SDPA with float and bool masks) and Transformers
models built small from their configs (GPT-2, BERT, T5, Llama, Mistral, ViT, Whisper), crossed with
the modes (``watch``, ``backward=True``, ``ops=True``, ``replay=True``, compiled, compiled with
``spikes=``/``rerun=``/``quant=``, the Transformers Trainer callback, the Lightning callback, the
Accelerate integration, 2-rank DDP, 2-rank DDP with spikes and rerun). Two promises each: a healthy
run is silent (no trip, no report, no numguard warning), and an overflow planted in one named
submodule is reported there (on the rank that made it). This file is also the DDP rank worker:
``python tests/test_model_zoo.py "<arch> [spikes_rerun]"``.
"""
from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numguard  # noqa: E402
from numguard.errors import HeadroomWarning, InspectorWarning, NonFiniteError, NonFiniteWarning  # noqa: E402

D, HEADS, SEQ, BATCH = 16, 2, 6, 2
NUMGUARD_WARNINGS = (NonFiniteWarning, HeadroomWarning, InspectorWarning)


def causal_mask(n=SEQ):
    return nn.Transformer.generate_square_subsequent_mask(n)  # float, -inf above the diagonal


def padding_mask():
    pad = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    pad[1, -2:] = True  # the second sequence is two tokens shorter
    return pad


class Attention(nn.Module):
    """nn.MultiheadAttention under a projection (MHA's own out_proj is not called as a module)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.proj = nn.Linear(D, D)

    def forward(self, x, attn_mask=None):
        a, _ = self.attn(x, x, x, attn_mask=attn_mask, need_weights=False)
        return self.proj(a)


class SdpaCore(nn.Module):
    def forward(self, q, k, v, attn_mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


class Sdpa(nn.Module):
    """Single-head attention through F.scaled_dot_product_attention, the mask a keyword input."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.core = SdpaCore()
        self.out = nn.Linear(D, D)

    def forward(self, x, attn_mask=None):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(self.core(q, k, v, attn_mask=attn_mask))


def _torch_arch(build, call, planted):
    def make():
        torch.manual_seed(0)
        model = build()
        x = torch.randn(BATCH, SEQ, D)
        return model, (lambda target: call(target, x)), planted
    return make


def _encoder(layers=2):
    layer = nn.TransformerEncoderLayer(D, HEADS, 2 * D, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def _decoder():
    layer = nn.TransformerDecoderLayer(D, HEADS, 2 * D, dropout=0.0, batch_first=True)
    return nn.TransformerDecoder(layer, 2)


def _transformer():
    return nn.Transformer(D, HEADS, 1, 1, 2 * D, dropout=0.0, batch_first=True)


def _float_mask():
    return torch.zeros(SEQ, SEQ).masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))


def _bool_mask():
    return torch.ones(SEQ, SEQ, dtype=torch.bool).tril()  # SDPA: True takes part


TORCH_ARCHS = {
    "encoder_causal": _torch_arch(_encoder, lambda m, x: m(x, mask=causal_mask(), is_causal=True),
                                  "layers.1.linear2"),
    "encoder_bool_causal": _torch_arch(
        _encoder, lambda m, x: m(x, mask=torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)), "layers.0.linear1"),
    "encoder_padding": _torch_arch(_encoder, lambda m, x: m(x, src_key_padding_mask=padding_mask()),
                                   "layers.1.linear1"),
    "decoder_causal_padding": _torch_arch(
        _decoder, lambda m, x: m(x, x.flip(1), tgt_mask=causal_mask(), tgt_is_causal=True,
                                 memory_key_padding_mask=padding_mask()), "layers.1.linear2"),
    "transformer": _torch_arch(
        _transformer, lambda m, x: m(x, x.flip(1), tgt_mask=causal_mask(), src_key_padding_mask=padding_mask(),
                                     memory_key_padding_mask=padding_mask()), "decoder.layers.0.linear2"),
    "mha_float_mask": _torch_arch(Attention, lambda m, x: m(x, attn_mask=_float_mask()), "proj"),
    "mha_bool_mask": _torch_arch(Attention, lambda m, x: m(x, attn_mask=~_bool_mask()), "proj"),
    "sdpa_float_mask": _torch_arch(Sdpa, lambda m, x: m(x, attn_mask=_float_mask()), "out"),
    "sdpa_bool_mask": _torch_arch(Sdpa, lambda m, x: m(x, attn_mask=_bool_mask()), "out"),
}


def _hf_arch(name):
    def make():
        transformers = pytest.importorskip("transformers")
        transformers.logging.set_verbosity_error()
        torch.manual_seed(0)
        ids = torch.randint(3, 64, (BATCH, 8))
        mask = torch.ones(BATCH, 8, dtype=torch.long)
        mask[1, -3:] = 0  # padding: the model builds an attention mask with -inf / finfo.min
        small = dict(vocab_size=64)
        if name == "gpt2":
            cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=32, bos_token_id=1,
                                          eos_token_id=2, **small)
            model = transformers.GPT2LMHeadModel(cfg)
            kwargs, planted = dict(input_ids=ids, attention_mask=mask, labels=ids), "transformer.h.1.mlp.c_proj"
        elif name == "bert":
            cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                          intermediate_size=64, max_position_embeddings=32, **small)
            model = transformers.BertForMaskedLM(cfg)
            kwargs, planted = dict(input_ids=ids, attention_mask=mask, labels=ids), "bert.encoder.layer.1.output.dense"
        elif name == "t5":
            cfg = transformers.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16,
                                        decoder_start_token_id=0, **small)
            model = transformers.T5ForConditionalGeneration(cfg)
            kwargs = dict(input_ids=ids, attention_mask=mask, labels=ids.flip(1))
            planted = "encoder.block.1.layer.1.DenseReluDense.wo"
        elif name in ("llama", "mistral"):
            common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, max_position_embeddings=32, bos_token_id=1, eos_token_id=2,
                          **small)
            if name == "llama":
                model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
            else:
                model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=4, **common))
            kwargs, planted = dict(input_ids=ids, attention_mask=mask, labels=ids), "model.layers.1.mlp.down_proj"
        elif name == "vit":
            cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, image_size=16, patch_size=8, num_labels=3)
            model = transformers.ViTForImageClassification(cfg)
            kwargs = dict(pixel_values=torch.randn(BATCH, 3, 16, 16), labels=torch.tensor([0, 2]))
            planted = "vit.layers.1.mlp.fc2"
        elif name == "whisper":
            cfg = transformers.WhisperConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                             decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                             num_mel_bins=8, max_source_positions=16, max_target_positions=16,
                                             pad_token_id=0, decoder_start_token_id=1, bos_token_id=1,
                                             eos_token_id=2, **small)
            model = transformers.WhisperForConditionalGeneration(cfg)
            kwargs = dict(input_features=torch.randn(BATCH, 8, 32), labels=ids[:, :6])
            planted = "model.decoder.layers.0.fc2"
        else:
            raise KeyError(name)
        model.train()
        return model, (lambda target: target(**kwargs)), planted
    return make


HF_ARCHS = {name: _hf_arch(name) for name in ("gpt2", "bert", "t5", "llama", "mistral", "vit", "whisper")}
ARCHS = {**TORCH_ARCHS, **HF_ARCHS}
MODES = {
    "watch": {},
    "backward": {"backward": True},
    "ops": {"ops": True},
    "replay": {"replay": True},
}
# Compiling is slow on two CPU cores: a subset of the architectures that covers both families.
COMPILED = ("encoder_causal", "sdpa_float_mask", "gpt2", "llama")


def loss_of(out):
    """A scalar to call backward on, whatever the model returned."""
    if hasattr(out, "loss") and out.loss is not None:
        return out.loss
    if isinstance(out, tuple):
        out = out[0]
    if hasattr(out, "logits"):
        out = out.logits
    return out.float().pow(2).mean()


class Planted:
    """An overflow planted inside one submodule's forward (an operation of that forward, so
    operation mode can name it), off until armed."""

    def __init__(self, model, name):
        self.name = name
        self.armed = False
        module = model.get_submodule(name)
        forward = module.forward

        def planted_forward(*args, **kwargs):
            out = forward(*args, **kwargs)
            # A real float32 overflow (an inf scalar would be a NaN/Inf by intent, which operation
            # mode does not blame): +-inf wherever the output is not tiny.
            return out * 1e30 * 1e30 if self.armed else out

        module.forward = planted_forward


def _run_steps(model, run, steps, backward):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3) if backward else None
    for _ in range(steps):
        out = run(model)
        if backward:
            opt.zero_grad()
            loss_of(out).backward()
            opt.step()


# What spikes= and quant= say once under torch.compile: the modules inside the graphs they cannot see.
COMPILE_LIMITS = ("numguard: spikes= under torch.compile", "numguard: quant= under torch.compile")


def check_arch(arch, options, compiled=None, steps=2):
    """`compiled`: None, or the torch.compile backend of model.compile() after watch()."""
    model, run, planted_name = ARCHS[arch]()
    planted = Planted(model, planted_name)
    printed = []
    backward = bool(options.get("backward"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        insp = numguard.watch(model, report_to=printed.append, **options)
        if compiled is not None:
            torch._dynamo.reset()   # each model compiles afresh (not past dynamo's recompile limit, run eagerly)
            model.compile(backend=compiled)
        _run_steps(model, run, steps, backward)
        assert insp.trips == 0 and printed == [], printed[:1]
        healthy = [w for w in caught if issubclass(w.category, NUMGUARD_WARNINGS)
                   and not (compiled is not None and str(w.message).startswith(COMPILE_LIMITS))]
        assert healthy == [], [str(w.message) for w in healthy]
        planted.armed = True
        with pytest.raises(NonFiniteError) as info:
            _run_steps(model, run, 1, backward)
        internal = [str(w.message) for w in caught if issubclass(w.category, InspectorWarning)
                    and "could not" in str(w.message)]
    insp.close(check=False)
    err = info.value
    assert err.module == planted_name, (err.module, str(err)[:300])
    assert err.batch_number == steps
    assert planted_name in err.report
    assert internal == [], internal   # nothing of the report was lost to an internal error
    return err, insp


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_healthy_is_silent_and_a_planted_overflow_is_named(arch, mode):
    err, _ = check_arch(arch, MODES[mode])
    if mode == "ops":
        # operation mode names the operation inside the planted module that made the inf
        assert f"first non-finite operation: aten::mul in {err.module} " in err.report, err.report[-600:]


@pytest.mark.parametrize("arch", COMPILED)
def test_compiled(arch):
    check_arch(arch, {}, compiled="inductor")


PRODUCTION = dict(spikes=True, rerun=True, backward=True)


@pytest.mark.parametrize("arch, options", [("encoder_causal", dict(spikes=True)), ("encoder_causal", dict(rerun=True)),
                                           ("encoder_causal", dict(quant="float8_e4m3fn")),
                                           ("encoder_causal", PRODUCTION), ("gpt2", PRODUCTION)], ids=str)
def test_compiled_with_the_production_options(arch, options):
    """spikes=, rerun= and quant= on a model compiled after watch() (the eager backend: dynamo's
    graphs without inductor's compile time): silent but for what spikes=/quant= say once they
    cannot see inside the graphs; a planted overflow is named, with its rerun verdict."""
    err, insp = check_arch(arch, options, compiled="eager", steps=3)
    if options.get("rerun"):
        rerun = insp.last_report["rerun"]
        if options.get("backward"):   # found at the optimizer step: judged, not recovered
            assert rerun["verdict"] == "reproducible" and rerun["module"] == err.module, rerun
        else:
            assert rerun["verdict"] == "reproducible" and err.attribution.verdict == "reproducible", rerun
    if options.get("quant"):
        assert [r["module"] for r in insp.quant_table()] == [""]   # the compiled root's own output


def test_dropin_keeps_transformers_rule_on_a_mask():
    """The drop-in trips where Transformers' DebugUnderflowOverflow does: on the -inf of a causal
    mask a module takes (watch() calls that context)."""
    model, run, _ = ARCHS["encoder_causal"]()
    debug = numguard.DebugUnderflowOverflow(model, report_to=None)
    with pytest.raises(ValueError, match="DebugUnderflowOverflow"):
        run(model)
    debug.close(check=False)


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_transformers_trainer_callback_defaults(arch, tmp_path):
    """The Trainer callback with its defaults (backward watching on): healthy steps are silent,
    a planted overflow stops training naming the planted module."""
    transformers = pytest.importorskip("transformers")
    from numguard.integrations.transformers import NumguardCallback
    model, _, planted_name = ARCHS[arch]()
    torch.manual_seed(0)
    rows = [{"input_ids": torch.randint(3, 64, (8,)), "labels": torch.randint(3, 64, (8,))} for _ in range(8)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3,
                                          report_to=[], logging_steps=100, save_strategy="no",
                                          use_cpu=True, disable_tqdm=True)
    planted = Planted(model, planted_name)
    callback = NumguardCallback(report_to=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback]).train()
        healthy = [w for w in caught if issubclass(w.category, NUMGUARD_WARNINGS)]
    assert healthy == [], [str(w.message) for w in healthy]
    planted.armed = True
    args.max_steps = 2
    stopping = NumguardCallback(report_to=None)
    with pytest.raises(NonFiniteError) as info:
        transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[stopping]).train()
    assert info.value.module == planted_name
    stopping.inspector.close(check=False)  # the run raised before on_train_end, which would close it


# ---------------------------------------------------------------------------------------------
# The Lightning callback and the Accelerate integration as their users switch them on, with their
# defaults (backward watching on): healthy steps are silent, a planted overflow stops training
# naming the planted module before the optimizer writes a weight. Each step runs the architecture
# on its own inputs; the data loader only paces the loop.

INTEGRATION_ARCHS = ("encoder_causal", "gpt2", "llama")
HEALTHY_STEPS, ARMED_AT = 3, 1
# What numguard prints or logs: its report's lines and its messages.
NUMGUARD_OUTPUT = ("numguard", "Detected inf/nan", "abs min  abs max")


def _paced_loader():
    return torch.utils.data.DataLoader(torch.arange(8), batch_size=2)


def numguard_noise(caught, capsys, caplog):
    """Everything numguard said during a run: its warnings, the lines it printed on stdout or
    stderr, its log records at WARNING or above."""
    import logging

    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines()
             if any(marker in line for marker in NUMGUARD_OUTPUT)]
    lines += [str(w.message) for w in caught if issubclass(w.category, NUMGUARD_WARNINGS)]
    lines += [r.getMessage() for r in caplog.records if r.name.startswith("numguard") and r.levelno >= logging.WARNING]
    return lines


def _lightning_module(pl, model, run, planted):
    class ZooModule(pl.LightningModule):
        """A zoo architecture as a LightningModule holds it: under ``self.model``."""

        def __init__(self):
            super().__init__()
            self.model = model
            self.arm_at = None

        def forward(self):
            return run(self.model)

        def training_step(self, batch, batch_idx):
            planted.armed = self.arm_at is not None and batch_idx >= self.arm_at
            loss = loss_of(self())
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", loss_of(self()))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return ZooModule()


@pytest.mark.parametrize("arch, precision", [(arch, "32-true") for arch in INTEGRATION_ARCHS]
                         + [("gpt2", "bf16-mixed"), ("llama", "bf16-mixed")])
def test_lightning_callback_defaults(arch, precision, tmp_path, capsys, caplog):
    """pl.Trainer with NumguardCallback() and AdamW: healthy steps are silent; a planted overflow
    stops training at its step, named as the LightningModule names its submodule (``model.`` +
    the architecture's name: the key of the module's state_dict and Lightning's checkpoints).
    Validation steps (the sanity check's included) are numguard batches too: the trip's batch
    number counts them, and its message names Lightning's global_step."""
    pl = pytest.importorskip("pytorch_lightning")
    from numguard.integrations.lightning import NumguardCallback
    model, run, planted_name = ARCHS[arch]()
    lit = _lightning_module(pl, model, run, Planted(model, planted_name))

    def trainer(callback, steps):
        return pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, precision=precision,
                          callbacks=[callback], default_root_dir=str(tmp_path), logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          log_every_n_steps=1, limit_val_batches=1, val_check_interval=2)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        healthy = trainer(NumguardCallback(), HEALTHY_STEPS)
        healthy.fit(lit, _paced_loader(), _paced_loader())
    assert healthy.global_step == HEALTHY_STEPS
    assert healthy.callback_metrics["numguard/nonfinite"] == 0.0
    assert numguard_noise(caught, capsys, caplog) == []

    lit.arm_at = ARMED_AT
    stopped = trainer(NumguardCallback(), HEALTHY_STEPS)
    with pytest.raises(NonFiniteError) as info:
        stopped.fit(lit, _paced_loader(), _paced_loader())
    err = info.value
    expected = "model." + planted_name
    assert expected in dict(lit.named_modules())
    assert err.module == expected, (err.module, str(err)[:300])
    assert err.batch_number == ARMED_AT + 1 and stopped.global_step == ARMED_AT  # + the sanity check's
    assert f"(Lightning global_step={ARMED_AT}) in {expected} " in str(err)
    assert all(torch.isfinite(p).all() for p in lit.parameters())  # raised before AdamW wrote them
    assert not numguard.inspector.is_watched(lit) and "training_step" not in lit.__dict__


def _accelerate_run(model, run, planted, mixed_precision, arm_at=None):
    """Accelerate's loop over `model` with numguard's integration switched on after prepare();
    returns the inspector (closed)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from numguard.integrations.accelerate import numerics_summary, watch

    AcceleratorState._reset_state(reset_partial_state=True)  # each run picks its own precision
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prepared, optimizer, data = accelerator.prepare(model, optimizer, _paced_loader())
    inspector = watch(accelerator, prepared)
    try:
        for step, _ in enumerate(data):
            if step == HEALTHY_STEPS:
                break
            planted.armed = arm_at is not None and step >= arm_at
            accelerator.backward(loss_of(run(prepared)))
            optimizer.step()
            optimizer.zero_grad()
            accelerator.log(numerics_summary(inspector), step=step)  # as the README shows
    finally:
        inspector.close(check=False)
        AcceleratorState._reset_state(reset_partial_state=True)
    return inspector


@pytest.mark.parametrize("arch, mixed_precision", [(arch, "no") for arch in INTEGRATION_ARCHS]
                         + [("gpt2", "bf16")])
def test_accelerate_watch_defaults(arch, mixed_precision, capsys, caplog):
    """Accelerator(cpu=True), prepare(model, optimizer, data), accelerator.backward, AdamW, with
    numguard.integrations.accelerate.watch(accelerator, model): healthy steps are silent; a planted
    overflow stops the loop at its step, named as in the unwrapped model."""
    pytest.importorskip("accelerate")
    model, run, planted_name = ARCHS[arch]()
    planted = Planted(model, planted_name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inspector = _accelerate_run(model, run, planted, mixed_precision)
    assert inspector.trips == 0 and inspector.batches_finished == HEALTHY_STEPS
    assert numguard_noise(caught, capsys, caplog) == []

    with pytest.raises(NonFiniteError) as info:
        _accelerate_run(model, run, planted, mixed_precision, arm_at=ARMED_AT)
    err = info.value
    assert err.module == planted_name, (err.module, str(err)[:300])
    assert err.batch_number == ARMED_AT and planted_name in err.report
    assert all(torch.isfinite(p).all() for p in model.parameters())  # raised before AdamW wrote them


# ---------------------------------------------------------------------------------------------
# 2-rank DDP (gloo): healthy steps are silent on both ranks; a planted overflow on rank 1 is named
# by both, with its module.

DDP_ARCHS = ("encoder_causal", "gpt2", "llama")
DDP_STEPS = 2


@pytest.mark.parametrize("arch", DDP_ARCHS)
def test_ddp_two_ranks(arch):
    from dist_workers import run_worker_file
    results = run_worker_file(__file__, arch, 2, 240)
    for rank, r in enumerate(results):
        assert r["healthy_trips"] == 0 and r["printed"] == 0 and r["warnings"] == [], r
        assert r["fault_rank"] == 1 and r["module"] == "module." + r["planted"], r
        assert r["batch_number"] == DDP_STEPS and r["fault_kind"] == "forward", r
    assert results[1]["own_module"] == "module." + results[1]["planted"]


# backward=True with spikes and rerun (what a production job switches on): a healthy run of 100
# steps says nothing; a NaN made in rank 1's forward reaches rank 0 through DDP's gradient
# all_reduce, and every rank's rerun field speaks of rank 1's forward fault (rank 0's own first
# non-finite value is in its backward, whose rerun reason pointed to rerun_step).
WATCHED_STEPS = 100


def test_ddp_two_ranks_spikes_rerun_backward():
    from dist_workers import run_worker_file
    results = run_worker_file(__file__, "gpt2 spikes_rerun", 2, 300)
    for rank, r in enumerate(results):
        assert r["healthy_trips"] == 0 and r["printed"] == 0 and r["warnings"] == [], r
        assert r["spikes"] == [] and r["attributions"] == [], r
        assert r["fault_rank"] == 1 and r["module"] == "module." + r["planted"], r
        assert r["batch_number"] == WATCHED_STEPS and r["fault_kind"] == "forward", r
        rerun = r["rerun"]
        assert rerun["rank"] == 1 and rerun["batch"] == WATCHED_STEPS and rerun["module"] == r["module"], rerun
        assert "backward pass" not in rerun["reason"] and "rerun_step" not in rerun["reason"], rerun
        # planted on rank 1 only: rank 1's rerun repeats it, its peer's does not
        assert r["attribution"]["verdict"] == "device" and r["attribution"]["rank"] == 1, r["attribution"]
        assert "suspect the device of rank 1" in r["attribution"]["detail"], r["attribution"]


def _ddp_rank(arch, mode="plain"):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dist_workers import finish_rank
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, run, planted_name = ARCHS[arch]()
    planted = Planted(model, planted_name)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    options, steps = ({}, DDP_STEPS) if mode == "plain" else (dict(spikes=True, rerun=True), WATCHED_STEPS)

    def one_step():
        out = run(ddp)
        opt.zero_grad()
        loss_of(out).backward()
        opt.step()

    printed = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        insp = numguard.watch(ddp, backward=True, report_to=printed.append, **options)
        for _ in range(steps):
            one_step()
        result = {"healthy_trips": insp.trips, "printed": len(printed), "planted": planted_name,
                  "warnings": [str(w.message) for w in caught if issubclass(w.category, NUMGUARD_WARNINGS)],
                  "spikes": insp.spikes(), "attributions": [a.to_dict() for a in insp.attributions()]}
        planted.armed = rank == 1
        try:
            one_step()
            result["raised"] = False
        except NonFiniteError as exc:
            result.update(raised=True, module=exc.module, fault_rank=exc.fault_rank, fault_kind=exc.fault_kind,
                          batch_number=exc.batch_number, own_module=exc.own_module,
                          rerun=(insp.last_report or {}).get("rerun"),
                          attribution=None if exc.attribution is None else exc.attribution.to_dict())
    insp.close(check=False)
    finish_rank(result)


if __name__ == "__main__":
    _ddp_rank(*sys.argv[1].split())
