"""What running out of memory looks like (:func:`is_out_of_memory`), the batch finder's errors,
and freeing a failed try's memory (:func:`release_memory`)."""
from __future__ import annotations

import gc
import traceback

import torch



_WHERE = "numguard.find_executable_batch_size"

# Substrings of the messages the allocators raise with (RuntimeError or subclasses).
OOM_MESSAGES = (
    " out of memory.",                                 # CUDA, HIP, XPU
    "MPS backend out of memory",                       # Apple MPS
    "can't allocate memory",                           # DefaultCPUAllocator
    "CUDNN_STATUS_NOT_SUPPORTED",                      # cuDNN's answer to a too-large workspace
    "MODULE:PT_DEVMEM Allocation failed",              # Habana HPU
)


def is_out_of_memory(exc: BaseException) -> bool:
    """True when ``exc`` says a device (or the host) ran out of memory."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)
    return any(m in text for m in OOM_MESSAGES)


class BatchSizeNotFoundError(RuntimeError):
    """Even ``minimum_batch_size`` ran out of memory. ``.tried``: [(size, outcome)], ``.minimum``."""

    def __init__(self, tried, minimum, last_error):
        self.tried, self.minimum, self.last_error = list(tried), minimum, last_error
        # Accelerate's sentence first: scripts and tests match on it.
        head = ("No executable batch size found, reached zero." if minimum <= 1 else
                f"No executable batch size found, the next size would be below "
                f"minimum_batch_size={minimum}.")
        if self.tried:
            steps = ", ".join(f"{s} ({o})" for s, o in self.tried)
            # below size 1 there is nothing to lower
            advice = ("Lower minimum_batch_size, free memory or shrink the model." if minimum > 1 else
                      "Free memory or shrink the model.")
            body = f"tried {steps}. Last out-of-memory error: {last_error}. {advice}"
        else:  # nothing to try: starting_batch_size (snapped to global_batch_size) is too small
            body = f"{last_error}; pass a larger starting_batch_size."
        super().__init__(f"{head} {_WHERE}: {body}")


class PeerFailedError(RuntimeError):
    """A rank failed in a way that ends the search on every rank.

    ``.rank`` (the rank that ran out of memory, else the first that failed), ``.out_of_memory``,
    ``.failures`` ({rank: message} of every rank that failed in that try)."""

    def __init__(self, rank, out_of_memory, failures):
        self.rank, self.out_of_memory, self.failures = rank, out_of_memory, dict(failures)
        what = "ran out of memory" if out_of_memory else "failed with an error that is not out of memory"
        others = "".join(f"\n  rank {r}: {m}" for r, m in sorted(self.failures.items()))
        super().__init__(f"{_WHERE}: rank {rank} {what}; failures in this try:{others}")


class BatchSizeTimeoutError(RuntimeError):
    """Ranks did not answer numguard's exchange within NUMGUARD_DIST_TIMEOUT."""

    def __init__(self, missing, failed, timeout_s, advice=""):
        self.missing, self.failed, self.timeout_s = sorted(missing), dict(failed), timeout_s
        who = "; ".join(f"rank {r}: {m}" for r, m in sorted(self.failed.items())) or "none known"
        super().__init__(f"{_WHERE}: ranks {self.missing} did not answer within "
                         f"{timeout_s:g} s (NUMGUARD_DIST_TIMEOUT), probably waiting in a collective "
                         f"of the training step that a failed rank left. Ranks that failed: {who}. "
                         f"{advice}".rstrip())


# ------------------------------------------------------------------------------------------------
# Memory


def _drop_frames(exc):
    """Clear the frames of exc's traceback (and of its cause/context chain): they hold the failed
    try's locals, activations included, for as long as the exception lives."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)  # skips frames still executing (ours)
        exc = exc.__cause__ or exc.__context__


def release_memory(*objects):
    """Collect garbage and return cached device blocks to the driver. Accelerate's call style:
    ``a, b = release_memory(a, b)`` returns one None per object, to rebind the caller's names."""
    objects = [None] * len(objects)   # drop this frame's references before collecting
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    for name in ("xpu", "mps", "npu", "hpu"):
        backend = getattr(torch, name, None)
        try:
            if backend is not None and backend.is_available():
                backend.empty_cache()
        except Exception:  # noqa: BLE001 - a backend without a cache must not stop the search
            pass
    return objects


def device_memory():
    """(in use, peak, total) bytes on the current CUDA device, or None off CUDA."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    dev = torch.cuda.current_device()
    return (torch.cuda.memory_allocated(dev), torch.cuda.max_memory_allocated(dev),
            torch.cuda.get_device_properties(dev).total_memory)


def _reset_peak():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def _gib(n):
    return f"{n / 2**30:.2f} GiB"
