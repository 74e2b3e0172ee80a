"""Trace analyzer: HTA parity on real NCCL traces, gloo comm pairing, parser edge cases."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from torsh_tune.analysis.traces import (
    CommPatterns,
    SymbolTable,
    analyze_traces,
    load_traces,
    normalize_collective,
)
from torsh_tune.analysis.traces._intervals import merge, overlap, total
from torsh_tune.errors import TorshTuneError

DATA = Path(__file__).resolve().parents[2] / "data" / "traces"

# HTA 0.5.0's TraceAnalysis on the same files (tests/data/traces/README.md):
# (trace, rank, idle %, compute %, non-compute %, comp/comm overlap %).
HTA = [
    ("hta-sampled-2rank", 0, 53.56, 17.71, 28.74, 11.81),
    ("hta-sampled-2rank", 1, 54.72, 22.57, 22.72, 20.05),
    ("hta-16rank-rank0", 0, 69.44, 14.15, 16.41, 1.37),
    ("hta-nccl-2rank-rank0", 0, 77.78, 17.26, 4.97, 14.31),
]


@pytest.fixture(scope="module")
def loaded():
    return {name: load_traces(DATA / name) for name in {h[0] for h in HTA} | {"gloo-ddp-2rank"}}


@pytest.mark.parametrize("hta_rounding", [True, False])
@pytest.mark.parametrize("trace,rank,idle,compute,non_compute,overlap_pct", HTA)
def test_temporal_breakdown_and_overlap_match_hta(loaded, trace, rank, idle, compute, non_compute,
                                                  overlap_pct, hta_rounding):
    a = analyze_traces(loaded[trace], hta_rounding=hta_rounding)
    b = a.breakdown.set_index("rank").loc[rank]
    o = a.overlap.set_index("rank").loc[rank]
    # With HTA's whole-µs rounding the numbers agree to its printed precision; without
    # it (our default: exact sub-µs times) they stay within 0.6 pp, the documented
    # difference on the one trace with ns timestamps (hta-nccl-2rank-rank0).
    tol = 0.01 if hta_rounding else 0.6
    assert b["device"] == "gpu"
    assert b["idle_pct"] == pytest.approx(idle, abs=tol)
    assert b["compute_pct"] == pytest.approx(compute, abs=tol)
    assert b["non_compute_pct"] == pytest.approx(non_compute, abs=tol)
    assert o["overlap_pct"] == pytest.approx(overlap_pct, abs=tol)
    assert b["idle_pct"] + b["compute_pct"] + b["non_compute_pct"] == pytest.approx(100.0)


def test_rank_and_process_groups_come_from_distributed_info(loaded):
    ts = loaded["hta-nccl-2rank-rank0"]
    rt = ts.ranks[0]
    assert rt.rank_source == "distributedInfo"
    assert rt.backend == "nccl" and rt.world_size == 2
    assert rt.process_groups[0]["ranks"] == [0, 1]
    names = set(ts.names(0).dropna())
    assert any(n.startswith("ncclKernel_AllReduce") for n in names)


def test_nccl_collectives_have_kind_size_and_bandwidth(loaded):
    a = analyze_traces(loaded["hta-nccl-2rank-rank0"])
    c = a.collectives
    assert set(c["collective"]) == {"all_reduce", "broadcast"}
    ar = c[c["collective"] == "all_reduce"]
    # kernel args: In msg nelems x Float
    assert (ar["size_bytes"] == ar["numel"] * 4).all()
    assert (ar["busbw_gbps"] > 0).all()
    # one rank only: no cross-rank wait, transfer = own duration
    assert c["wait_s"].isna().all()
    assert np.allclose(c["transfer_s"], c["dur_us"] / 1e6)


def test_ncclDevKernel_names_count_as_communication(tmp_path):
    """NCCL >= 2.19 renamed kernels; the default patterns must still see them."""
    src = json.loads(gzip.open(DATA / "hta-nccl-2rank-rank0" / "rank-0.json.gz").read())
    for ev in src["traceEvents"]:
        if ev.get("name", "").startswith("ncclKernel_"):
            ev["name"] = ev["name"].replace("ncclKernel_", "ncclDevKernel_", 1)
    (tmp_path / "rank-0.json").write_text(json.dumps(src))
    renamed = analyze_traces(tmp_path)
    original = analyze_traces(DATA / "hta-nccl-2rank-rank0")
    assert renamed.overlap["overlap_pct"].iloc[0] == pytest.approx(original.overlap["overlap_pct"].iloc[0])
    assert len(renamed.collectives) == len(original.collectives) > 0
    # A pattern list without the new spelling finds none: the list is what decides.
    old_only = analyze_traces(tmp_path, patterns=CommPatterns(nccl_kernels=(r"ncclKernel_",)))
    assert len(old_only.collectives) == 0


def test_gloo_c10d_ops_pair_with_worker_spans(loaded):
    a = analyze_traces(loaded["gloo-ddp-2rank"])
    c = a.collectives
    assert (c["backend"] == "gloo").all()
    assert a.breakdown["device"].eq("cpu").all()
    for rank in (0, 1):
        mine = c[c["rank"] == rank]
        # 2 profiled steps x (2 DDP buckets + all_gather + all_reduce on the side group)
        assert len(mine) == 8
        assert mine["issue_us"].notna().all(), "every worker span paired with its c10d op"
        assert (mine["start_us"] >= mine["issue_us"]).all()
        counts = mine["collective"].value_counts().to_dict()
        assert counts == {"all_reduce": 6, "all_gather": 2}
        # sizes from Input Dims x dtype: float32 all_gather of 4096 elements, side all_reduce 8192
        ag = mine[mine["collective"] == "all_gather"]
        assert (ag["size_bytes"] == 4096 * 4).all()
        assert (mine["size_bytes"] == mine["numel"] * 4).all()
    # every collective matched across both ranks
    assert (c["ranks_seen"] == 2).all()
    assert (c["transfer_s"] <= c["dur_us"] / 1e6 + 1e-12).all()
    assert (c["wait_s"] >= 0).all()
    # rank 1 sleeps before the extra collectives: it is the straggler
    s = a.stragglers.set_index("rank")
    assert s.loc[1, "times_last"] > s.loc[0, "times_last"]
    assert a.summary["straggler_rank"] == 1
    o = a.overlap.set_index("rank")
    assert ((o["overlap_pct"] >= 0) & (o["overlap_pct"] <= 100)).all()
    assert (o["exposed_comm_s"] <= o["comm_s"]).all()


def test_steps_and_counterfactuals(loaded):
    a = analyze_traces(loaded["gloo-ddp-2rank"])
    assert sorted(a.steps["step"].unique()) == [2, 3]
    s = a.summary
    assert s["what_if_step_s"] > 0
    assert s["what_if_if_comm_fully_overlapped_s"] <= s["what_if_step_s"]
    assert s["what_if_if_slowest_rank_at_median_s"] <= s["what_if_step_s"]
    json.dumps(s)  # plain JSON types


def test_each_steps_exposed_comm_adds_up_to_the_windows():
    # torch.compile(DDP) on 2 cores: rank 0's training thread waits for collectives inside AccumulateGrad
    # evaluations (8 ms of the window): the per-step table and the window's overlap must both count those
    # waits as exposed communication, not as the enclosing operator's compute (they differed by 8 ms).
    a = analyze_traces(load_traces(DATA / "gloo-compiled-ddp-2rank"))
    per_step = a.steps.groupby("rank")["exposed_comm_s"].sum()
    overlap = {int(r["rank"]): r for r in a.tables["overlap"].rows()}
    for rank, row in overlap.items():
        assert per_step[rank] == pytest.approx(row["exposed_comm_s"], rel=1e-9)
    assert overlap[0]["exposed_comm_s"] > 0.03


def test_top_kernels_sorted_and_named(loaded):
    a = analyze_traces(loaded["hta-sampled-2rank"], top_limit=5)
    tk = a.top_kernels
    assert set(tk["rank"]) == {0, 1}
    for _, g in tk.groupby("rank"):
        assert len(g) == 5
        assert g["total_s"].is_monotonic_decreasing
    assert set(tk["kind"]) <= {"computation", "communication", "memory"}


def test_rank_from_file_name_when_distributed_info_is_absent(tmp_path):
    for r in (0, 3):
        doc = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": 'aten::mm "quoted" {x}', "pid": 1,
                                "tid": 1, "ts": 10.0 + r, "dur": 2.5, "args": {"note": "a\\\"b}"}}]}
        (tmp_path / f"host_rank-{r}.json").write_text(json.dumps(doc))
    ts = load_traces(tmp_path)
    assert sorted(ts.ranks) == [0, 3]
    assert ts.ranks[3].rank_source == "file name"
    assert ts.names(3).tolist() == ['aten::mm "quoted" {x}']
    a = analyze_traces(ts)
    assert a.breakdown["device"].eq("cpu").all()
    assert a.collectives.empty


@pytest.mark.parametrize("case", ["missing", "empty_dir", "not_json", "no_events", "truncated_gzip",
                                  "truncated_json"])
def test_clear_one_line_errors(tmp_path, case):
    src = (DATA / "hta-sampled-2rank" / "rank-0.json.gz").read_bytes()
    target = tmp_path / "t"
    target.mkdir()
    if case == "missing":
        target = tmp_path / "nope"
    elif case == "not_json":
        (target / "notes.json").write_text("not a trace\n")
    elif case == "no_events":
        (target / "x.json").write_text(json.dumps({"schemaVersion": 1, "other": [1, 2]}))
    elif case == "truncated_gzip":
        (target / "rank-0.json.gz").write_bytes(src[: len(src) // 2])
    elif case == "truncated_json":
        (target / "rank-0.json").write_bytes(gzip.decompress(src)[:500_000])
    with pytest.raises(TorshTuneError) as err:
        load_traces(target)
    msg = str(err.value)
    assert "\n" not in msg and " must be " in msg
    if case == "truncated_gzip":
        assert "truncated" in msg


def test_intervals_and_symbols():
    s, e = merge(np.array([5.0, 0.0, 1.0, 10.0]), np.array([6.0, 2.0, 3.0, 11.0]))
    assert s.tolist() == [0.0, 5.0, 10.0] and e.tolist() == [3.0, 6.0, 11.0]
    assert total(np.array([0.0, 1.0]), np.array([2.0, 3.0])) == 3.0
    assert overlap((np.array([0.0]), np.array([4.0])), (np.array([1.0, 3.0]), np.array([2.0, 10.0]))) == 2.0
    t = SymbolTable()
    assert t.intern("x") == 0 and t.intern("y") == 1 and t.id_of("x") == 0 and t.id_of("q") == -1
    assert t.ids_matching(r"^y").tolist() == [1]
    assert [normalize_collective(n) for n in ("AllReduce", "c10d::allgather_", "gloo:all_reduce",
                                              "c10d::_reduce_scatter_base_", "SendRecv")] == [
        "all_reduce", "all_gather", "all_reduce", "reduce_scatter", "send_recv"]
