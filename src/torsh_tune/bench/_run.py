"""The bench sweep: launch it on ranks, read its results back, fit and record the model."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import BudgetConfig, LaunchConfig, ProfilerConfig, RunConfig
from ..errors import BenchError, invalid
from ..fabric import (
    ALLREDUCE_ALGORITHMS,
    MODEL_FILE,
    CommModel,
    Fact,
    Topology,
    fit_model,
    predict_allreduce_s,
    reference_busbw_gbps,
    save_model,
)
from ..rundir import RunDir, new_run_dir, write_json_atomic

if TYPE_CHECKING:
    from ..launch.emulate import EmulatedCluster

__all__ = [
    "BenchResult",
    "COLLECTIVES",
    "DEFAULT_SIZES_BYTES",
    "WORKER_SCRIPT",
    "load_bench",
    "run_bench",
    "size_range",
]

#: The script every rank runs (an ordinary script, launched through the bootstrap).
WORKER_SCRIPT = Path(__file__).with_name("_worker.py")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


def size_range(min_bytes: int = 4 << 10, max_bytes: int = 256 << 20, factor: int = 4) -> tuple[int, ...]:
    """Message sizes min, min*factor, ... <= max (nccl-tests' -b/-e/-f).

    Example:
        >>> size_range(4096, 65536, 4)
        (4096, 16384, 65536)
    """
    if min_bytes < 4 or max_bytes < min_bytes:
        raise invalid("bench sizes", "4 <= min_bytes <= max_bytes", (min_bytes, max_bytes))
    if factor < 2:
        raise invalid("bench size factor", ">= 2", factor)
    sizes, s = [], int(min_bytes)
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    return tuple(sizes)


#: 4 KiB -> 256 MiB in x4 steps.
DEFAULT_SIZES_BYTES = size_range()


@dataclass(frozen=True, kw_only=True)
class BenchResult:
    """What a bench run measured and the model fitted to it.

    Attributes:
        run_dir: the bench's run directory.
        status: the launch outcome's status ("ok" when the sweep completed).
        rows: one dict per (collective, level, size): see `_worker.CSV_COLUMNS`.
        memcopy_gbps: median over ranks of the device memory-copy rate (bytes copied / s).
        model: the fitted alpha-beta model.
        reference_busbw_gbps: the widest level's best all-reduce busbw at large sizes (see
            `reference_busbw_gbps`).
        paths: bench.json, bench.csv, bench_model.json.
        meta: the rest of bench.json (backend, world_size, nnodes, hosts, iters, ...).
        topology: nodes, ranks per node and hardware facts, with the measured bandwidths
            added as "measured" facts; None for a bench.json without one.
    """

    run_dir: Path
    status: str
    rows: tuple[dict[str, Any], ...]
    memcopy_gbps: float | None
    model: CommModel
    reference_busbw_gbps: float | None
    paths: dict[str, Path] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    topology: Topology | None = None

    @property
    def inter_node_link(self) -> str | None:
        """The topology's inter-node link fact, e.g. "emulated 1 Gbit/s"; None when unknown or one node."""
        if self.topology is None:
            return None
        fact = {f.name: f for f in self.topology.facts}.get("inter_node_link")
        return None if fact is None or fact.value is None else str(fact.value)

    def predictions(self) -> list[dict[str, Any]]:
        """Each measured all-reduce size beside the model's per-algorithm predictions (seconds)."""
        out = []
        # An emulated node has one link (a veth): its ranks' shard all-reduces share it.
        node_links = 1 if str(self.inter_node_link or "").startswith("emulated") else None
        for row in self.rows:
            if row["collective"] != "all_reduce" or row["status"] != "ok":
                continue
            fit = self.model.get("all_reduce", row["level"])
            entry = {"level": row["level"], "size_bytes": row["size_bytes"], "measured_s": row["time_s"],
                     "fit_s": None if fit is None else fit.predict_s(row["size_bytes"])}
            for algo in ALLREDUCE_ALGORITHMS:
                entry[f"{algo}_s"] = predict_allreduce_s(self.model, row["size_bytes"], algorithm=algo,
                                                         node_links=node_links)
            out.append(entry)
        return out


def load_bench(run_dir: str | os.PathLike[str], *, status: str = "ok") -> BenchResult:
    """Read a finished bench run directory (bench.json) and fit its model (saved as bench_model.json)."""
    rd = RunDir(run_dir)
    path = rd.path / "bench.json"
    if not path.is_file():
        raise BenchError(f"bench results must exist at {path}, but the run ({status}) wrote none")
    doc = json.loads(path.read_text())
    model = fit_model(doc)
    model_path = save_model(model, rd.path)
    rows = tuple(doc.get("rows", ()))
    meta = {k: v for k, v in doc.items() if k not in ("rows",)}
    reference = reference_busbw_gbps(doc)
    memcopy = (doc.get("memcopy") or {}).get("copy_gbps")
    topology = None
    if doc.get("topology"):
        base = Topology.from_dict(doc["topology"])
        measured = (
            Fact(name="reference_busbw_gbps", value=reference, source="measured",
                 detail="all_reduce busbw at large messages (bench)"),
            Fact(name="memcopy_gbps", value=memcopy, source="measured", detail="tensor copy_ per rank (bench)"),
        )
        topology = replace(base, facts=base.facts + measured)
    return BenchResult(
        run_dir=rd.path, status=status, rows=rows,
        memcopy_gbps=memcopy, model=model, reference_busbw_gbps=reference,
        paths={"json": path, "csv": rd.path / "bench.csv", "model": model_path}, meta=meta, topology=topology,
    )


