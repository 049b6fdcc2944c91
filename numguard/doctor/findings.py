"""Findings: what the gathered facts and measurements mean, each with a severity and advice.

Severity ``error`` means the job is broken as launched (wrong results, a missing rank, two ranks
on one GPU) and makes the exit status non-zero; ``warning`` is a risk or a slowdown worth fixing.
"""
from __future__ import annotations

import re
import statistics

__all__ = ["MIN_KERNEL", "PER_RANK_ENV", "SMALL_SHM_BYTES", "UNSET", "correctness", "env_values", "failed_step", "from_facts",
           "missing_ranks", "performance"]

MIN_KERNEL = (5, 5)
SMALL_SHM_BYTES = 1024 ** 3  # below 1 GiB: Docker's 64 MiB default and similar
_GIB = 1024 ** 3


def _finding(severity, code, title, advice, facts, ranks, detail=None):
    return {"severity": severity, "code": code, "title": title, "detail": detail, "advice": advice,
            "ranks": sorted(ranks), "hosts": sorted({facts[r]["host"] for r in ranks})}


def _where(facts, ranks):
    by_host = {}
    for r in sorted(ranks):
        by_host.setdefault(facts[r]["host"], []).append(r)
    return "; ".join(f"{h}: rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
                     for h, rs in by_host.items())


def _kernel_version(text):
    match = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def _groups(facts, key):
    groups = {}
    for f in facts:
        groups.setdefault(f.get(key), []).append(f["rank"])
    return groups


def _kernel(facts):
    old = [f["rank"] for f in facts if (_kernel_version(f["kernel"]) or MIN_KERNEL) < MIN_KERNEL]
    if not old:
        return []
    kernels = sorted({facts[r]["kernel"] for r in old})
    return [_finding(
        "warning", "old_kernel",
        f"Linux kernel {', '.join(kernels)} is older than 5.5 ({_where(facts, old)})",
        "Multi-process jobs on kernels before 5.5 are known to hang in collectives and in "
        "wait_for_everyone-style barriers (Accelerate warns below 5.5; distributions backport "
        "fixes, so this is a risk, not a verdict). Fix: boot a 5.5+ kernel (e.g. the "
        "distribution's HWE kernel). Without root: if a job hangs, rerun this doctor with "
        "NCCL_SHM_DISABLE=1, then with NCCL_P2P_DISABLE=1, to see whether the shared-memory or "
        "peer-to-peer transport is at fault (keep the one that helps; it costs some intra-node "
        "bandwidth), check the /dev/shm size (the shm column; df -h /dev/shm) and use "
        "--nccl-debug to see where it stops.",
        facts, old)]


def _mixed_devices(facts):
    out = []
    models = _groups(facts, "device_model")
    if len(models) > 1:
        out.append(_finding(
            "warning", "mixed_models",
            "Ranks use different device models: " + "; ".join(
                f"{m} ({_where(facts, rs)})" for m, rs in models.items()),
            "Every collective runs at the pace of the slowest device, so the fast ones idle; give "
            "the job one model per job, or balance the work per rank.", facts,
            [r for rs in models.values() for r in rs]))
    totals = [f["memory_total"] for f in facts if f.get("memory_total")]
    if totals and facts[0]["device"] != "cpu" and max(totals) > 1.01 * min(totals):
        small = [f["rank"] for f in facts if f.get("memory_total") == min(totals)]
        out.append(_finding(
            "warning", "mixed_memory",
            f"Device memory differs across ranks: {min(totals) / _GIB:.1f} to "
            f"{max(totals) / _GIB:.1f} GiB (smallest: {_where(facts, small)})",
            f"A per-rank batch size that fits the largest device runs out of memory on the "
            f"smallest: size batches for {min(totals) / _GIB:.1f} GiB, or the whole job stops at "
            "the first OOM on those ranks.", facts, small))
    return out


def _shm(facts):
    small = [f["rank"] for f in facts if f.get("shm_total") is not None
             and f["shm_total"] < SMALL_SHM_BYTES]
    if not small:
        return []
    sizes = sorted({facts[r]["shm_total"] for r in small})
    return [_finding(
        "warning", "small_shm",
        f"/dev/shm holds only {', '.join(f'{s / 1024 ** 2:.0f} MiB' for s in sizes)} "
        f"({_where(facts, small)})",
        "NCCL's shared-memory transport and DataLoader workers use /dev/shm; when it fills they "
        "crash with 'Bus error' or hang. In Docker run with --ipc=host or --shm-size=16g "
        "(Kubernetes: an emptyDir with medium: Memory at /dev/shm); if you cannot, "
        "NCCL_SHM_DISABLE=1 avoids the shared-memory transport at some intra-node bandwidth "
        "cost.", facts, small)]


