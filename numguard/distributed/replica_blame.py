"""Which rank's copy is the corrupted one when data-parallel replicas diverge (the verdict of a
replica check's finding, numguard.distributed.replicas).

NOTE: [replica verdict]
Replicas that diverge were not made to by the data: every rank applies the same all-reduced
gradients to the same weights, so a difference is a fault of one rank's device, memory or link (a
bit flipped in a gradient bucket after its all_reduce, in a weight in memory). Which rank:
- more than two value groups, or one group held by a strict majority of ranks: the ranks outside
  the majority ("device", naming them);
- a tie (two ranks, or an even split): each rank looks at its own values at the elements that
  differ between the ranks, against the rest of the same tensor on that rank: how many binades
  (factors of 2) the value lies from the median magnitude of the tensor's other finite non-zero
  elements. A flipped exponent bit moves a value by 2^8 or more, so the corrupted copy stands out
  and the healthy one does not: a side whose value lies at least ``GAP`` binades further out than
  every other side's is named ("device"). A flip that keeps the magnitude (a sign, a mantissa
  bit) leaves nothing to tell the sides apart: no verdict (no Attribution; numguard.Attribution's
  verdicts are the three of the contract), and the message names the ranks that disagree and what
  to check. The rule bets that the healthy value is an ordinary one: a flip
  that brings a value from the tensor's far tail back among the ordinary ones names the healthy
  rank (1 of 200 bucket exponent faults on 2 ranks in benchmarks/bench_faults.py); a stricter
  rule (both sides against the range of 99% of the values) left that one named and decided
  fewer of the others.
The spike baselines cannot decide a tie: a gradient spike is looked at only with backward=True and
after the step, and a low bit moves neither side's history. The work happens only after a finding:
the healthy check is the one all_reduce of the replica check.
"""
from __future__ import annotations

import json
import math
import socket

import torch

from ..errors import Attribution
from . import collectives as _collectives

GAP = 4.0   # binades (a factor 16) by which the corrupted side's value must lie further out


def oddness(x: torch.Tensor, where: torch.Tensor) -> float:
    """How far out (in binades from the median magnitude of `x`'s other finite non-zero
    elements) the most extreme element of `x` at the flat positions `where` (bool) lies;
    inf for a non-finite one, 0 for a zero, nan when `x` is not floating or has nothing to compare with."""
    if not x.is_floating_point() or not bool(where.any()):
        return math.nan
    vals = x[where].double()
    rest = x[~where].double()
    rest = rest[torch.isfinite(rest) & (rest != 0)]
    if rest.numel() == 0:
        return math.nan
    if not bool(torch.isfinite(vals).all()):
        return math.inf
    middle = rest.abs().log2().median()
    # A zero is an ordinary value (a ReLU's gradient): it counts as lying at the middle.
    far = torch.where(vals == 0, torch.zeros_like(vals), (vals.abs().log2() - middle).abs())
    return float(far.max())


def suspects(m: dict):
    """(ranks whose copy of this parameter is judged corrupted, or None; how it was judged)."""
    if not m.get("tie"):
        return list(m["minority_ranks"]), "they differ from the majority of ranks"
    odd = m.get("oddness") or {}
    groups = m["groups"]   # the ranks holding each distinct value
    scores = []
    for g in groups:
        values = [odd.get(str(r)) for r in g]
        if any(v is None or (isinstance(v, float) and math.isnan(v)) for v in values):
            return None, "the differing values could not be compared with the rest of the tensor"
        scores.append(max(values))
    order = sorted(range(len(groups)), key=lambda i: scores[i], reverse=True)
    top, second = scores[order[0]], scores[order[1]]
    if not top - second >= GAP:
        return None, (f"their differing values lie {', '.join(f'{s:.1f}' for s in scores)} binades from the "
                      "tensor's median magnitude on each side: no side stands out (a flipped sign or "
                      "mantissa bit keeps the magnitude)")
    out = "out of range (non-finite)" if math.isinf(top) else f"{top:.1f} binades from"
    return list(groups[order[0]]), (f"its differing values lie {out} the tensor's median magnitude, the other "
                                    f"side's {second:.1f}: a flipped exponent bit")