def run_bench(
    *,
    nproc_per_node: int = 2,
    sizes: Sequence[int] | None = None,
    collectives: Sequence[str] | None = None,
    iters: int = 20,
    warmup: int = 5,
    max_time_per_size_s: float = 1.0,
    runs_dir: str | os.PathLike[str] = "runs",
    backend: str = "auto",
    nnodes: int = 1,
    timeout_s: float | None = 600.0,
    run_name: str | None = None,
    echo: Callable[[str], None] | None = None,
    argv: Sequence[str] | None = None,
    cluster: EmulatedCluster | None = None,
) -> BenchResult:
    """Sweep the collectives over message sizes on `nproc_per_node` ranks and fit the model.

    Args:
        nproc_per_node: Ranks per node.
        sizes: Message sizes in bytes (default `DEFAULT_SIZES_BYTES`, 4 KiB -> 256 MiB x4).
        collectives: Subset of `COLLECTIVES` (default: all).
        iters: Timed iterations per size.
        warmup: Untimed iterations per size.
        max_time_per_size_s: Fewer timed iterations (but >= 3) for sizes whose warm-up says
            `iters` would take longer than this; the row's `iters` says how many ran.
        runs_dir: Where the bench's run directory is created.
        backend: "auto", "gloo" or "nccl".
        nnodes: Nodes (> 1 needs a rendezvous; the lead's launch config handles it).
        timeout_s: Wall-clock limit of the whole bench.
        run_name: Name of the run directory (default: generated).
        echo: Receives the ranks' output lines (default: print).
        argv: The command line, recorded in run.json.
        cluster: An emulated cluster that is up (`torsh_tune.launch.emulate`): the bench runs
            on its nodes and ranks; `nproc_per_node` and `nnodes` are then ignored.

    Returns:
        The `BenchResult` (rows, model, reference busbw, file paths).

    Raises:
        ConfigError: Invalid arguments.
        BenchError: The launch failed or wrote no results.

    Example:
        >>> result = run_bench(nproc_per_node=2, sizes=size_range(4096, 1 << 20), iters=5)  # doctest: +SKIP
        >>> result.reference_busbw_gbps  # doctest: +SKIP
        1.3
    """
    from ..launch import launch_run  # the launcher is only needed to run, not to read results

    sizes = tuple(int(s) for s in (sizes if sizes is not None else DEFAULT_SIZES_BYTES))
    names = tuple(collectives) if collectives is not None else COLLECTIVES
    unknown = [c for c in names if c not in COLLECTIVES]
    if unknown:
        raise invalid("bench collectives", f"a subset of {', '.join(COLLECTIVES)}", ",".join(unknown))
    if not sizes or min(sizes) < 4:
        raise invalid("bench sizes", "a non-empty list of sizes >= 4 bytes", sizes)
    if iters < 1 or warmup < 0:
        raise invalid("bench iters/warmup", "iters >= 1 and warmup >= 0", (iters, warmup))
    config = RunConfig(
        launch=LaunchConfig(nproc_per_node=nproc_per_node, nnodes=nnodes, backend=backend),
        budget=BudgetConfig(timeout_s=timeout_s),
        profiler=ProfilerConfig(enabled=False),
    )
    if cluster is not None:
        config = cluster.configure(config)
    run_dir = new_run_dir(runs_dir, "bench", name=run_name)
    args = ["--sizes", ",".join(map(str, sizes)), "--collectives", ",".join(names),
            "--iters", str(iters), "--warmup", str(warmup), "--max-time-per-size-s", str(max_time_per_size_s)]
    outcome = launch_run(config, run_dir, WORKER_SCRIPT, args, argv=argv, echo=echo)
    if outcome.status != "ok" or not (run_dir.path / "bench.json").is_file():
        raise BenchError(f"bench run must finish with results, but it ended {outcome.status}: {outcome.message} "
                         f"(logs in {run_dir.logs})")
    result = load_bench(run_dir.path, status=outcome.status)
    _record_reference(run_dir, result)
    return result


def _record_reference(run_dir: RunDir, result: BenchResult) -> None:
    # The bench's own run.json carries the measured reference, so any later run can point
    # at a bench run and read "reference_busbw_gbps" from the same place analysis does.
    if result.reference_busbw_gbps is None or not run_dir.run_json.is_file():
        return
    info = json.loads(run_dir.run_json.read_text())
    info["reference_busbw_gbps"] = result.reference_busbw_gbps
    info["memcopy_gbps"] = result.memcopy_gbps
    info["bench_model"] = MODEL_FILE
    if result.topology is not None:
        info["topology"] = result.topology.to_dict()
    write_json_atomic(run_dir.run_json, info)
