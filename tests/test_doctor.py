"""``numguard doctor`` on CPU (gloo): healthy runs, injected faults, timeouts and the JSON schema.

Ranks run as subprocesses of tests/doctor_rank.py, which injects a fault into one rank through
NUMGUARD_DOCTOR_TEST_FAULT (numguard never reads it). Every launch has a hard timeout after which
all of its ranks are killed, so a doctor that hung would fail the test instead of the suite.
"""
import http.server
import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from numguard.cli import main
from numguard.doctor import findings, parse_sizes, performance
from numguard.doctor import report as doctor_report

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from dist_workers import RankProcesses, job_environs  # noqa: E402

RANK_SCRIPT = os.path.join(HERE, "doctor_rank.py")
FAST = ["--sizes", "1K", "16K", "--iters", "2"]


def launch(world, args, faults=None, absent=(), timeout=150, port=None, env=None):
    """Run the doctor on ``world`` ranks but ``absent``; returns {rank: (rc, out, err)} (a rank
    still running after ``timeout`` is killed: its rc is negative).

    ``env``: {rank: {variable: value}} added to that rank's environment.
    """
    base = {k: v for k, v in os.environ.items() if k != "NUMGUARD"}
    rank_env = {r: dict((env or {}).get(r, {})) for r in range(world)}
    for r in range(world):
        rank_env[r].setdefault("NUMGUARD_DOCTOR_TEST_FAULT", (faults or {}).get(r, ""))
    environs = job_environs(world, rank_env=rank_env, absent=absent, port=port, base=base)
    outputs = RankProcesses([sys.executable, RANK_SCRIPT] + list(args), environs).wait(timeout)
    return {r: out for r, out in enumerate(outputs) if out is not None}


def _json(tmp_path, name="doctor.json"):
    return str(tmp_path / name)


def _load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _codes(res):
    return {r: rc for r, (rc, _, _) in res.items()}


# ---------------------------------------------------------------------------------------------
# healthy runs

@pytest.fixture(scope="module")
def healthy2(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("healthy2") / "doctor.json")
    res = launch(2, FAST + ["--json", path, "--nccl-debug"])
    return res, _load(path), path


def test_healthy_two_ranks(healthy2):
    res, data, path = healthy2
    assert _codes(res) == {0: 0, 1: 0}, res
    out = res[0][1]
    assert "numguard doctor: 2 rank(s), backend gloo: HEALTHY" in out
    # Timing findings depend on the machine's load (no timing asserts); nothing else may show.
    timing = {"straggler", "slow_compute", "slow_link"}
    assert [f for f in data["findings"] if f["code"] not in timing] == []
    assert res[1][1] == ""  # only rank 0 prints the report
    assert data["status"] == "healthy" and data["exit_status"] == 0
    assert [f["rank"] for f in data["facts"]] == [0, 1]
    checks = data["checks"]
    assert {c["op"] for c in checks} == {"all_reduce", "all_gather", "broadcast",
                                         "reduce_scatter", "barrier"}
    assert all(c["ok"] and c["skipped"] is None for c in checks), checks
    assert {c["dtype"] for c in checks if c["op"] == "all_reduce"} == {
        "float32", "float64", "float16", "bfloat16", "int32", "int64"}


def test_bus_bandwidth_uses_the_nccl_tests_factors(healthy2):
    _, data, _ = healthy2
    rows = data["performance"]["bandwidth"]
    assert {(r["op"], r["bytes"]) for r in rows} == {
        (op, b) for op in ("all_reduce", "all_gather", "reduce_scatter") for b in (1024, 16384)}
    for r in rows:
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
        factor = 1.0 if r["op"] == "all_reduce" else 0.5  # 2(n-1)/n and (n-1)/n for n=2
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor)
        assert r["time_s"] == max(r["per_rank_time_s"])


def test_nccl_debug_is_set_before_the_group_starts(healthy2):
    _, data, path = healthy2
    folder = os.path.splitext(path)[0] + ".nccl"
    assert data["nccl_debug"]["folder"] == folder and os.path.isdir(folder)
    for f in data["facts"]:
        assert f["env"]["NCCL_DEBUG"] == "INFO"
        log = os.path.join(folder, f"rank{f['rank']}.{f['host']}.log")
        assert f["env"]["NCCL_DEBUG_FILE"] == log
    assert data["nccl_logs"] == []  # gloo only: NCCL never started, so it wrote no log


