"""Step time and bytes on the wire of every strategy and compression method on one workload.

One torchrun launch (gloo) trains `examples/api_strategies.py`'s residual-MLP model through
`torsh_tune.parallelize` / `train_step` under each configuration in turn; the
configurations are interleaved (round r runs every configuration once) and each round
times `--steps` steps after `--warmup` steps of a freshly built model. Step time is the
slowest rank's; the table shows the median over rounds with its min-max spread.

Bytes on the wire are counted by the kernel: the launch runs in a network namespace of its
own (root: `ip netns`), so the `lo` transmit counter of that namespace counts exactly the
bytes every rank sent (TCP/IP headers included) and nothing else. Without root the host's
`lo` counter is used and other traffic leaks in (the JSON says which). The payload column
is what the compression hooks handed to their collectives (their own count).

    .venv/bin/python benchmarks/strategies.py --rounds 5 --steps 20

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: (label, strategy patch) — every configuration of the issue's list that runs on 2 ranks.
CONFIGS: list[tuple[str, dict]] = [
    ("ddp", {}),
    ("ddp bucket 1 MiB", {"ddp": {"bucket_cap_mb": 1.0}}),
    ("ddp fp16", {"compression": {"method": "fp16"}}),
    ("ddp bf16", {"compression": {"method": "bf16"}}),
    ("ddp int8", {"compression": {"method": "int8"}}),
    ("ddp topk 1%", {"compression": {"method": "topk", "ratio": 0.01}}),
    ("ddp powersgd r4", {"compression": {"method": "powersgd", "rank": 4, "start_iter": 2}}),
    ("ddp adaptive", {"compression": {"method": "adaptive", "ratio": 0.01}}),
    ("ddp hierarchical", {"collectives": {"hierarchical": True, "ranks_per_node": 1}}),
    ("fsdp full shard", {"strategy": {"kind": "fsdp"}, "fsdp": {"reshard_after_forward": True}}),
    ("fsdp grad-op", {"strategy": {"kind": "fsdp"}, "fsdp": {"reshard_after_forward": False}}),
    ("pipeline gpipe m4", {"strategy": {"kind": "pipeline"}, "pipeline": {"schedule": "gpipe", "n_microbatches": 4,
                                                           "split_points": ["blocks.2"]}}),
    ("pipeline 1f1b m4", {"strategy": {"kind": "pipeline"}, "pipeline": {"schedule": "1f1b", "n_microbatches": 4,
                                                          "split_points": ["blocks.2"]}}),
]


def _lo_tx_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[8])
    return 0


# -- inside every rank --------------------------------------------------------------------
def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    sys.path.insert(0, str(REPO / "examples"))
    from api_strategies import Net  # noqa: E402 - the example's model, unchanged

    import torsh_tune as tt
    from torsh_tune.config import RunConfig

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    loss_fn = nn.CrossEntropyLoss()
    teacher = nn.Linear(32, 10)

    replica = [rank]  # this rank's data-parallel replica (a pipeline is one replica)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + replica[0])
        x = torch.randn(args.batch, 32, generator=g)
        with torch.no_grad():
            return x, teacher(x).argmax(dim=1)

    results: list[dict] = []
    for rnd in range(args.rounds):
        order = CONFIGS if rnd % 2 == 0 else CONFIGS[::-1]
        for label, patch in order:
            strategy = RunConfig().apply_patch(patch).strategy
            torch.manual_seed(0)
            model = Net(32, args.width, args.depth, 10)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            model, opt = tt.parallelize(model, opt, example_batch=batch(0), loss_fn=loss_fn, config=strategy)
            replica[0] = tt.data_parallel_info(model)[0]
            for s in range(args.warmup):
                tt.train_step(model, opt, batch(s), loss_fn)
            dist.barrier()
            tx0, t0 = _lo_tx_bytes(), time.perf_counter()
            for s in range(args.steps):
                loss = tt.train_step(model, opt, batch(args.warmup + s), loss_fn)
            dist.barrier()
            step_s = (time.perf_counter() - t0) / args.steps
            wire = (_lo_tx_bytes() - tx0) / args.steps
            slowest = torch.tensor([step_s], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            payload = None
            stats = getattr(getattr(model, "_torsh_hook_state", None), "stats", None)
            if stats and stats.get("calls"):
                # Every rank hands the same amount to the collectives: this rank's share times the world.
                payload = stats["wire_bytes"] / stats["calls"] * stats["num_buckets"] * world
            results.append({"round": rnd, "config": label, "step_s": float(slowest), "wire_bytes_per_step": wire,
                            "payload_bytes_per_step": payload, "loss": float(loss)})
            del model, opt
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


# -- driver --------------------------------------------------------------------------------
def _launch(args: argparse.Namespace, out: Path) -> str:
    inner = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
             str(Path(__file__).resolve()), "--worker", "--out", str(out), "--rounds", str(args.rounds),
             "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
             "--width", str(args.width), "--depth", str(args.depth)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    can_netns = os.geteuid() == 0 and shutil.which("ip") is not None
    if not can_netns:
        subprocess.run(inner, check=True, env=env)
        return "host lo (shared: other traffic included)"
    ns = f"ttbench{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "netns", "exec", ns, *inner], check=True, env=env)
    finally:
        subprocess.run(["ip", "netns", "delete", ns], check=False)
    return "lo of a private network namespace (exact)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        counter = _launch(args, out)
        results = json.loads(out.read_text())
    rows = []
    base = None
    for label, _ in CONFIGS:
        rs = [r for r in results if r["config"] == label]
        steps = sorted(r["step_s"] * 1e3 for r in rs)
        wires = [r["wire_bytes_per_step"] / 2**20 for r in rs]
        payloads = [r["payload_bytes_per_step"] / 2**20 for r in rs if r["payload_bytes_per_step"] is not None]
        row = {"config": label, "step_ms_median": statistics.median(steps), "step_ms_min": steps[0],
               "step_ms_max": steps[-1], "wire_mib_per_step": statistics.median(wires),
               "payload_mib_per_step": statistics.median(payloads) if payloads else None,
               "final_loss_median": statistics.median(r["loss"] for r in rs)}
        base = base or row
        row["step_vs_ddp"] = row["step_ms_median"] / base["step_ms_median"]
        row["wire_vs_ddp"] = row["wire_mib_per_step"] / base["wire_mib_per_step"] if base["wire_mib_per_step"] else None
        rows.append(row)
    print(f"{'config':<20} {'step ms (median, min-max)':>27} {'x ddp':>6} {'wire MiB/step':>14} {'x ddp':>6} "
          f"{'hook payload MiB':>17} {'loss':>7}")
    for r in rows:
        payload = f"{r['payload_mib_per_step']:.3f}" if r["payload_mib_per_step"] is not None else "-"
        wire_x = f"{r['wire_vs_ddp']:.3f}" if r["wire_vs_ddp"] is not None else "-"
        print(f"{r['config']:<20} {r['step_ms_median']:9.2f} ({r['step_ms_min']:7.2f}-{r['step_ms_max']:7.2f}) "
              f"{r['step_vs_ddp']:6.2f} {r['wire_mib_per_step']:14.3f} {wire_x:>6} {payload:>17} {r['final_loss_median']:7.4f}")
    print(json.dumps({"benchmark": "strategies", "nproc": args.nproc, "rounds": args.rounds, "steps": args.steps,
                      "batch": args.batch, "width": args.width, "depth": args.depth, "wire_counter": counter,
                      "machine": f"{platform.machine()} {os.cpu_count()} cores", "python": platform.python_version(),
                      "date": time.strftime("%Y-%m-%d"), "rows": rows}))


if __name__ == "__main__":
    main()
