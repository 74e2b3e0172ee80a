"""Independent timing of one all_reduce size, with plain torchrun (no torsh-tune runtime).

    torchrun --nproc-per-node 2 single_allreduce.py SIZE_BYTES REPEATS OUT_JSON

Each repeat: barrier, time one all_reduce; the slowest rank's time per repeat; rank 0
writes the median and the minimum to OUT_JSON.
"""

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

size_bytes, repeats, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
buf = torch.ones(size_bytes // 4)
for _ in range(3):  # connection set-up and the first transfers are not part of the timing (the bench warms up 3)
    dist.all_reduce(buf)
times = []
for _ in range(repeats):
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(buf)
    times.append(time.perf_counter() - t0)
slowest = torch.tensor(times, dtype=torch.float64)
dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump({"size_bytes": size_bytes, "time_s": statistics.median(slowest.tolist()),
                   "min_s": min(slowest.tolist())}, f)
dist.destroy_process_group()