def test_json_schema_four_ranks_with_pairs_and_plot(tmp_path):
    path, png = _json(tmp_path), str(tmp_path / "doctor.png")
    res = launch(4, ["--sizes", "4K", "--iters", "2", "--pairs", "--json", path, "--plot", png])
    assert _codes(res) == {0: 0, 1: 0, 2: 0, 3: 0}, res
    data = _load(path)
    assert data["schema"] == "numguard.doctor/1"
    for key, kind in (("status", str), ("exit_status", int), ("world_size", int), ("backend", str),
                      ("options", dict), ("missing_ranks", list), ("arrived", dict),
                      ("failures", list), ("facts", list), ("findings", list), ("checks", list),
                      ("performance", dict)):
        assert isinstance(data[key], kind), key
    assert data["world_size"] == 4 and data["arrived"].keys() == {"0", "1", "2", "3"}
    fact_keys = {"host", "rank", "local_rank", "device", "device_model", "memory_total",
                 "memory_free", "compute_capability", "torch", "cuda", "nccl", "driver", "python",
                 "kernel", "shm_total", "cpus", "env"}
    for r, f in enumerate(data["facts"]):
        assert fact_keys <= f.keys() and f["rank"] == r
        assert f["env"]["MASTER_ADDR"] == "127.0.0.1"
    perf = data["performance"]
    assert len(perf["latency_s"]) == 4 and all(x > 0 for x in perf["latency_s"])
    assert len(perf["stragglers"]["lateness_s"]) == 4
    m = perf["pairs"]
    assert len(m) == 4 and all(m[i][i] is None for i in range(4))
    assert all(m[i][j] == m[j][i] and m[i][j] > 0 for i in range(4) for j in range(4) if i != j)
    assert "Send/recv round-trip bandwidth" in res[0][1]
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_single_process_runs_without_torchrun(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "NUMGUARD")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-m", "numguard", "doctor", "--iters", "1"], env=env,
                         cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "1 rank(s), backend gloo: HEALTHY" in out.stdout
    assert "not measured (one rank has no peer" in out.stdout


# ---------------------------------------------------------------------------------------------
# injected faults

def test_rank_that_never_joins_is_named(tmp_path):
    path = _json(tmp_path)
    res = launch(4, ["--timeout", "5", "--json", path], absent={2})
    assert _codes(res) == {0: 1, 1: 1, 3: 1}, res
    assert "Ranks that never joined within 5 s: [2]" in res[0][1]
    for r in (1, 3):
        assert "ranks that never joined within 5 s: [2]" in res[r][2]
    data = _load(path)
    assert data["missing_ranks"] == [2] and data["status"] == "failed"
    (missing,) = data["findings"]
    assert missing["code"] == "missing_ranks" and missing["ranks"] == [2]
    assert missing["severity"] == "error" and "never joined within 5 s" in missing["title"]
    assert sorted(data["arrived"]) == ["0", "1", "3"]


def test_rank_zero_that_never_starts_is_named():
    res = launch(2, ["--timeout", "3"], absent={0})
    rc, _, err = res[1]
    assert rc == 1
    assert "could not reach the rendezvous store at 127.0.0.1:" in err
    assert "rank 0 never started it" in err


class _SilentServer:
    """Accepts every connection on a free port and never says a word (a hung or foreign server)."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self):
        for c in self.accepted:
            c.close()
        self.sock.close()


class _HttpServer:
    """A plain HTTP server: answers a store's binary greeting with 400 and keeps the socket."""

    def __init__(self):
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                                      http.server.BaseHTTPRequestHandler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("server", [_SilentServer, _HttpServer])
def test_foreign_server_on_master_port_fails_instead_of_hanging(server):
    listener = server()
    try:
        res = launch(2, ["--timeout", "3"], port=listener.port, timeout=120)
    finally:
        listener.close()
    assert _codes(res) == {0: 1, 1: 1}, res
    where = f"127.0.0.1:{listener.port}"
    # Rank 0 cannot host the store on a port that is taken; rank 1 reaches the foreign server.
    assert f"FAILED: rank 0 could not host the rendezvous store on {where}" in res[0][2]
    err = res[1][2]
    assert f"FAILED: rank 1 on {socket.gethostname()}: {where} accepts connections but did not " \
           "answer as a torch.distributed store within 3 s" in err
    assert f"MASTER_PORT={listener.port}" in err and "free MASTER_PORT" in err
    assert "Traceback" not in err


