"""What the evaluation probes cost a training forward: a module's hooks, present or taken away.

A wrapper's inner module (DDP's `module`) needs forward hooks to see an evaluation pass that
bypasses the wrapper (the Trainer evaluates the unwrapped model). Any forward hook sends a
module's call through nn.Module's slow path, so the runtime adds them only while the module is
in eval mode (a `Module.train` wrapper adds and removes them). Three arms, each a forward of a
small MLP in train mode under gradients, alternated in blocks in one process:

- bare: no torsh-tune at all;
- hooked: the evaluation hooks registered for good (the first design);
- watched: the module watched for evaluations, after an `eval()` / `train()` round trip (the design).

Cost = median over blocks of (arm - bare) per forward, with the IQR.

    python benchmarks/module_hooks.py [--blocks 30 --forwards 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from torsh_tune.config import RunConfig
from torsh_tune.runtime.context import RankRuntime
from torsh_tune.runtime.patches import _patch_train_mode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=30, help="blocks per arm, alternated")
    p.add_argument("--forwards", type=int, default=2000, help="forwards per block")
    args = p.parse_args()
    torch.set_num_threads(1)
    rt = RankRuntime(RunConfig.from_dict({}), None, env=None)
    _patch_train_mode(rt)

    def mlp() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    bare, hooked, watched = mlp(), mlp(), mlp()
    hooked.register_forward_pre_hook(rt.eval_pre_hook, with_kwargs=True)
    hooked.register_forward_hook(rt.eval_post_hook)
    rt.watch_for_evaluation(watched)
    watched.eval()  # an evaluation pass: the hooks come ...
    assert rt._eval_watched[id(watched)][1] is not None
    watched.train()  # ... and go with it
    assert rt._eval_watched[id(watched)][1] is None
    x = torch.randn(4, 16)
    arms = {"bare": bare, "hooked": hooked, "watched": watched}
    per_forward: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.blocks):
        for name, model in arms.items():
            t0 = time.perf_counter()
            for _ in range(args.forwards):
                model(x)
            per_forward[name].append((time.perf_counter() - t0) / args.forwards)

    def quartiles(values: list[float]) -> tuple[float, float, float]:
        q = statistics.quantiles(values, n=4)
        return q[0], statistics.median(values), q[2]

    out: dict[str, object] = {"benchmark": "module_hooks", "blocks": args.blocks, "forwards": args.forwards,
                              "bare_us": round(1e6 * statistics.median(per_forward["bare"]), 3)}
    print(f"{'arm':<8} {'forward (us)':>13} {'cost vs bare, median (IQR) (us)':>34}")
    print(f"{'bare':<8} {1e6 * statistics.median(per_forward['bare']):>13.2f}")
    for name in ("hooked", "watched"):
        deltas = [a - b for a, b in zip(per_forward[name], per_forward["bare"])]
        low, mid, high = (1e6 * v for v in quartiles(deltas))
        print(f"{name:<8} {1e6 * statistics.median(per_forward[name]):>13.2f} {mid:>+14.2f} ({low:+.2f} … {high:+.2f})")
        out[f"{name}_cost_us"] = {"median": round(mid, 3), "q1": round(low, 3), "q3": round(high, 3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