def _versions(facts):
    out = []
    for key, label in (("torch", "torch"), ("nccl", "NCCL"), ("cuda", "CUDA"),
                       ("driver", "NVIDIA driver"), ("python", "Python")):
        groups = _groups(facts, key)
        if len(groups) > 1:
            out.append(_finding(
                "warning", f"mixed_{key}",
                f"Ranks run different {label} versions: " + "; ".join(
                    f"{v} ({_where(facts, rs)})" for v, rs in groups.items()),
                f"Install one {label} version on every node: collectives and their wire formats "
                "are only tested between identical builds, and a mismatch can return wrong results "
                "or hang.", facts, [r for rs in groups.values() for r in rs]))
    return out


# Variables that differ per rank by design: a rank's own device list, the doctor's per-rank log.
PER_RANK_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "NCCL_DEBUG_FILE"})
UNSET = "<unset>"


def env_values(facts):
    """{variable: {value or UNSET: [ranks]}} of every variable the ranks reported."""
    names = sorted({k for f in facts for k in f.get("env", {})})
    return {k: _groups([{"rank": f["rank"], "v": f.get("env", {}).get(k, UNSET)} for f in facts], "v")
            for k in names}


def _mixed_env(facts):
    """NCCL_* / TORCH_* settings that differ across ranks: ranks then disagree on algorithms,
    protocols, interfaces or timeouts, which hangs or slows collectives with no error."""
    out = []
    for name, groups in env_values(facts).items():
        if name in PER_RANK_ENV or len(groups) < 2:
            continue
        out.append(_finding(
            "warning", "mixed_env",
            f"{name} differs across ranks: " + "; ".join(
                f"{name}={v} ({_where(facts, rs)})" if v != UNSET else f"unset ({_where(facts, rs)})"
                for v, rs in groups.items()),
            f"Set {name} the same on every rank (in the launcher's environment, not per node's "
            "shell profile): NCCL and torch.distributed expect one setting job-wide, and ranks that "
            "pick different transports, algorithms or timeouts can hang or run at the slowest's pace.",
            facts, [r for rs in groups.values() for r in rs]))
    return out


def _collisions(facts):
    seen = {}
    for f in facts:
        if f["device"].startswith("cuda"):
            ident = f.get("device_uuid") or f.get("pci_bus_id") or f["device"]
            seen.setdefault((f["host"], ident), []).append(f["rank"])
    out = []
    for (host, ident), ranks in seen.items():
        if len(ranks) > 1:
            envs = sorted({facts[r]["env"].get("CUDA_VISIBLE_DEVICES", "<unset>") for r in ranks})
            out.append(_finding(
                "error", "device_collision",
                f"Ranks {', '.join(map(str, ranks))} on {host} share one GPU ({ident}; "
                f"CUDA_VISIBLE_DEVICES={', '.join(envs)})",
                "Give each rank its own device: leave CUDA_VISIBLE_DEVICES unset under torchrun "
                "(each rank uses cuda:LOCAL_RANK), or set it per rank; NCCL refuses two ranks on "
                "one GPU and they would share its memory.", facts, ranks))
    return out


def from_facts(facts):
    """Findings from the gathered facts alone (before any collective is checked)."""
    return (_collisions(facts) + _kernel(facts) + _mixed_devices(facts) + _shm(facts)
            + _versions(facts) + _mixed_env(facts))


def correctness(facts, records_by_rank):
    """Errors for wrong results (one per op and set of ranks) and the per-check table."""
    table, groups = [], {}
    for k, first in enumerate(records_by_rank[0]):
        wrong = {r: recs[k]["error"] for r, recs in enumerate(records_by_rank)
                 if k < len(recs) and not recs[k]["ok"]}
        skipped = next((recs[k]["skipped"] for recs in records_by_rank
                        if k < len(recs) and recs[k]["skipped"]), None)
        row = {key: first[key] for key in ("name", "op", "dtype", "elements")}
        row.update({"ok": not wrong, "skipped": skipped, "wrong_ranks": sorted(wrong),
                    "errors": {str(r): e for r, e in sorted(wrong.items())}})
        table.append(row)
        if wrong:
            groups.setdefault((first["op"], tuple(sorted(wrong))), []).append(row)
    out = []
    for (op, ranks), rows in groups.items():
        total = sum(1 for row in table if row["op"] == op)
        example = rows[0]
        out.append(_finding(
            "error", "wrong_result",
            f"{op}: wrong result on {_where(facts, ranks)} in {len(rows)} of {total} checks",
            "The collective returned a different value than the exact answer: suspect that "
            "host's device or driver (run the doctor again on a set without it), a mismatched "
            "NCCL build, or an environment override (NCCL_ALGO/NCCL_PROTO) on those ranks.",
            facts, list(ranks),
            detail=f"e.g. {example['name']}: " + "; ".join(
                f"rank {r}: {e}" for r, e in example["errors"].items())))
    return out, table