def _follows(finding: dict, earlier) -> list | None:
    """The ranks an earlier gradients finding named when `finding` is its parameters diverging
    after the step took those gradients (the same parameters, the same value groups), else None."""
    if earlier is None or finding["kind"] != "parameters" or earlier["kind"] != "gradients":
        return None
    before = earlier.get("verdict") or {}
    groups = {m["name"]: sorted(map(sorted, m["groups"])) for m in earlier["parameters"]}
    if before.get("verdict") != "device" or not all(
            sorted(map(sorted, m["groups"])) == groups.get(m["name"]) for m in finding["parameters"]):
        return None
    return before["ranks"]


def judge(st, finding: dict, site: str, earlier=None) -> Attribution | None:
    """The verdict of a finding, the same on every rank (every rank of the group calls it: one
    all_gather of each rank's host and device). Sets ``finding["verdict"]``. `earlier`: the
    sentinel's finding before this one (a step that took corrupted gradients makes its parameters
    diverge the same way: the same rank is named)."""
    mine = json.dumps({"host": socket.gethostname(), "device": finding.get("device") or "cpu"}).encode()
    cards = [json.loads(bytes(b).decode()) for b in _collectives.timed_all_gather_bytes(
        st, mine, "numguard replica verdict (all_gather)", site)]
    by_rank = dict(zip(st.global_ranks, cards))
    named, hows, open_ = [], [], []
    after = _follows(finding, earlier)
    for m in finding["parameters"]:
        ranks, how = (after, f"the optimizer step took the gradients corrupted on rank {after[0]} at "
                             f"{earlier['when']}") if after else suspects(m)
        if ranks is None:
            open_.append(f"{m['name']!r} (ranks {', '.join(map(str, m['majority_ranks'] + m['minority_ranks']))}: "
                         f"{how})")
        else:
            named.append(tuple(ranks))
            hows.append(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} for {m['name']!r}: {how}")
    what = "gradients (after their all_reduce)" if finding["kind"] == "gradients" else "parameters"
    batch = finding.get("batch_number")
    if named and not open_ and len(set(named)) == 1:
        ranks = list(named[0])
        card = by_rank.get(ranks[0], {})
        detail = (f"the data-parallel replicas of the {what} diverged; the corrupted copy is on "
                  f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} ({'; '.join(hows)}). The data "
                  "cannot make replicas differ: suspect the device, memory or link of rank "
                  f"{ranks[0]} ({card.get('device')} on {card.get('host')})")
        verdict = {"verdict": "device", "rank": ranks[0], "ranks": ranks, "host": card.get("host", ""),
                   "device": card.get("device", ""), "detail": detail}
    else:
        disagree = sorted({r for m in finding["parameters"] for r in m["majority_ranks"] + m["minority_ranks"]})
        detail = (f"the data-parallel replicas of the {what} diverged between ranks {', '.join(map(str, disagree))}, "
                  f"and which copy is corrupted cannot be told: {'; '.join(open_ or hows)}"
                  + ("; the ranks named differ by parameter" if len(set(named)) > 1 else "")
                  + ". Check each rank's device (memory errors, e.g. nvidia-smi -q -d ECC, a rerun of the job on "
                  "other devices), and run with 3 or more data-parallel ranks so a majority names it")
        verdict = {"verdict": None, "rank": None, "ranks": disagree, "host": "", "device": "",
                   "detail": detail}
    finding["verdict"] = verdict
    if verdict["verdict"] is None:
        return None
    return Attribution(verdict["verdict"], verdict["rank"], verdict["host"], verdict["device"], batch, detail)


__all__ = ["GAP", "judge", "oddness", "suspects"]
