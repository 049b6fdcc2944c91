"""Shared test fixtures: which backends and devices the ops can be tested on."""
import contextlib

import pytest
import torch

import numguard

NATIVE = numguard.backend() == "native"
HAS_CUDA = torch.cuda.is_available()

requires_native = pytest.mark.skipif(
    not NATIVE, reason=f"numguard's native extension is not loaded ({numguard.ops.fallback_reason()})")
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")

# Every test that takes `device` runs on the CPU, and on CUDA when a GPU is present.
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


@contextlib.contextmanager
def no_host_sync(device):
    """On CUDA, make any synchronizing call inside the block an error; a no-op on the CPU."""
    if torch.device(device).type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@pytest.fixture(params=["native", "torch"])
def backend(request, monkeypatch):
    """Runs a test on the native kernels (when loaded) and on the pure-PyTorch fallback."""
    if request.param == "native":
        if numguard.backend() != "native":
            pytest.skip("native extension not loaded")
    else:
        monkeypatch.setattr(numguard.ops, "_native", None)
    return request.param
