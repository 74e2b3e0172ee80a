"""Write the hand-built analysis fixtures under tests/data/<scenario>/ (deterministic).

    .venv/bin/python tests/analysis/make_fixtures.py

Each scenario simulates a DDP timeline per rank (data, forward, backward with bucketed
all-reduces that start when every rank has issued them and run one after another,
optimizer) and writes records exactly as `torsh_tune.records` defines them. The files are
committed; tests read them and never regenerate them. Keep each scenario under 50 KB.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from torsh_tune.config import BudgetConfig, LaunchConfig, RunConfig
from torsh_tune.records import CommRecord, StepRecord, SystemRecord

DATA = Path(__file__).resolve().parents[1] / "data"
T0 = 1_760_000_000.0
MiB = 1024 * 1024
GiB = 1024 * MiB


@dataclass
class Scenario:
    name: str
    world_size: int = 2
    steps: int = 12
    warmup: int = 2
    data_s: float = 0.002
    forward_s: float = 0.030
    backward_s: float = 0.060  # compute only
    optimizer_s: float = 0.005
    other_s: float = 0.001
    buckets: int = 3
    bucket_bytes: int = 1 * MiB
    transfer_s: float = 0.004  # per bucket on the wire
    extra_forward_s: dict[int, float] = field(default_factory=dict)  # rank -> added compute (straggler)
    jitter: float = 0.02  # relative noise
    rss_bytes: int = 600 * MiB
    mem_total_bytes: int = 16 * GiB
    cpu_count: int = 8
    num_workers: int = 0
    seed: int = 0


SCENARIOS = [
    Scenario(name="healthy"),
    Scenario(name="data_bound", data_s=0.045),
    Scenario(name="comm_bound", forward_s=0.010, backward_s=0.024, bucket_bytes=4 * MiB, transfer_s=0.025),
    Scenario(name="straggler", world_size=4, steps=10, buckets=2, extra_forward_s={2: 0.050}),
]


def r6(x: float) -> float:
    return round(x, 6)


def simulate(sc: Scenario) -> tuple[dict[int, list], dict[int, list], dict[int, list]]:
    rng = random.Random(sc.seed)
    noisy = lambda v: v * (1.0 + rng.uniform(-sc.jitter, sc.jitter))  # noqa: E731
    steps: dict[int, list] = {r: [] for r in range(sc.world_size)}
    comm: dict[int, list] = {r: [] for r in range(sc.world_size)}
    t_start = {r: T0 + 0.0002 * r for r in range(sc.world_size)}
    prev_complete = {r: 0.0 for r in range(sc.world_size)}
    seq = 0
    for s in range(sc.steps):
        ranks = range(sc.world_size)
        d = {r: noisy(sc.data_s) for r in ranks}
        f = {r: noisy(sc.forward_s) + sc.extra_forward_s.get(r, 0.0) for r in ranks}
        b = {r: noisy(sc.backward_s) for r in ranks}
        bwd_start = {r: t_start[r] + d[r] + f[r] for r in ranks}
        bwd_end = {r: bwd_start[r] + b[r] for r in ranks}
        ready = {r: [bwd_start[r] + b[r] * (k + 1) / sc.buckets for k in range(sc.buckets)] for r in ranks}
        done_prev = max(prev_complete.values())
        completes = []
        for k in range(sc.buckets):
            # The collective starts when every rank has issued it and the previous one is done.
            start = max(max(ready[r][k] for r in ranks), done_prev)
            done_prev = start + noisy(sc.transfer_s)
            completes.append(done_prev)
            for r in ranks:
                t_c = done_prev + 0.00002 * r
                comm[r].append(CommRecord(
                    rank=r, step=s, seq=seq, bucket=k, collective="all_reduce", hook="allreduce",
                    bytes=sc.bucket_bytes, wire_bytes=sc.bucket_bytes, num_tensors=4,
                    t_issue=r6(ready[r][k]), t_complete=r6(t_c), duration_s=r6(t_c - ready[r][k]),
                ))
            seq += 1
        for r in ranks:
            prev_complete[r] = completes[-1]
            intervals = [(ready[r][k], completes[k]) for k in range(sc.buckets)]
            comm_s = _union(intervals)
            exposed = max(0.0, completes[-1] - bwd_end[r])
            o, other = noisy(sc.optimizer_s), noisy(sc.other_s)
            t_end = bwd_end[r] + exposed + o + other
            steps[r].append(StepRecord(
                rank=r, step=s, t_start=r6(t_start[r]), t_end=r6(t_end), step_s=r6(t_end - t_start[r]),
                data_s=r6(d[r]), forward_s=r6(f[r]), backward_s=r6(b[r] + exposed), optimizer_s=r6(o),
                comm_s=r6(comm_s), exposed_comm_s=r6(exposed), samples=32, tokens=None, num_microbatches=1,
                loss=round(2.0 - 0.05 * s, 4) if s % 5 == 0 else None,
                peak_mem_bytes=sc.rss_bytes + 1000 * s, warmup=s < sc.warmup,
            ))
            t_start[r] = t_end
    end = max(st[-1].t_end for st in steps.values())
    system = {r: [SystemRecord(
        rank=r, t=r6(T0 + i * 1.0), cpu_pct=round(95.0 + r, 1), sys_cpu_pct=round(40.0 + i, 1),
        rss_bytes=sc.rss_bytes, mem_total_bytes=sc.mem_total_bytes, gpu_util_pct=None,
        gpu_mem_used_bytes=None, gpu_mem_total_bytes=None, gpu_power_w=None,
        pcie_tx_bytes_per_s=None, pcie_rx_bytes_per_s=None,
    ) for i in range(int(end - T0) + 1)] for r in range(sc.world_size)}
    return steps, comm, system


def _union(intervals: list[tuple[float, float]]) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for a, b in sorted(intervals):
        if cur_end is None or a > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    return total + (cur_end - cur_start if cur_end is not None else 0.0)


def write_jsonl(path: Path, records: list) -> None:
    path.write_text("".join(json.dumps(asdict(rec), separators=(",", ":")) + "\n" for rec in records))


def write_run(sc: Scenario, *, status: str = "ok", exits: dict[int, str | None] | None = None) -> Path:
    root = DATA / sc.name
    shutil.rmtree(root, ignore_errors=True)
    (root / "ranks").mkdir(parents=True)
    config = RunConfig(
        launch=LaunchConfig(nproc_per_node=sc.world_size, backend="gloo"),
        budget=BudgetConfig(steps=sc.steps - sc.warmup, warmup_steps=sc.warmup),
    ).to_dict()
    config["strategy"]["dataloader"]["num_workers"] = sc.num_workers
    (root / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    # The subset of launch.runinfo's run.json that analysis reads.
    info = {"name": sc.name, "status": status, "outcome": {"status": status}, "cpu_count": sc.cpu_count,
            "mem_total_bytes": sc.mem_total_bytes, "world_size": sc.world_size, "nnodes": 1,
            "nproc_per_node": sc.world_size, "hostname": "node0"}
    if sc.name == "comm_bound":  # as if a `torsh-tune bench` of this fabric had measured it
        info["reference_busbw_gbps"] = 1.0
    (root / "run.json").write_text(json.dumps(info, indent=1))
    steps, comm, system = simulate(sc)
    param_bytes = sc.buckets * sc.bucket_bytes
    for r in range(sc.world_size):
        write_jsonl(root / f"ranks/rank{r:05d}.steps.jsonl", steps[r])
        write_jsonl(root / f"ranks/rank{r:05d}.comm.jsonl", comm[r])
        write_jsonl(root / f"ranks/rank{r:05d}.system.jsonl", system[r])
        meta = {"backend": "gloo", "device": "cpu", "hostname": "node0", "local_rank": r,
                "world_size": sc.world_size,
                "ddp": {"bucket_cap_mb": 25.0, "num_buckets": sc.buckets,
                        "bucket_sizes_bytes": [sc.bucket_bytes] * sc.buckets, "num_params": 12,
                        "param_bytes": param_bytes, "gradient_as_bucket_view": False, "static_graph": False,
                        "find_unused_parameters": False, "comm_hook": None},
                "ddp_logging": {"avg_backward_comm_time": int(sc.transfer_s * sc.buckets * 1e9),
                                "avg_backward_compute_time": int(sc.backward_s * 1e9)}}
        (root / f"ranks/rank{r:05d}.meta.json").write_text(json.dumps(meta, indent=1))
        exit_status = (exits or {}).get(r, "budget")
        if exit_status is not None:
            (root / f"ranks/rank{r:05d}.exit.json").write_text(json.dumps({
                "rank": r, "status": exit_status, "error_type": "RuntimeError" if exit_status == "error" else None,
                "message": "boom" if exit_status == "error" else "", "traceback": None,
                "t_exit": steps[r][-1].t_end + 0.01, "steps_done": len(steps[r])}))
    return root


def tear(path: Path, keep_chars: int = 40) -> None:
    """Cut the file's last line after `keep_chars` characters, as a crash mid-write does."""
    text = path.read_text()
    body, last = text.rstrip("\n").rsplit("\n", 1)
    path.write_text(body + "\n" + last[:keep_chars])


def main() -> None:
    for sc in SCENARIOS:
        write_run(sc)
    root = write_run(Scenario(name="torn_line", seed=1))
    tear(root / "ranks/rank00001.steps.jsonl")
    tear(root / "ranks/rank00000.comm.jsonl")
    # Crashed: rank 1 raised at step 2, rank 0 was killed (no exit.json); only warm-up steps recorded.
    root = write_run(Scenario(name="crashed", steps=3, warmup=5, seed=2), status="script_error", exits={0: None, 1: "error"})
    tear(root / "ranks/rank00001.steps.jsonl", keep_chars=70)
    for name in [sc.name for sc in SCENARIOS] + ["torn_line", "crashed"]:
        sc_dir = DATA / name
        size = sum(p.stat().st_size for p in sc_dir.rglob("*") if p.is_file())
        print(f"{name}: {size / 1024:.1f} KB")


if __name__ == "__main__":
    main()
