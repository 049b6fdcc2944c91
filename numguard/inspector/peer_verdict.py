"""The inspector's half of a rerun verdict in a multi-rank job (the exchange itself: NOTE: [peer
rerun] in numguard.distributed.peer_rerun): what this rank claims after its own rerun, what it
tells the others it is, how it reruns a peer's inputs, and the verdict every rank gives.

NOTE: [device verdict]
A rank whose own rerun reproduced the fault sends the batch's inputs (with the random states and
the buffers as they were at the call) to a data-parallel peer, which runs them on its own copy of
the weights (DDP keeps them bitwise equal; a peer is chosen in DDP's group, or by a parameters
digest equal to the claimant's) and answers whether the fault repeats there (a non-finite output;
for a spike, the spiked value at or above the geometric middle of spike and baseline):
- yes: "reproducible" (the data or the model), naming both ranks;
- no: "device": the rank, host and device whose rerun reproduced it.
A rerun that did not reproduce it is "transient" without asking anyone. Every rank learns the
verdict of the earliest fault (of a trip: in its handling; of a spike: at the next check, whose
trip exchange carries the spiked rank's request, so a spike's verdict comes one check after the
spike) and carries it as ``.attribution``.

Recovery (NOTE: [rerun verdict]) in a multi-rank job: a transient fault found at the root's return
is recovered only when every rank that tripped in that check can recover its own (each rank's
card says so): then every rank goes on together, the tripped ones with their rerun's output,
before any backward; otherwise every rank raises as before.
"""
from __future__ import annotations

import collections
import io
import warnings

import torch
import torch.utils._pytree as pytree

from .. import ops
from .. import process as _process
from ..errors import InspectorWarning, SpikeWarning
from . import spikes as _spikes

try:
    from torch.nn.parallel import DistributedDataParallel as _DDP
except Exception:  # noqa: BLE001 - a torch without distributed
    _DDP = ()


def _channel():
    from ..distributed import peer_rerun
    return peer_rerun, None


def output_digest(tensors) -> list | None:
    """The exact digests of an output's tensors (at most 16; one read), to compare two ranks'
    outputs bit for bit."""
    xs = [x.detach() for x in tensors if isinstance(x, torch.Tensor) and x.numel() and not x.is_complex()][:16]
    return ops.multi_tensor_fingerprint(xs).tolist() if xs else None


def _detached(value):
    return pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, value)


