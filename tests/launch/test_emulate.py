"""The emulated cluster with real namespaces, veth links, tc and torchrun: spec, bench, profile, teardown."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from torsh_tune.config import BudgetConfig, ProfilerConfig, RunConfig
from torsh_tune.errors import ConfigError
from torsh_tune.launch import launch_run
from torsh_tune.launch.emulate import (
    faketime_library,
    NODE_IFNAME,
    EmulatedCluster,
    EmulateSpec,
    owned_namespaces,
    remove_stale_namespaces,
)
from torsh_tune.rundir import new_run_dir

from helpers import EXAMPLES, REPO, run_cli, run_survivors, sigint_as_ctrl_c

# Shaped links, and `owned_namespaces()` lists every emulated cluster on the host: no other test's cluster may
# come or go meanwhile, so these run alone (`make test` runs the `serial` tests after the parallel part).
pytestmark = pytest.mark.serial

SPEC = "nodes=2,procs_per_node=2,link=1gbit"
LINK_GBPS = 1.0

can_emulate = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="the emulated cluster needs root and iproute2",
)


def _ours(pid: int) -> list[str]:
    """Namespaces, /etc/netns entries and root-namespace links a cluster owned by `pid` left behind."""
    left = [name for name, owner in owned_namespaces().items() if owner == pid]
    left += [str(p) for p in Path("/etc/netns").glob(f"tt{pid}*")]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    left += [line for line in links.splitlines() if NODE_IFNAME in line or f"tt{pid}" in line]
    return left


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    # Whatever a test did, nothing of a dead owner may stay for the next one (or the next suite).
    if os.geteuid() == 0 and shutil.which("ip"):
        remove_stale_namespaces()


# -- the spec ---------------------------------------------------------------------------------------
def test_spec_parses_units_and_defaults() -> None:
    spec = EmulateSpec.parse("nodes=3, procs_per_node=2, link=100mbit, latency=20ms, burst=64kb")
    assert (spec.nodes, spec.procs_per_node, spec.link_bps) == (3, 2, 100e6)
    assert spec.latency_s == pytest.approx(0.02) and spec.burst_bytes == 64 << 10
    assert EmulateSpec.parse(spec.text()) == spec
    default = EmulateSpec.parse(SPEC)
    assert default.link_gbps == LINK_GBPS and default.burst_bytes == 256 << 10 and default.clock_skew_s == 0.0
    skewed = EmulateSpec.parse(SPEC + ",clock_skew=20ms")
    assert skewed.clock_skew_s == pytest.approx(0.02)
    assert EmulateSpec.parse(skewed.text()).clock_skew_s == pytest.approx(0.02)
    assert "node i's clock i x 20 ms ahead" in skewed.describe() and skewed.to_dict()["clock_skew_s"] == 0.02
    drifting = EmulateSpec.parse(SPEC + ",clock_drift=1000ppm")
    assert (drifting.clock_drift_ppm, drifting.clock_skew_s, drifting.fakes_clocks) == (1000.0, 0.0, True)
    assert EmulateSpec.parse(drifting.text()).clock_drift_ppm == 1000.0 and "node i's clock i x 1000 ppm fast" in drifting.describe()
    assert not default.fakes_clocks


@pytest.mark.parametrize(("text", "message"), [
    ("nodes=1,procs_per_node=2,link=1gbit", "--emulate nodes must be an integer >= 2, but got 1"),
    ("nodes=two,procs_per_node=2,link=1gbit", "--emulate nodes must be an integer >= 2, but got 'two'"),
    ("nodes=2,procs_per_node=0,link=1gbit", "--emulate procs_per_node must be an integer >= 1, but got 0"),
    ("nodes=2,procs_per_node=2,link=1gparsec", "--emulate link must be a rate > 0 such as 1gbit or 100mbit, but got '1gparsec'"),
    ("nodes=2,procs_per_node=2", "--emulate must be a spec with link"),
    ("nodes=2,procs_per_node=2,link=1gbit,delay=1ms",
     "--emulate key must be one of nodes, procs_per_node, link, latency, burst, clock_skew, clock_drift, but got 'delay'"),
    ("nodes=2,procs_per_node=2,link=1gbit,clock_drift=-5", "--emulate clock_drift must be parts per million > 0"),
    ("nodes=2,procs_per_node=2,link=1gbit,clock_drift=fast", "--emulate clock_drift must be parts per million > 0"),
    ("nodes=2,procs_per_node=2,link=1gbit,clock_skew=11s", "--emulate clock_skew must be at most 10s, but got '11s'"),
    ("nodes=2,procs_per_node=2,link=1gbit,burst=1b", "--emulate burst must be >= 2kb"),
    ("nodes=2;procs_per_node=2", "--emulate must be comma-separated KEY=VALUE items"),
    ("nodes=300,procs_per_node=1,link=1gbit", "--emulate nodes must be an integer <= 254"),
])
def test_spec_errors_say_what_rule_and_value(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        EmulateSpec.parse(text)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_cli_rejects_a_bad_spec_and_conflicting_flags_in_one_line() -> None:
    bad = run_cli("bench", "--emulate", "nodes=1,procs_per_node=2,link=1gbit", timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "torsh-tune: error: --emulate nodes must be an integer >= 2, but got 1"
    both = run_cli("profile", "--emulate", SPEC, "--nnodes", "2", str(EXAMPLES / "ddp_mlp.py"), timeout=60)
    assert both.returncode == 2
    assert both.stderr.strip().startswith("torsh-tune: error: --emulate must be used without --nnodes")


# -- without root or iproute2 ---------------------------------------------------------------------
def test_without_root_the_command_fails_cleanly_and_creates_nothing(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torsh_tune.cli", "bench", "--emulate", SPEC, "--runs-dir", str(tmp_path / "runs")]
    uid = os.geteuid()
    if uid == 0:  # a real unprivileged process
        tmp_path.chmod(0o777)
        uid = 65534
        cmd = ["setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups", *cmd]
    before = set(owned_namespaces())
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2, done.stderr
    assert done.stderr == ("torsh-tune: error: --emulate must run as root (it creates network namespaces), "
                           f"but the effective uid is {uid}\n")
    assert not (tmp_path / "runs").exists()
    assert set(owned_namespaces()) == before


@can_emulate
def test_without_iproute2_the_command_fails_cleanly(tmp_path: Path) -> None:
    env = {"PATH": str(Path(sys.executable).parent)}  # the interpreter, but no ip/tc
    done = run_cli("bench", "--emulate", SPEC, "--runs-dir", str(tmp_path / "runs"), env=env, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == "torsh-tune: error: --emulate needs iproute2 (ip and tc on PATH), but ip, tc are missing"
    assert not (tmp_path / "runs").exists()


# -- real clusters -----------------------------------------------------------------------------------
def _bench_run(runs: Path) -> Path:
    (run,) = [p for p in runs.iterdir() if p.is_dir()]
    return run


@pytest.fixture(scope="module")
def bench_2x2(tmp_path_factory) -> tuple[int, str, Path]:
    """(pid, output, runs dir) of one `bench --emulate` on 2 x 2 (shared by the bench and profile tests)."""
    runs = tmp_path_factory.mktemp("bench2x2") / "runs"
    proc = subprocess.Popen([sys.executable, "-m", "torsh_tune.cli", "bench", "--emulate", SPEC,
                             "--collectives", "all_reduce", "--min-bytes", str(256 << 10), "--max-bytes", str(1 << 20),
                             "--iters", "3", "--warmup", "1", "--runs-dir", str(runs)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return proc.pid, out, runs


@can_emulate
def test_bench_all_reduce_on_2x2_crosses_the_shaped_link_and_tears_down(bench_2x2) -> None:
    pid, out, runs = bench_2x2
    assert _ours(pid) == []
    bench = json.loads((_bench_run(runs) / "bench.json").read_text())
    assert bench["world_size"] == 4 and bench["nnodes"] == 2
    assert bench["topology"]["ranks_per_node"] == {"emulated-node0": 2, "emulated-node1": 2}
    link = {f["name"]: f for f in bench["topology"]["facts"]}["inter_node_link"]
    assert link["value"] == "emulated 1 Gbit/s"
    inter = {r["size_bytes"]: r for r in bench["rows"] if r["level"] == "inter" and r["status"] == "ok"}
    intra = {r["size_bytes"]: r for r in bench["rows"] if r["level"] == "intra" and r["status"] == "ok"}
    # The link holds the inter-node ring to its rate (bytes/s; a little over it from the tbf bucket);
    # the same all-reduce inside one node, over loopback, is not held to it.
    # (On 2 busy cores loopback can be slow too; it only has to beat the link's cap, or on a host slow
    # enough to keep loopback near the cap, beat what the link carried by 15 %: one suite run here
    # measured loopback's best at 0.155 GB/s against a 0.156 cap.)
    # Loopback's rate at 1 MiB is taken from its fastest iteration (of 3): one iteration stalled by the busy host
    # made a row's mean fall below the link's (0.137 against 0.141 GB/s, twice); through the link even the fastest
    # 1 MiB iteration is held to its rate (its tbf bucket holds 256 KiB).
    cap = 1.25 * LINK_GBPS / 8
    assert inter[1 << 20]["busbw_gbps"] < cap
    row = intra[1 << 20]
    fastest = row["busbw_gbps"] * row["time_s"] / row["time_min_s"]
    assert fastest > min(cap, 1.15 * inter[1 << 20]["busbw_gbps"]), (intra, inter)
    info = json.loads((_bench_run(runs) / "run.json").read_text())
    assert info["emulated"]["nodes"] == 2 and info["emulated"]["link_gbps"] == LINK_GBPS
    assert "topology: 2 node(s)" in out and "inter-node emulated 1 Gbit/s" in out


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:200]
    except psutil.NoSuchProcess:
        return f"{pid} (gone)"


def _long_bench(runs: Path, *, stderr: int) -> subprocess.Popen[str]:
    """A bench on the emulated cluster that would run for minutes (it is stopped early)."""
    return subprocess.Popen([sys.executable, "-m", "torsh_tune.cli", "bench", "--emulate", SPEC,
                             "--collectives", "all_reduce", "--min-bytes", str(4 << 20), "--max-bytes", str(4 << 20),
                             "--iters", "200", "--warmup", "1", "--runs-dir", str(runs)],
                            stdout=subprocess.DEVNULL, stderr=stderr, text=True, preexec_fn=sigint_as_ctrl_c)


def _started(runs: Path, marker: str, count: int) -> str | None:
    """The bench's run id once `count` of its processes have `marker` in their command line."""
    infos = list(runs.glob("*/run.json"))
    if not infos:
        return None
    run_id = json.loads(infos[0].read_text())["run_id"]
    found = 0
    for pid in run_survivors(run_id):
        try:
            found += any(marker in arg for arg in psutil.Process(pid).cmdline())
        except psutil.NoSuchProcess:
            pass
    return run_id if found >= count else None


