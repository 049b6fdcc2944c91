"""numguard.memory: find the largest batch size that fits, on every rank together.

    @numguard.find_executable_batch_size(starting_batch_size=128)
    def train(batch_size, model_name):
        ...
    train("gpt2")          # batch size is passed by the decorator

A drop-in for Accelerate's ``find_executable_batch_size``: it passes Accelerate's own tests
(tests/test_memory_accelerate_parity.py): the same call styles, the same back-off (``int(size *
0.9)``; ``reduction=0.5`` halves), ``reduce_batch_size_fn()`` honoured, the same TypeError when
the caller passes the batch size, and the same RuntimeError when the size reaches zero (also for
``starting_batch_size=0``, at the call). A generator or coroutine function is refused at
decoration (its body would run outside the decorator, never retried). And:

- :func:`is_out_of_memory` knows ``torch.OutOfMemoryError`` by type on any device, Python's
  ``MemoryError``, and the known messages (CUDA/HIP/XPU, MPS, the CPU allocator, cuDNN
  NOT_SUPPORTED, HPU). Anything else propagates at once, untouched.
- The failed try's frames are cleared (they hold its activations through the traceback), garbage
  is collected and the device caches emptied before the next try.
- With torch.distributed initialized, the ranks exchange one tiny all_gather after every try on a
  dedicated gloo group whose timeout is ``NUMGUARD_DIST_TIMEOUT``: all ranks retry together with
  the smallest size any rank proposes, and return together. A DDP model given
  :func:`guard_ddp` (a communication hook) learns of a rank's failure before each gradient bucket
  instead of waiting in an all_reduce the failed rank will never join. A rank that does not
  answer within the timeout is named in a :class:`BatchSizeTimeoutError`, never a silent hang.
- ``minimum_batch_size``, ``reduction``, ``search="down"|"binary"``, ``margin`` and
  ``global_batch_size`` (the function is then called as ``f(batch_size, accumulation_steps, ...)``).
- The size found is remembered: the next call starts from it, and an out-of-memory error after a
  successful run is re-raised (set ``.retry_after_success = True`` on the decorated function, or
  call its ``.reset()``, to search again). ``.finder.tried`` lists the last call's sizes.

Build the model, optimizer and DDP wrapper inside the decorated function, as with Accelerate: a
failed try leaves DDP's reducer in the middle of a step. While the function runs, guard_ddp's hook
adds one small gloo all_gather per gradient bucket and a watchdog thread reads the store every
NUMGUARD_DIST_TIMEOUT/20 seconds (0.2 to 5). After a timeout the default process group is
destroyed or aborted on the ranks involved (see NOTE: [stuck ranks]): the job cannot continue.
"""
from __future__ import annotations

# The package: oom (what an out-of-memory error is, freeing a try), search (the pure search),
# ranks (agreement over numguard's channel, the DDP guard), finder (the decorator's loop).
from . import finder, oom, ranks, search
from .finder import find_executable_batch_size
from .oom import BatchSizeNotFoundError, BatchSizeTimeoutError, PeerFailedError, is_out_of_memory, release_memory
from .ranks import guard_ddp, oom_comm_hook

__all__ = ["BatchSizeNotFoundError", "BatchSizeTimeoutError", "PeerFailedError", "find_executable_batch_size",
           "finder", "guard_ddp", "is_out_of_memory", "oom", "oom_comm_hook", "ranks", "release_memory", "search"]