class PeerVerdicts:
    """Claims, cards, peer reruns and the verdicts every rank agrees on, for a RootRerun."""

    def __init__(self, rerun):
        self.rerun = rerun
        self.note = None          # (batch, claim, payload) of this rank's last rerun
        self.tentative = None     # (output, buffers) of a recoverable rerun, until every rank agrees
        self.queued = collections.deque()   # spike claims for the next exchange
        self.announced = None

    @staticmethod
    def active() -> bool:
        return _process.is_distributed() and _process.world_size() > 1

    # -- this rank's claim -------------------------------------------------------------------------
    def noted(self, model, call, args, kwargs, output, result, spike=None) -> None:
        """Keep what a peer needs after this rank's rerun of `call` gave `result`."""
        verdict = result.get("verdict")
        claim = {"what": "spike" if spike else "trip", "batch": result["batch"], "verdict": verdict,
                 "detail": result.get("detail", ""), "reason": result.get("reason", ""),
                 "module": result.get("module"), "class": result.get("class"),
                 "peer": verdict == "reproducible", "spike": None if spike is None else dict(spike)}
        payload = None
        try:
            claim["digest"] = output_digest(self.rerun.output_tensors(output, []))
        except Exception:  # noqa: BLE001 - the comparison is left out
            claim["digest"] = None
        if claim["peer"]:
            try:
                names = {id(b): n for n, b in model.named_buffers()}
                buf = io.BytesIO()
                torch.save({"args": _detached(args), "kwargs": _detached(kwargs), "cpu_rng": call.cpu_rng,
                            "device_rng": call.device_rng,
                            "buffers": {names[i]: t for i, t in call.before.items() if i in names}}, buf)
                payload = buf.getvalue()
            except Exception as exc:  # noqa: BLE001 - no peer verdict, said why
                claim["unsent"] = f"its inputs could not be packed for a peer ({type(exc).__name__}: {exc})"
        self.note = (result["batch"], claim, payload)

    def card(self, tripped=False, recoverable=False) -> dict:
        """What this rank is, for the others (NOTE: [peer rerun])."""
        rr = self.rerun
        model, _ = rr.target()
        root = rr.model_ref()
        dp = None
        if isinstance(_DDP, type) and isinstance(root, _DDP):
            try:
                dp = list(torch.distributed.get_process_group_ranks(root.process_group))
            except Exception:  # noqa: BLE001 - fall back to the parameters' digest
                dp = None
        digest = None
        if model is not None:
            try:
                params = [p.detach() for p in model.parameters() if not p.is_complex()]
                digest = int(ops.multi_tensor_fingerprint(params).sum()) if params else None
            except Exception:  # noqa: BLE001 - no digest: no peer chosen by it
                digest = None
        return {"serve": model is not None, "dp": dp, "digest": digest, "device": str(rr.device),
                "tripped": bool(tripped), "recoverable": bool(recoverable)}

    # -- running a peer's inputs -------------------------------------------------------------------
    def serve(self, claim, card, payload) -> dict:
        """Rerun a claimant's inputs on this rank's model; the answer for the claimant."""
        rr = self.rerun
        model, reason = rr.target()
        if model is None:
            return {"error": reason}
        data = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        device = rr.device
        args, kwargs = pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x,
                                       (tuple(data["args"]), dict(data["kwargs"])))
        buffers = dict(model.named_buffers())
        before = {id(buffers[n]): t.to(buffers[n].device) for n, t in data["buffers"].items() if n in buffers}
        call = rr.peer_call(claim["batch"], data["cpu_rng"], data["device_rng"], before)
        spike = claim.get("spike")
        watch_module = None
        if spike is not None:
            owner = next((o for o in rr.inspector._owners if o.name == spike.get("module")), None)
            watch_module = owner.ref() if owner is not None and owner.ref is not None else None
            if watch_module is None:
                return {"error": f"this rank has no module {spike.get('module')!r}"}
        output, reproduced, watched, _ = rr._run(model, call, args, kwargs, watch_module,
                                                 loss=spike is not None and spike.get("quantity") == _spikes.LOSS)
        if spike is not None:
            middle = (spike["value"] * max(spike["baseline"], 1e-300)) ** 0.5
            again = watched is not None and watched >= middle
            seen = None if watched is None else f"{watched:.3e} against a spike of {spike['value']:.3e}"
        else:
            again = reproduced is not None
            seen = None if reproduced is None else f"non-finite in {reproduced[0] or '(root module)'}"
        return {"reproduced": again, "seen": seen, "digest": output_digest(rr.output_tensors(output, []))}

    # -- the verdict every rank gives --------------------------------------------------------------
    def final(self, outcome) -> dict:
        """The report's "rerun" field of a settled claim (NOTE: [device verdict])."""
        claim, card = outcome.claim, outcome.card
        f, b = outcome.claimant, claim["batch"]
        where = f"rank {f} ({card.get('host')} {card.get('device')})"
        result = {"verdict": claim.get("verdict"), "batch": b, "reason": claim.get("reason") or "",
                  "recovered": False, "detail": claim.get("detail") or "", "rank": f, "host": card.get("host"),
                  "device": card.get("device"), "peer": outcome.peer}
        if claim.get("module") is not None or claim.get("verdict") == "reproducible":
            result["module"], result["class"] = claim.get("module"), claim.get("class")
        if not result["verdict"]:
            result["reason"] = f"{result['reason']} (on {where})"
            return result
        if not claim.get("peer"):
            result["detail"] = f"on {where}: {result['detail']}"
            return result
        answer = outcome.answer
        if answer is None:
            result["detail"] = (f"on {where}: {result['detail']}; whether another device does the same could "
                                f"not be told: {outcome.problem}")
            return result
        same = answer.get("digest") is not None and answer.get("digest") == claim.get("digest")
        bits = "bit for bit the same output" if same else "an output that differs"
        theirs = answer.get("card") or {}
        weights = "" if theirs.get("digest") == card.get("digest") else (
            f"; rank {f}'s parameters differ bitwise from rank {outcome.peer}'s: a corrupted copy of the weights "
            f"on rank {f} does this too")
        if answer.get("reproduced"):
            result["verdict"] = "reproducible"
            result["detail"] = (f"{where} reproduced it in a rerun, and so did its data-parallel peer rank "
                                f"{outcome.peer} on the same inputs and random state ({bits}): the data or the "
                                f"model, not a device; {claim.get('detail') or ''}")
        else:
            result["verdict"] = "device"
            seen = f" ({answer['seen']})" if answer.get("seen") else ""
            result["detail"] = (f"{where} reproduced it in a rerun of batch {b}, but its data-parallel peer rank "
                                f"{outcome.peer}, given the same inputs, weights and random state, did not{seen}, "
                                f"with {bits}: suspect the device of rank {f} ({card.get('device')} on "
                                f"{card.get('host')}){weights}")
        return result

    def settle_trip(self, rerun, first, shared, tripped) -> dict | None:
        """The "rerun" field every rank reports for a trip (called in every rank's handling of it,
        after the trip details: NOTE: [device verdict]); commits a recovery every rank agreed on."""
        if not self.active():   # one process: rerun() kept its verdict and recovered already
            return rerun
        rr = self.rerun
        tentative, self.tentative = self.tentative, None
        note, self.note = self.note, None
        if not shared:   # a rank-local check (evaluation): recovering here holds no other rank up
            if tentative is not None and rerun is not None:
                rr.commit(rerun, *tentative)
            return self._keep(rerun)
        claim, payload = None, None
        if rerun is not None:
            if note is not None and note[0] == rerun.get("batch"):
                claim, payload = note[1], note[2]
            else:
                claim = {"what": "trip", "batch": rerun.get("batch"), "verdict": rerun.get("verdict"),
                         "detail": rerun.get("detail", ""), "reason": rerun.get("reason", ""),
                         "module": rerun.get("module"), "class": rerun.get("class"), "peer": False}
        peer_rerun, _ = _channel()
        card = self.card(tripped=tripped, recoverable=tentative is not None)
        settled = peer_rerun.settle(claim, payload, self.serve, card, only=first)
        if settled is None:
            if rerun is not None and tentative is not None:
                rerun["detail"] += ("; not recovered: the ranks could not agree on it (a rank missed the trip "
                                    "exchange, or does not watch with rerun=True)")
            return self._keep(rerun)
        outcomes, cards = settled
        if not outcomes:
            return self._keep(rerun)
        result = self.final(outcomes[0])
        tripped_cards = [c for c in cards if c.get("tripped")]
        if result.get("verdict") == "transient" and rr.recover and tripped_cards:
            ranks = ", ".join(str(c.get("rank")) for c in tripped_cards)
            if all(c.get("recoverable") for c in tripped_cards):
                if tentative is not None:
                    rr.commit(None, *tentative)
                result["recovered"] = True
                result["detail"] += (f"; recovered: every rank that tripped (rank {ranks}) returned its rerun's "
                                     "output in place of the corrupted one, and every rank goes on")
            else:
                result["detail"] += (f"; not recovered: not every rank that tripped (rank {ranks}) could "
                                     "recover its batch (found after the batch returned, or buffers without a copy)")
        return self._keep(result)

    def _keep(self, result):
        attribution = self.rerun.attribution(result) if result else None
        if attribution is not None:
            self.rerun.results.append(attribution)
        return result

    # -- spikes: settled at the next check -----------------------------------------------------------
    def spike_claimed(self, result, attribution):
        """(attribution, why none) for the spike warning this rank gives now; queues the claim."""
        note, self.note = self.note, None
        if note is None:
            return attribution, result.get("reason", "")
        self.queued.append((note[1], note[2]))
        if note[1]["peer"]:
            return None, ("this device reproduces it; a data-parallel peer reruns the batch at the next check, "
                          "and every rank is told the verdict")
        if attribution is not None:
            self.rerun.results.append(attribution)
        return attribution, ""

    def request(self) -> int:
        """The word this rank's trip exchange carries: rerun on, and whether it has a claim."""
        peer_rerun, _ = _channel()
        if self.announced is None and self.queued:
            self.announced = self.queued.popleft()
        return peer_rerun.RERUN_ON | (peer_rerun.CLAIMED if self.announced is not None else 0)

    def settle_requests(self, status) -> None:
        """Settle the spike claims the last trip exchange announced (every rank, same check)."""
        if not status.others or not self.active():
            return
        peer_rerun, _ = _channel()
        if not peer_rerun.ready():
            return   # an announced claim waits for the next complete exchange
        if not peer_rerun.claimed():
            return
        announced, self.announced = self.announced, None
        claim, payload = announced if announced is not None else (None, None)
        try:
            settled = peer_rerun.settle(claim, payload, self.serve, self.card())
        except Exception as exc:  # the verdicts are lost, never the job (the channel named who failed)
            warnings.warn(InspectorWarning(f"numguard: the cross-rank verdict of a spike failed "
                                           f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"),
                          stacklevel=4)
            return
        if settled is None:
            return
        me = _process.rank(default=None)
        for outcome in settled[0]:
            spike = outcome.claim.get("spike")
            if spike is None:
                continue
            result = self.final(outcome)
            if outcome.claimant == me and not outcome.claim.get("peer"):
                continue   # this rank warned with its own verdict already
            self._keep(result)
            attribution = self.rerun.attribution(result)
            text = _spikes.message(spike) + (f"; rerun verdict: {attribution}" if attribution is not None else
                                             f"; no rerun verdict: {result.get('reason') or result.get('detail')}")
            warnings.warn(SpikeWarning(text, spike, attribution), stacklevel=4)


__all__ = ["PeerVerdicts", "output_digest"]