@can_emulate
def test_sigkill_of_the_bench_leaves_no_process_and_the_next_start_removes_its_namespaces(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    proc = _long_bench(runs, stderr=subprocess.DEVNULL)
    try:
        run_id = _wait_for(lambda: _started(runs, "_worker.py", 4), 60, "the 4 ranks on the emulated nodes")
    finally:
        proc.kill()
        proc.wait()
    # The killed owner could not clean up: its namespaces stay ...
    assert sorted(n for n, pid in owned_namespaces().items() if pid == proc.pid) == [f"tt{proc.pid}n0", f"tt{proc.pid}n1"]
    # ... but its processes die with it (parent-death signals along supervisor -> fan-out -> agents -> ranks).
    # 90 s: on a loaded 2-core host the chain's last ranks have taken longer than 30 s once (CI).
    try:
        _wait_for(lambda: run_survivors(run_id) == [], 90, "the killed bench's processes to exit")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {'; '.join(_cmdline(pid) for pid in run_survivors(run_id))}") from None
    with EmulatedCluster(EmulateSpec.parse(SPEC)) as cluster:
        assert sorted(cluster.stale_removed) == [f"tt{proc.pid}n0", f"tt{proc.pid}n1"]
        assert sorted(owned_namespaces()) == [f"tt{os.getpid()}n0", f"tt{os.getpid()}n1"]
    assert _ours(proc.pid) == [] and _ours(os.getpid()) == []


@can_emulate
def test_ctrl_c_tears_the_cluster_down(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    proc = _long_bench(runs, stderr=subprocess.PIPE)
    try:
        run_id = _wait_for(lambda: _started(runs, "torch.distributed.run", 2), 60, "a torchrun agent on each node")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode != 0, err
    assert run_survivors(run_id) == []
    assert _ours(proc.pid) == []


@can_emulate
def test_a_failing_node_stops_every_node(tmp_path: Path) -> None:
    script = tmp_path / "fail_on_node1.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        if int(os.environ["RANK"]) == 1:
            sys.exit(3)
        time.sleep(60)
    """))
    config = RunConfig(budget=BudgetConfig(kill_grace_s=2.0, timeout_s=50.0), profiler=ProfilerConfig(enabled=False))
    with EmulatedCluster(EmulateSpec.parse("nodes=2,procs_per_node=1,link=1gbit")) as cluster:
        rd = new_run_dir(tmp_path / "runs", script)
        lines: list[str] = []
        outcome = launch_run(cluster.configure(config), rd, script, [], echo=lines.append)
    assert (outcome.status, outcome.message) == ("script_error", "rank 1 exited with status 3")
    assert outcome.duration_s < 30, "the healthy node must be stopped, not left to sleep or time out"
    assert run_survivors(json.loads(rd.run_json.read_text())["run_id"]) == []
    assert _ours(os.getpid()) == []


@can_emulate
@pytest.mark.skipif(faketime_library() is None, reason="needs Debian's faketime (libfaketime)")
def test_profile_of_ddp_mlp_on_two_emulated_nodes(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    # Node 1's clock 20 ms ahead of node 0's and gaining 1 ms per second: read as recorded, node 1's ranks would
    # arrive 20-40 ms late at every step.
    done = run_cli("profile", "--emulate", SPEC + ",clock_skew=20ms,clock_drift=1000", "--steps", "10",
                   "--warmup-steps", "2", "--runs-dir", str(runs), "--run-name", "emu", str(EXAMPLES / "ddp_mlp.py"),
                   "--hidden", "512", timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = runs / "emu"
    metas = [json.loads(p.read_text()) for p in sorted((run / "ranks").glob("*meta.json"))]
    assert sorted(m["hostname"] for m in metas) == ["emulated-node0", "emulated-node0", "emulated-node1", "emulated-node1"]
    info = json.loads((run / "run.json").read_text())
    assert info["nnodes"] == 2 and info["emulated"]["procs_per_node"] == 2
    assert info["reference_busbw_gbps"] == pytest.approx(LINK_GBPS / 8) and info["reference_source"] == "emulated"
    report = json.loads((run / "report" / "report.json").read_text())
    inputs = {i["name"]: i for i in report["strategy_advice"][0]["inputs"]}
    assert (inputs["nnodes"]["value"], inputs["link_gbps"]["value"], inputs["link_gbps"]["source"]) == (2, LINK_GBPS, "detected")
    categories = {b["category"] for b in report["bottlenecks"]}
    assert categories & {"network", "communication"}, categories
    assert "emulated cluster: 2 nodes x 2 rank(s), 1 Gbit/s links" in done.stdout
    # Node 1's leader measured its clock against rank 0's at start-up and again at the end (ping-pong over the
    # emulated link): 20 ms plus the drift so far, and 1 ms more per second between the two.
    (start, end) = [(m["clock_sync"], m["clock_sync_end"]) for m in metas if m["rank"] == 2][0]
    assert 0.020 <= start["ahead_s"] < 0.080 and max(start["rtt_s"], end["rtt_s"]) < 0.005, (start, end)
    gained = (end["ahead_s"] - start["ahead_s"]) / (end["t"] - start["t"])
    assert gained == pytest.approx(1e-3, abs=(start["rtt_s"] + end["rtt_s"]) / (end["t"] - start["t"]) + 1e-5)
    assert metas[0]["clock_sync"] == metas[0]["clock_sync_end"] == {"answered": [1], "failed": {}}
    assert not any("clock_sync" in m for m in metas if m["local_rank"] != 0)
    # The analysis followed the line through them, checked it against the all-reduces' completions and read the
    # ranks on node 0's clock.
    (clock,) = report["stragglers"]["host_clocks"]
    assert (clock["host"], clock["reference"], clock["applied"]) == ("emulated-node1", "emulated-node0", True), clock
    assert (clock["source"], clock["offset_s"], clock["disagree"]) == ("exchange", start["ahead_s"], False), clock
    assert clock["drift_ppm"] == pytest.approx(gained * 1e6)
    assert start["ahead_s"] - 0.005 < clock["collectives_offset_s"] < end["ahead_s"] + 0.005, clock
    # Read as recorded, node 1's ranks would arrive >= 20 ms after node 0's; on one clock they are apart by what
    # 4 ranks sharing 2 cores (and libfaketime's own cost in node 1's clock reads) leave: 4.3 ms in one run.
    late = {r["rank"]: r["lateness_s"] for r in report["stragglers"]["per_rank"]}
    assert (late[2] + late[3]) / 2 - (late[0] + late[1]) / 2 < 0.012, report["stragglers"]


@can_emulate
def test_profile_against_a_bench_of_the_same_cluster_shows_busbw_beside_its_model(bench_2x2, tmp_path: Path) -> None:
    _, _, bench_runs = bench_2x2
    runs = tmp_path / "runs"
    done = run_cli("profile", "--emulate", SPEC, "--reference-bench", str(_bench_run(bench_runs)), "--steps", "4",
                   "--warmup-steps", "2", "--runs-dir", str(runs), "--run-name", "emu",
                   str(EXAMPLES / "ddp_mlp.py"), "--hidden", "512", timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = runs / "emu"
    report = json.loads((run / "report" / "report.json").read_text())
    inputs = {i["name"]: i for i in report["strategy_advice"][0]["inputs"]}
    assert (inputs["nnodes"]["value"], inputs["link_gbps"]["source"]) == (2, "measured")  # the bench, not the tbf rate
    # Topology: the nodes' facts in their local rank 0's meta.json, the layout in the report.
    metas = {json.loads(p.read_text())["rank"]: json.loads(p.read_text()) for p in (run / "ranks").glob("*meta.json")}
    assert {r for r, m in metas.items() if "node_facts" in m} == {0, 2}
    assert "(2 node(s) × 2)" in (run / "report" / "report.md").read_text()
    html = (run / "report" / "report.html").read_text()
    assert 'id="figure-busbw_model"' in html and "Bus bandwidth per bucket: measured vs bench model" in html
    categories = {b["category"]: b for b in report["bottlenecks"]}
    assert categories.keys() & {"network", "communication"}, categories
    gains = [r["expected_gain"] for r in report["recommendations"] if r["category"] in ("network", "communication")]
    assert gains and all(g["high_pct"] > 0 for g in gains)  # quantified


@can_emulate
def test_three_nodes_meet_on_a_bridge_with_both_ends_of_every_link_shaped() -> None:
    spec = EmulateSpec.parse("nodes=3,procs_per_node=1,link=100mbit")
    with EmulatedCluster(spec) as cluster:
        assert cluster.switch == f"tt{os.getpid()}sw"
        ends = [(ns, NODE_IFNAME) for ns in cluster.namespaces] + [(cluster.switch, f"p{i}") for i in range(3)]
        for ns, dev in ends:
            qdisc = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
            assert "tbf" in qdisc and "rate 100Mbit" in qdisc, (ns, dev, qdisc)
        # node 2 reaches node 0 across the bridge, by the name the hosts file gives it
        probe = "import socket; s = socket.create_connection(('emulated-node0', 9), timeout=2)"
        done = subprocess.run(["ip", "netns", "exec", cluster.namespaces[2], sys.executable, "-c", probe],
                              capture_output=True, text=True, timeout=30)
        assert "ConnectionRefusedError" in done.stderr, done.stderr  # a RST from node 0: routed, nothing listens
    assert _ours(os.getpid()) == []