def test_wrong_all_reduce_names_the_rank(tmp_path):
    path = _json(tmp_path)
    res = launch(2, FAST + ["--json", path], faults={1: "wrong_all_reduce"})
    assert _codes(res) == {0: 1, 1: 1}, res  # every rank agrees on the verdict
    data = _load(path)
    wrong = [f for f in data["findings"] if f["code"] == "wrong_result"]
    assert len(wrong) == 1 and wrong[0]["ranks"] == [1] and wrong[0]["severity"] == "error"
    assert "all_reduce: wrong result on" in wrong[0]["title"] and "rank 1" in wrong[0]["title"]
    for c in data["checks"]:
        assert c["ok"] == (c["op"] != "all_reduce"), c
        if c["op"] == "all_reduce":
            assert c["wrong_ranks"] == [1] and "got" in c["errors"]["1"]
    assert "WRONG  all_reduce sum float32 x1: ranks [1]" in res[0][1]
    assert "numguard doctor: rank 1: failed (all_reduce: wrong result on" in res[1][2]


def test_slow_rank_is_named_as_the_straggler(tmp_path):
    # 0.25 s per all_reduce on rank 3: far beyond any scheduling noise, so the name is certain.
    path = _json(tmp_path)
    res = launch(4, ["--sizes", "1K", "--iters", "1", "--json", path],
                 faults={3: "slow_all_reduce:0.25"})
    assert _codes(res) == {0: 0, 1: 0, 2: 0, 3: 0}, res  # slow is a warning, not a failure
    data = _load(path)
    late = [f for f in data["findings"] if f["code"] == "straggler"]
    assert len(late) == 1 and late[0]["ranks"] == [3], data["findings"]
    assert late[0]["hosts"] == [data["facts"][3]["host"]]
    assert list(data["performance"]["stragglers"]["late_ranks"]) == ["3"]
    assert "Straggler: rank 3 on" in res[0][1]


def test_step_timeout_names_the_stuck_rank(tmp_path):
    path = _json(tmp_path)
    res = launch(2, FAST + ["--timeout", "5", "--json", path], faults={1: "slow_all_reduce:12"})
    assert _codes(res) == {0: 1, 1: 1}, res
    data = _load(path)
    failure = data["failures"][0]
    assert failure["kind"] == "timeout" and failure["step"] == "all_reduce sum float32 x1"
    assert failure["stuck"] == [1] and failure["waiting"] == [0] and failure["not_started"] == []
    assert "ranks inside it that stopped making progress: [1]" in res[0][1]
    (timed_out,) = [f for f in data["findings"] if f["code"] == "step_timeout"]
    assert timed_out["ranks"] == [1] and timed_out["hosts"] == [data["facts"][1]["host"]]


def test_rank_that_dies_mid_run_is_named_on_every_survivor_and_in_the_json(tmp_path):
    path = _json(tmp_path)
    res = launch(3, FAST + ["--timeout", "5", "--json", path], faults={1: "exit_on_all_reduce:3"})
    assert _codes(res) == {0: 1, 1: 1, 2: 1}, res
    data = _load(path)
    (failure,) = data["failures"]
    assert failure["kind"] == "error" and failure["rank"] == 0
    assert failure["died"] == [1] and failure["failed"] == [0, 2], failure
    assert "ranks that died: [1]" in failure["message"]
    (failed,) = [f for f in data["findings"] if f["code"] == "step_error"]
    assert failed["ranks"] == [1] and failed["hosts"] == [data["facts"][1]["host"]]
    assert "Ranks [1] died during the run" in failed["advice"]
    assert "ranks that died: [1]" in res[0][1]
    assert "numguard doctor: rank 2: step " in res[2][2] and "ranks that died: [1]" in res[2][2]


def test_rank_zero_killed_mid_run_is_named_by_the_others():
    # Rank 0 hosts the store, so the survivors learn of its death from the store going away.
    res = launch(2, FAST + ["--timeout", "5"], faults={0: "kill_on_all_reduce:2"})
    assert res[0][0] == -9 and res[1][0] == 1, res
    assert "numguard doctor: rank 1: step " in res[1][2] and "ranks that died: [0]" in res[1][2]


