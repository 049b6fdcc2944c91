"""Where numguard is running: this process's place in a ``torch.distributed`` job (its rank and the
world size) and the line of the user's code that is running (the first frame outside numguard and
torch). The one copy of each: reports, warnings, the trip exchange and operation mode all ask here.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

__all__ = ["call_site", "is_distributed", "is_internal", "rank", "user_stacklevel", "world_size"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_NUMGUARD_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_internal_code = {}  # code object -> whether it is torch's, numguard's or this interpreter's glue
_INTERNAL_CODE_LIMIT = 100_000


def is_distributed() -> bool:
    """Whether a ``torch.distributed`` default group is initialized."""
    try:
        return dist.is_available() and dist.is_initialized()
    except Exception:  # noqa: BLE001 - a broken build of torch.distributed: not a job
        return False


def rank(group=None, default=0):
    """This process's rank in ``group`` (the default group), or ``default`` outside an initialized
    job (reports say None there: ``rank(default=None)``)."""
    return dist.get_rank(group) if is_distributed() else default


def world_size(group=None) -> int:
    """Ranks in ``group`` (the default group), or 1 outside an initialized job."""
    return dist.get_world_size(group) if is_distributed() else 1


def is_internal(code) -> bool:
    """Whether a code object is torch's, numguard's, or generated glue (``<string>``, fx's
    ``<eval_with_key>``): never the user's line. Cached per code object (operation mode asks for
    every operation)."""
    hit = _internal_code.get(code)
    if hit is None:
        name = code.co_filename
        if not name.startswith("<"):
            # As imported: a path with '..' (sys.path entries like 'benchmarks/..') still counts.
            name = os.path.normpath(os.path.abspath(name))
        hit = name.startswith(_TORCH_DIR) or name.startswith(_NUMGUARD_DIR) or name.startswith("<")
        if len(_internal_code) > _INTERNAL_CODE_LIMIT:
            _internal_code.clear()
        _internal_code[code] = hit
    return hit


def call_site(basename=False, unknown="<unknown>") -> str:
    """``file:line`` of the innermost frame outside numguard and torch (the file's base name with
    ``basename=True``), or ``unknown`` when every frame is internal."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if not is_internal(code):
            name = os.path.basename(code.co_filename) if basename else code.co_filename
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return unknown


def user_stacklevel() -> int:
    """``stacklevel`` for a ``warnings.warn`` made by the caller of this function's caller, that
    points at the first frame outside numguard and torch."""
    frame = sys._getframe(2)
    level = 2
    while frame is not None and is_internal(frame.f_code):
        frame = frame.f_back
        level += 1
    return level