def performance(facts, straggle, pairs):
    """Warnings for late ranks, slow compute and slow links."""
    out = []
    late = {int(r): z for r, z in straggle["late_ranks"].items()}
    if late:
        lateness = straggle["lateness_s"]
        out.append(_finding(
            "warning", "straggler",
            "Straggler: " + "; ".join(f"rank {r} on {facts[r]['host']} arrives "
                                      f"{lateness[r] * 1e3:.1f} ms late (z={z:.1f})"
                                      for r, z in sorted(late.items())),
            "Every collective waits for this rank. Look for what else runs on that host (CPU "
            "contention, a data loader starved of cores, throttling, a busy network interface), "
            "and compare its compute time in the straggler-probe line (a slow device shows "
            "there).", facts, list(late)))
    slow = {int(r): z for r, z in straggle["slow_compute_ranks"].items()}
    if slow:
        med = statistics.median(straggle["compute_s"])
        out.append(_finding(
            "warning", "slow_compute",
            "Slow compute probe: " + "; ".join(
                f"rank {r} on {facts[r]['host']} takes {straggle['compute_s'][r] * 1e3:.2f} ms "
                f"(median {med * 1e3:.2f} ms, z={z:.1f})" for r, z in sorted(slow.items())),
            "The same fixed work is slower on this rank's device: check clocks and temperature "
            "(nvidia-smi -q -d PERFORMANCE,TEMPERATURE), other processes on the device, and the "
            "CPU affinity of the rank.", facts, list(slow)))
    if pairs:
        links = [(pairs[i][j], i, j) for i in range(len(pairs)) for j in range(i + 1, len(pairs))
                 if pairs[i][j]]
        if len(links) >= 2:
            med = statistics.median(bw for bw, _, _ in links)
            for bw, i, j in links:
                if bw < 0.5 * med:
                    out.append(_finding(
                        "warning", "slow_link",
                        f"Slow link: ranks {i} ({facts[i]['host']}) <-> {j} ({facts[j]['host']}) "
                        f"{bw:.2f} GB/s, under half the median pair ({med:.2f} GB/s)",
                        "Check that link's cabling/NIC (ibstat, ethtool), NCCL_IB_HCA and "
                        "NCCL_SOCKET_IFNAME on both hosts, and the PCIe/NVLink topology "
                        "(nvidia-smi topo -m).", facts, [i, j]))
    return out


def missing_ranks(missing, arrived, timeout):
    """The error for ranks that never joined (no facts exist for them, so hosts are unknown)."""
    return {"severity": "error", "code": "missing_ranks",
            "title": f"Ranks {missing} never joined within {timeout:g} s",
            "detail": "arrived: " + ", ".join(f"rank {r} on {h}" for r, h in sorted(
                arrived.items(), key=lambda kv: int(kv[0]))),
            "advice": "Check that those ranks were started (their launcher's log), that their "
                      "hosts reach MASTER_ADDR:MASTER_PORT (firewall, a wrong interface), and that "
                      "--nnodes/--nproc_per_node and WORLD_SIZE agree on every node; a slow start "
                      "(container pull, module load) needs a longer --timeout.",
            "ranks": list(missing), "hosts": []}


def failed_step(failure, facts):
    """The error for a step that timed out or failed on this rank, naming the ranks at fault."""
    def ranks(key):
        value = failure.get(key)
        return [r for r in value if isinstance(r, int)] if isinstance(value, list) else []
    died, stuck, absent = ranks("died"), ranks("stuck"), ranks("not_started")
    at_fault = sorted(set(died) | set(stuck) | set(absent))
    advice = []
    if died:
        advice.append(f"Ranks {died} died during the run: read their own output and the "
                      "launcher's log for their exit status; a process killed without a word is "
                      "often the kernel's OOM killer (dmesg | grep -i -e oom -e killed on its "
                      "host) or a crash in a native library.")
    if stuck or absent or not died:
        advice.append("The ranks that stopped making progress are hung or far slower than the "
                      "others: look at them while they hang (py-spy dump --pid PID), at their "
                      "host's load and devices, and on GPUs rerun with --nccl-debug.")
    return {"severity": "error", "code": "step_" + failure["kind"],
            "title": f"rank {failure['rank']}: {failure['message']}", "detail": None,
            "advice": " ".join(advice), "ranks": at_fault,
            "hosts": sorted({facts[r]["host"] for r in at_fault if r < len(facts)})}