def test_unwritable_json_is_refused_before_the_run_on_every_rank(tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    bad = str(tmp_path / "a_file" / "doctor.json")  # unwritable for root too
    res = launch(2, FAST + ["--json", bad])
    assert _codes(res) == {0: 2, 1: 2}, res
    assert f"numguard doctor: --json {bad!r} cannot be written (" in res[0][2]
    assert f"numguard doctor: rank 0 refused to start: --json {bad!r} cannot be written" \
        in res[1][2]
    for rc, out, err in res.values():
        assert "Traceback" not in err and out == ""  # nothing ran


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_json_or_plot_path_that_is_a_folder_is_a_usage_error(monkeypatch, capsys, tmp_path,
                                                              option):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert main(["doctor", option, str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"numguard doctor: {option} {str(tmp_path)!r} is a folder; give the path of a file" \
        in err


def test_json_that_fails_at_the_end_keeps_the_report(tmp_path):
    path = _json(tmp_path)
    res = launch(1, FAST + ["--json", path], faults={0: "json_write_fails"})
    rc, out, err = res[0]
    assert rc == 1, res
    assert "numguard doctor: 1 rank(s), backend gloo: HEALTHY" in out and "Findings" in out
    assert f"numguard doctor --json: cannot write {path!r} (No space left on device)" in err
    assert "Traceback" not in err and not os.path.exists(path)


def test_old_kernel_on_one_rank(tmp_path):
    path = _json(tmp_path)
    res = launch(2, FAST + ["--json", path], faults={1: "kernel:5.4.0-150-generic"})
    assert _codes(res) == {0: 0, 1: 0}, res
    data = _load(path)
    assert [f["kernel"] for f in data["facts"]][1] == "5.4.0-150-generic"
    (old,) = [f for f in data["findings"] if f["code"] == "old_kernel"]
    assert old["ranks"] == [1] and old["severity"] == "warning"
    assert "5.4.0-150-generic is older than 5.5" in old["title"]
    for advice in ("5.5+", "NCCL_SHM_DISABLE=1", "NCCL_P2P_DISABLE=1", "/dev/shm"):
        assert advice in old["advice"]


def test_mismatched_torch_versions(tmp_path):
    path = _json(tmp_path)
    res = launch(2, FAST + ["--json", path], faults={0: "torch:2.0.0+other"})
    assert _codes(res) == {0: 0, 1: 0}, res
    data = _load(path)
    (mixed,) = [f for f in data["findings"] if f["code"] == "mixed_torch"]
    assert mixed["ranks"] == [0, 1]
    assert f"2.0.0+other ({data['facts'][0]['host']}: rank 0)" in mixed["title"]
    assert data["facts"][1]["torch"] in mixed["title"]


# ---------------------------------------------------------------------------------------------
# options, formulas and findings without launching ranks

@pytest.mark.parametrize("argv, message", [
    (["--sizes", "12Q"], "'12Q' is not a size"),
    (["--sizes", "0"], "'0' is not a size"),
    (["--timeout", "-1"], "--timeout -1.0 is out of range"),
    (["--timeout", "nan"], "--timeout nan is out of range"),
    (["--iters", "0"], "--iters 0 must be at least 1"),
])
def test_bad_options_are_named(capsys, argv, message):
    assert main(["doctor"] + argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("variables, message", [
    ({"WORLD_SIZE": "2", "RANK": "1"}, "MASTER_PORT is not set"),
    ({"WORLD_SIZE": "2", "RANK": "one", "MASTER_PORT": "29500"},
     "RANK='one' is not a whole number"),
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_PORT": "29500"}, "RANK=2 is not in 0..WORLD_SIZE-1"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP"),
])
def test_bad_launcher_variables_are_named(monkeypatch, capsys, variables, message):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert main(["doctor", "--timeout", "1"]) == 2
    assert message in capsys.readouterr().err


def test_parse_sizes():
    assert parse_sizes(["1K", "4m", "1024", "2GiB", "1k"]) == [1024, 4 * 1024 ** 2, 2 * 1024 ** 3]


def test_busbw_factors():
    assert performance.BUSBW_FACTOR("broadcast", 8) == 1.0 and performance.BUSBW_FACTOR("reduce", 4) == 1.0
    assert performance.BUSBW_FACTOR("all_to_all", 4) == pytest.approx(3 / 4)
    with pytest.raises(ValueError, match="'gather'"):
        performance.BUSBW_FACTOR("gather", 4)
    assert performance.BUSBW_FACTOR("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert performance.BUSBW_FACTOR("all_gather", 8) == pytest.approx(7 / 8)
    assert performance.BUSBW_FACTOR("reduce_scatter", 4) == pytest.approx(3 / 4)
    assert performance.BUSBW_FACTOR("all_reduce", 1) == 0.0


def test_robust_outliers():
    floor = 0.001
    assert performance.robust_outliers([0.0, 0.2], floor) == {1: pytest.approx(200.0)}
    assert performance.robust_outliers([0.010, 0.011, 0.009, 0.010], floor) == {}
    noisy = [0.010, 0.030, 0.020, 0.015, 0.025, 0.5]
    assert list(performance.robust_outliers(noisy, floor)) == [5]
    assert performance.robust_outliers([0.0], floor) == {}


def _gpu_facts(n, changes=None):
    base = {"host": "node", "device": "cuda:0", "device_model": "NVIDIA H100", "kernel": "6.5.0",
            "memory_total": 80 * 1024 ** 3, "memory_free": 79 * 1024 ** 3,
            "shm_total": 64 * 1024 ** 3, "torch": "2.13.0", "nccl": "2.27.3", "cuda": "12.8",
            "driver": "570.1", "python": "3.11.7",
            "device_uuid": None, "pci_bus_id": None, "env": {}}
    facts = []
    for r in range(n):
        f = dict(base, rank=r, device=f"cuda:{r}", device_uuid=f"GPU-{r}")
        f.update((changes or {}).get(r, {}))
        facts.append(f)
    return facts


def test_two_ranks_on_one_gpu_is_an_error():
    facts = _gpu_facts(3, {2: {"device_uuid": "GPU-0", "env": {"CUDA_VISIBLE_DEVICES": "0"}}})
    (found,) = findings.from_facts(facts)
    assert found["code"] == "device_collision" and found["severity"] == "error"
    assert found["ranks"] == [0, 2] and "CUDA_VISIBLE_DEVICES=0, <unset>" in found["title"]


def test_mixed_models_memory_and_small_shm():
    facts = _gpu_facts(2, {1: {"device_model": "NVIDIA A100", "memory_total": 40 * 1024 ** 3,
                                 "shm_total": 64 * 1024 ** 2}})
    by_code = {f["code"]: f for f in findings.from_facts(facts)}
    assert set(by_code) == {"mixed_models", "mixed_memory", "small_shm"}
    memory, shm = by_code["mixed_memory"], by_code["small_shm"]
    assert "40.0 GiB" in memory["advice"] and memory["ranks"] == [1]
    assert "64 MiB" in shm["title"] and "--shm-size" in shm["advice"]
    assert findings.from_facts(_gpu_facts(2)) == []


def test_kernel_version_parsing():
    for text, old in (("5.4.0-150-generic", True), ("4.18.0-348.el8", True), ("5.5.0", False),
                      ("6.18.44-fc", False), ("unknown", False)):
        facts = _gpu_facts(1, {0: {"kernel": text}})
        assert [f["code"] for f in findings.from_facts(facts)] == (["old_kernel"] if old else [])


def test_nccl_variables_that_differ_across_ranks_are_a_finding_naming_whose_values():
    facts = _gpu_facts(3, {0: {"env": {"NCCL_IB_DISABLE": "1", "NCCL_DEBUG_FILE": "/tmp/r0"}},
                           1: {"env": {"NCCL_IB_DISABLE": "0", "NCCL_DEBUG_FILE": "/tmp/r1"}},
                           2: {"env": {"NCCL_DEBUG_FILE": "/tmp/r2"}}})
    for f in facts:
        f["env"]["NCCL_SOCKET_IFNAME"] = "eth0"  # the same everywhere: no finding
    (found,) = findings.from_facts(facts)
    assert found["code"] == "mixed_env" and found["severity"] == "warning" and found["ranks"] == [0, 1, 2]
    assert found["title"] == ("NCCL_IB_DISABLE differs across ranks: NCCL_IB_DISABLE=1 (node: rank 0); "
                              "NCCL_IB_DISABLE=0 (node: rank 1); unset (node: rank 2)")
    result = {"world_size": 3, "backend": "nccl", "status": "warning", "missing_ranks": [], "arrived": {},
              "options": {"timeout": 60}, "failures": [], "facts": facts, "checks": [], "performance": {},
              "findings": [found]}
    text = doctor_report.render(result)
    assert "  environment (every rank): NCCL_SOCKET_IFNAME=eth0" in text
    assert "  environment differs: NCCL_IB_DISABLE: 1 (rank 0), 0 (rank 1), <unset> (rank 2)" in text
    assert "NCCL_DEBUG_FILE: /tmp/r0 (rank 0), /tmp/r1 (rank 1), /tmp/r2 (rank 2)" in text
