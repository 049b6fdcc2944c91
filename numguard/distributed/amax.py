"""Ranks whose amax differs from their group's: ``watch(model, quant=FORMAT, amax_group=GROUP)``.

fp8 recipes reduce each tensor's amax over a group of ranks so that those ranks scale alike:
the tensor-parallel group, or the data-parallel one too where the recipe says so. Reduced over
the wrong group, the ranks scale differently and training diverges quietly (Megatron-LM PR #442:
"All our FP8 trainings of a 40B gpt3 model with tensor_model_parallel_size=8 have been diverging
after around 1000 iterations"). With ``amax_group``, the ranks of GROUP must see the same amax
for every watched tensor (the amax quant= measures: each module's outputs, and with
backward=True its gradients; of a real float8 tensor, the values its data and scale stand for).

Nothing new per step (NOTE: [amax digest] in numguard.inspector.quant_watch): each rank's digest
of those amax and its group's key (its lowest global rank) ride in the record the trip exchange
already all_gathers (:data:`FIELDS`, after numguard.distributed.numerics.FIELDS), read with the
check's state. Every rank gets the same table, so every rank names the same ranks: in each group,
those whose digest is not the one most of the group share; in a group where no digest is shared
by more than half of its ranks, every rank of it (two ranks that differ cannot say which one is
wrong). A group named is warned about once through numguard's distributed logger (rank 0 logs),
and :func:`last_amax_mismatches` lists what the last exchange found.

The digest covers the checks' interval: it is one check late, like the numerics.
"""
from __future__ import annotations

import collections
import math
import threading

from . import channel as _channel
from . import numerics as _numerics
from . import trip_exchange as _trip_exchange
from .logging import get_logger

FIELDS = ("amax_group", "amax_digest")
OFFSET = len(_numerics.FIELDS)   # where FIELDS start in the exchanged numbers

_log = get_logger("numguard.distributed.amax")
_lock = threading.Lock()
_found: dict = {}      # numguard's group name -> the last exchange's mismatches
_warned: set = set()   # (numguard's group name, amax group key, ranks named)


def group_key(group) -> int:
    """The key ranks send for `group` (amax_group's value: a process group or a list of global
    ranks): its lowest global rank. Raises ValueError when this process is not one of its ranks."""
    import torch.distributed as dist

    if isinstance(group, tuple):
        ranks = list(group)
    else:
        ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if me not in ranks:
        raise ValueError(f"amax_group={ranks}: this process (global rank {me}) is not one of its ranks; pass "
                         "the group this rank reduces its amax over (each rank passes its own group)")
    return min(ranks)


def _mismatches(rows, ranks, batches):
    """[{group, ranks, digests, batch}] from an exchange's numbers (rank order)."""
    groups = collections.defaultdict(list)
    for r, row in enumerate(rows):
        if len(row) < OFFSET + len(FIELDS):
            continue
        key, digest = row[OFFSET], row[OFFSET + 1]
        if math.isfinite(key) and math.isfinite(digest):
            groups[int(key)].append((ranks[r], digest, batches[r]))
    found = []
    for key, members in sorted(groups.items()):
        counts = collections.Counter(d for _, d, _ in members)
        if len(members) < 2 or len(counts) == 1:
            continue
        common, n = counts.most_common(1)[0]
        majority = common if 2 * n > len(members) else None
        named = [r for r, d, _ in members if majority is None or d != majority]
        found.append({"group": sorted(r for r, _, _ in members), "ranks": named, "agreed": majority is not None,
                      "batch": max((b for _, _, b in members if b is not None), default=None)})
    return found


def describe(entry: dict) -> str:
    group, named = entry["group"], entry["ranks"]
    where = (f" (found at the check of batch {entry['batch']}, in the amax of the checks before it)"
             if entry["batch"] is not None else "")
    if entry["agreed"]:
        who = f"rank{'s' if len(named) > 1 else ''} {', '.join(map(str, named))}"
        return (f"numguard.distributed: {who} of amax group {group} saw a different amax than the rest of the group "
                f"for the tensors quant= watches{where}: the group's ranks should scale alike. Is the amax reduced "
                "over this group on that rank (Megatron-LM #442: reduced over the wrong group, fp8 training "
                "diverged)?")
    return (f"numguard.distributed: the ranks of amax group {group} disagree on the amax of the tensors quant= "
            f"watches{where}, and no amax is shared by most of them, so no one rank can be named: is the amax "
            "reduced over this group (Megatron-LM #442)?")


def observe(st, rows, batches) -> None:
    """Feed one exchange's numbers (trip_exchange.on_exchange)."""
    found = _mismatches(rows, list(st.global_ranks), batches)
    with _lock:
        _found[st.name] = found
        fresh = []
        for entry in found:
            key = (st.name, entry["group"][0], tuple(entry["ranks"]))
            if key not in _warned:
                _warned.add(key)
                fresh.append(entry)
    for entry in fresh:
        _log.warning(describe(entry))


def last_amax_mismatches(group=None) -> list:
    """What the last trip exchange of `group` (default: the world) found with amax_group: dicts
    with ``group`` (its global ranks), ``ranks`` (those named), ``agreed`` (whether the rest of the
    group shared one amax) and ``batch``. Empty when none (or outside a distributed job)."""
    if not _channel.is_initialized():
        return []
    with _lock:
        return [dict(e) for e in _found.get(_channel.group_state(group).name, [])]


def _released(group) -> None:
    with _lock:
        _found.clear()
        _warned.clear()


_channel.on_release(_released)
_trip_exchange.on_exchange(observe)

__all__ = ["FIELDS", "OFFSET", "describe", "group_key", "last_amax_mismatches", "observe"]
