"""A real 2-rank gloo sweep through the launcher, checked against an independent timing."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from torsh_tune.bench import COLLECTIVES, BenchError, load_bench, render_bench_table, run_bench, size_range
from torsh_tune.errors import ConfigError

HERE = Path(__file__).resolve().parent
SIZES = size_range(4 << 10, 1 << 20, 4)  # 4 KiB .. 1 MiB


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    return run_bench(nproc_per_node=2, sizes=SIZES, iters=60, warmup=3, runs_dir=runs, timeout_s=120,
                     echo=lambda line: None)


def test_sweep_writes_rows_files_and_model(bench):
    assert bench.status == "ok"
    assert bench.meta["backend"] == "gloo" and bench.meta["world_size"] == 2
    assert bench.meta["timing"]["clock"] == "host (perf_counter)"
    keys = {(r["collective"], r["size_bytes"]) for r in bench.rows}
    assert keys == {(c, s) for c in COLLECTIVES for s in SIZES}
    ok = [r for r in bench.rows if r["status"] == "ok"]
    # gloo in this torch supports all five; were one unsupported it would say so, not be timed.
    assert {r["collective"] for r in ok} == set(COLLECTIVES)
    for r in ok:
        assert 0 < r["time_min_s"] <= r["time_p25_s"] <= r["time_p75_s"] <= r["time_max_s"]
        # time_s is the per-iteration mean of the slowest rank's back-to-back loop, whose
        # iterations the min/quartiles/max describe (a mean can lie outside the quartiles).
        assert r["time_min_s"] <= r["time_s"] <= r["time_max_s"]
        assert r["algbw_gbps"] == pytest.approx(r["size_bytes"] / r["time_s"] / 1e9)
    ar = [r for r in ok if r["collective"] == "all_reduce"]
    assert all(r["busbw_gbps"] > 0 for r in ar)
    ag = next(r for r in ok if r["collective"] == "all_gather")
    assert ag["busbw_gbps"] == pytest.approx(ag["algbw_gbps"] * 0.5)  # (n-1)/n at n=2
    with bench.paths["csv"].open() as f:
        assert len(list(csv.DictReader(f))) == len(bench.rows)
    assert bench.memcopy_gbps and bench.memcopy_gbps > 0
    assert {f.collective for f in bench.model.fits} == set(COLLECTIVES)
    assert bench.paths["model"].is_file()
    run_json = json.loads((bench.run_dir / "run.json").read_text())
    assert run_json["reference_busbw_gbps"] == pytest.approx(bench.reference_busbw_gbps)
    assert run_json["status"] == "ok"
    again = load_bench(bench.run_dir)
    assert again.model == bench.model


def test_table_renders(bench):
    console = Console(record=True, width=150)
    render_bench_table(bench, console)
    text = console.export_text()
    assert "all_reduce (intra, 2 ranks, gloo)" in text and "1 MiB" in text and "memory-copy ceiling" in text
    preds = bench.predictions()
    assert len(preds) == len(SIZES) and all(p["ring_s"] > 0 and p["tree_s"] > 0 for p in preds)


@pytest.mark.parametrize("size", [256 << 10, 1 << 20])
def test_all_reduce_time_matches_an_independent_timing(bench, size, tmp_path):
    out = tmp_path / "single.json"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    str(HERE / "single_allreduce.py"), str(size), "60", str(out)],
                   check=True, capture_output=True, timeout=120)
    independent_s = json.loads(out.read_text())["min_s"]
    measured_s = next(r["time_min_s"] for r in bench.rows if r["collective"] == "all_reduce" and r["size_bytes"] == size)
    # Two ranks share two cores with everything else on this box: small-message medians are
    # bimodal (0.5 ms or 4 ms, seen 8x apart between two runs), so the fastest iteration of
    # each — the physical lower bound — is compared. A generous 3x still catches a wrong
    # size, a missing barrier or a per-iteration time summed over ranks. The independent timing takes the
    # fastest of 60, and so does the bench (15 missed every fast moment, once on each side: 0.67 ms independent
    # against the bench's 0.21 ms, ratio 0.32; the bench's 1.38 ms against 0.45 ms, ratio 3.08).
    ratio = measured_s / independent_s
    assert 1 / 3 <= ratio <= 3, (measured_s, independent_s)


def test_bad_arguments_fail_before_launching(tmp_path):
    with pytest.raises(ConfigError, match="collectives"):
        run_bench(nproc_per_node=2, collectives=["all_reduce", "gossip"], runs_dir=tmp_path)
    with pytest.raises(ConfigError, match="sizes"):
        run_bench(nproc_per_node=2, sizes=[], runs_dir=tmp_path)
    assert not any(tmp_path.iterdir())
    with pytest.raises(BenchError):
        load_bench(tmp_path)


def test_topology_is_recorded(bench):
    topo = bench.topology
    assert topo is not None and topo.nnodes == 1 and sum(topo.ranks_per_node.values()) == 2
    facts = {f.name: f for f in topo.facts}
    assert facts["reference_busbw_gbps"].source == "measured"
    assert facts["reference_busbw_gbps"].value == bench.reference_busbw_gbps
    run_json = json.loads((bench.run_dir / "run.json").read_text())
    assert run_json["topology"]["nnodes"] == 1
