"""A run directory with planted alert conditions, written record by record as the ranks write them.

2 ranks on GPUs, one system sample a second per rank, a step every 0.5 s (5 warm-up):

- rank 1's GPU utilisation 15 % for 40 s from t = 30 s: low_gpu_utilization, critical;
- rank 0's GPU utilisation 30 % for 5 s from t = 100 s: shorter than the 10 s duration, no alert;
- rank 0's GPU memory at 97 % of 80 GiB for 15 s from t = 80 s: memory_pressure, critical;
- exposed communication 40 % of the step on both ranks for steps 150-189 (20 s): a warning;
- step 200 takes 4x the median step on rank 0: step_time_spike, a warning.
"""

from __future__ import annotations

import json
from pathlib import Path

from torsh_tune.records import columns_of

T0 = 1_790_000_000.0
GiB = 1 << 30
STEP_S = 0.5
NUM_STEPS = 240
WARMUP = 5
LOW_GPU = (1, 30.0, 70.0)  # rank, from, to (s)
SHORT_DIP = (0, 100.0, 105.0)
MEM_PRESSURE = (0, 80.0, 95.0)
COMM_STEPS = (150, 189)
SPIKE_STEP = 200


def write_planted_run(root: Path) -> Path:
    """Write the planted run into `root` (created) and return it."""
    (root / "ranks").mkdir(parents=True)
    info = {"name": root.name, "status": "ok", "outcome": {"status": "ok"}, "world_size": 2, "nnodes": 1,
            "nproc_per_node": 2, "hostname": "node0", "script": "examples/planted_alerts.py",
            "config": {"strategy": {"kind": "ddp"}}}
    (root / "run.json").write_text(json.dumps(info))
    (root / "config.json").write_text(json.dumps({"launch": {"nproc_per_node": 2}}))
    for rank in (0, 1):
        steps, t = [], T0
        for k in range(NUM_STEPS):
            step_s = STEP_S * (4.0 if k == SPIKE_STEP and rank == 0 else 1.0)
            exposed = (0.4 if COMM_STEPS[0] <= k <= COMM_STEPS[1] else 0.1) * step_s
            steps.append(_record(
                "steps", rank=rank, step=k, t_start=t, t_end=t + step_s, step_s=step_s, data_s=0.01, forward_s=0.1,
                backward_s=0.2 + exposed, optimizer_s=0.02, comm_s=exposed * 1.5, exposed_comm_s=exposed, samples=32,
                num_microbatches=1, loss=None, peak_mem_bytes=40 * GiB, warmup=k < WARMUP))
            t += STEP_S if k != SPIKE_STEP else 4 * STEP_S  # every rank waits for the slow one
        system = []
        for i in range(int(t - T0) + 1):
            util = 90.0
            for r, a, b in (LOW_GPU, SHORT_DIP):
                if r == rank and a <= i < b:
                    util = 15.0 if (r, a, b) == LOW_GPU else 30.0
            r, a, b = MEM_PRESSURE
            used = (0.97 if r == rank and a <= i < b else 0.6) * 80 * GiB
            system.append(_record(
                "system", rank=rank, t=T0 + i + 0.5, cpu_pct=100.0, sys_cpu_pct=50.0, rss_bytes=4 * GiB,
                mem_total_bytes=512 * GiB, gpu_util_pct=util, gpu_mem_used_bytes=int(used),
                gpu_mem_total_bytes=80 * GiB, gpu_power_w=300.0, pcie_tx_bytes_per_s=None, pcie_rx_bytes_per_s=None))
        for kind, records in (("steps", steps), ("system", system)):
            with open(root / "ranks" / f"rank{rank:05d}.{kind}.jsonl", "w") as f:
                f.writelines(json.dumps(rec) + "\n" for rec in records)
        (root / "ranks" / f"rank{rank:05d}.meta.json").write_text(json.dumps(
            {"backend": "nccl", "device": f"cuda:{rank}", "hostname": "node0", "world_size": 2}))
        (root / "ranks" / f"rank{rank:05d}.exit.json").write_text(json.dumps({"rank": rank, "status": "budget"}))
    return root


def _record(kind: str, **values: object) -> dict[str, object]:
    """A record with exactly the schema's columns (those the scenario does not set are null)."""
    return {col: values.get(col) for col in columns_of(kind)}
