"""Strategy advice for a recorded run: the advisor's ranked candidates from this run's facts.

`torsh_tune.strategies.advisor.advise` ranks DDP / FSDP / HSDP / pipeline (+ compression)
from the model size, device memory, world size, node count and link speed. Here those
inputs come from the run itself, each labelled by how it is known (the labels of
`fabric.Fact`):

- ``measured``: counted or timed in this run (parameters from meta.json, the link from a
  `torsh-tune bench` reference recorded in run.json);
- ``detected``: read from the hardware or the launch (NVML, host memory, hostnames);
- ``assumed``: a default the run cannot show (Adam's 8 bytes of optimizer state per
  parameter, the learning rate tuned for this run's batch, an unknown link).

Every row also says whether it is the strategy this run used (`current`), so a report can
say "you run X; the advisor ranks Y first".
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from ..strategies.advisor import advice_table, advise  # pure Python: imports neither torch nor optuna
from ._runinfo import dig

__all__ = ["strategy_advice"]

_ADAM_BYTES_PER_PARAM = 8  # two fp32 moments


def strategy_advice(
    meta: dict[int, dict[str, Any]],
    info: dict[str, Any],
    system: pd.DataFrame,
    world_size: int,
    *,
    config: dict[str, Any] | None = None,
    warnings: list[str] | None = None,
) -> tuple[dict[str, Any], ...]:
    """The advisor's candidates for the model and cluster of this run.

    Args:
        meta: rank -> meta.json (`ddp.num_params`, `strategy`, `hostname`, `device`).
        info: run.json (`reference_busbw_gbps` from a bench run, `mem_total_bytes`, `nnodes`).
        system: the system records (`gpu_mem_total_bytes`, `mem_total_bytes` per rank).
        world_size: ranks in the run.
        config: config.json (the run's `strategy.kind`, compression, collectives).
        warnings: receives why there is no advice, when there is none.

    Returns:
        `advisor.advice_table` rows, best first, each with two more keys: `current` (True
        for the candidate this run used) and `inputs` (the same list in every row: `name`,
        `value`, `source` measured/detected/assumed, `detail`). Empty when the parameter
        count is unknown or the ranks are spread unevenly over the hosts.

    Example:
        >>> frames = load_run("torsh-runs/my-run")  # doctest: +SKIP
        >>> rows = strategy_advice(frames.meta, frames.info, frames.system, frames.world_size,
        ...                        config=frames.config)  # doctest: +SKIP
        >>> rows[0]["name"], [r["name"] for r in rows if r["current"]]  # doctest: +SKIP
        ('ddp', ['ddp'])
    """
    notes = warnings if warnings is not None else []
    config = config or {}
    params = _num_params(meta)
    if params is None:
        notes.append("strategy advice unavailable: the model's parameter count is unknown (no DDP model, "
                      "torsh_tune.parallelize call or optimizer step recorded in meta.json)")
        return ()
    num_params, param_bytes, params_detail = params
    nnodes, nnodes_source, nnodes_detail = _nnodes(meta, info)
    if world_size < 1 or world_size % nnodes:
        notes.append(f"strategy advice unavailable: {world_size} ranks do not divide evenly over {nnodes} hosts")
        return ()
    gpus = _gpus(meta, system)
    memory, memory_detail = _device_memory(meta, info, system, gpus=gpus)
    link_gbps, link_source, link_detail = _link_gbps(info, meta if nnodes > 1 else {})
    bytes_per_param, bytes_source, bytes_detail = _bytes_per_param(num_params, param_bytes)
    run_name, run_detail, run_keys = _run_strategy(meta, config, info)

    inputs = [
        _input("num_params", num_params, "measured", params_detail),
        _input("param_bytes_per_param", bytes_per_param, bytes_source, bytes_detail),
        _input("optimizer_bytes_per_param", _ADAM_BYTES_PER_PARAM, "assumed",
               "Adam's two fp32 moments (SGD with momentum holds 4, plain SGD 0)"),
        _input("device_memory_bytes", memory, "detected" if memory is not None else "assumed", memory_detail),
        _input("gpus", gpus, "detected", "meta.json device / NVML records"),
        _input("world_size", world_size, "detected", "ranks of the run"),
        _input("nnodes", nnodes, nnodes_source, nnodes_detail),
        _input("link_gbps", link_gbps, link_source, link_detail),
        _input("reference_world_size", world_size, "assumed",
               "the learning rate is taken as tuned for this run's global batch (no LR scaling advised)"),
        _input("strategy", run_name, "detected" if run_name else "assumed", run_detail),
    ]
    candidates = advise(
        num_params=num_params, param_bytes_per_param=bytes_per_param, device_memory_bytes=memory,
        world_size=world_size, nnodes=nnodes, link_gbps=link_gbps, gpus=gpus,
        optimizer_bytes_per_param=_ADAM_BYTES_PER_PARAM, reference_world_size=world_size,
    )
    rows = advice_table(candidates)
    current = _current_index(rows, run_keys)
    return tuple({**row, "current": i == current, "inputs": [dict(x) for x in inputs]} for i, row in enumerate(rows))


def _input(name: str, value: Any, source: str, detail: str) -> dict[str, Any]:
    return {"name": name, "value": value, "source": source, "detail": detail}


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _num_params(meta: dict[int, dict[str, Any]]) -> tuple[int, int | None, str] | None:
    """(parameters, their bytes or None, where from) of the lowest rank that recorded them."""
    for rank in sorted(meta):
        m = meta[rank]
        models = [d for d in (m.get("ddp_models") or []) if isinstance(d, dict) and _int(d.get("num_params"))]
        if len(models) > 1:  # every DDP model trains: their states add up
            n = sum(d["num_params"] for d in models)
            nbytes = [_int(d.get("param_bytes")) for d in models]
            return n, sum(nbytes) if all(nbytes) else None, (
                f"rank {rank} meta.json: trainable parameters of {len(models)} DDP models")
        n = _int(dig(m, "ddp", "num_params"))
        if n:
            return n, _int(dig(m, "ddp", "param_bytes")), (
                f"rank {rank} meta.json ddp.num_params: trainable parameters of the DDP model")
        n = _int(dig(m, "strategy", "num_params"))
        if n:
            return n, _int(dig(m, "strategy", "param_bytes")), (
                f"rank {rank} meta.json strategy.num_params: the model handed to torsh_tune.parallelize")
        n = _int(dig(m, "strategy", "fsdp", "num_params"))
        if n:
            return n, None, f"rank {rank} meta.json strategy.fsdp.num_params: the unsharded model"
        n = _int(dig(m, "pipeline", "num_params"))
        if n:
            return n, _int(dig(m, "pipeline", "param_bytes")), f"rank {rank} meta.json pipeline.num_params"
    for rank in sorted(meta):  # no DDP model or parallelize call: what the script's optimizer steps
        n = _int(dig(meta[rank], "trained", "num_params"))
        if n:
            whole = " (sharded DTensors counted whole)" if dig(meta[rank], "trained", "sharded") else ""
            return n, _int(dig(meta[rank], "trained", "param_bytes")), (
                f"rank {rank} meta.json trained.num_params: the parameters the script's optimizer steps{whole}")
    return None


def _bytes_per_param(num_params: int, param_bytes: int | None) -> tuple[int, str, str]:
    if param_bytes:
        per = param_bytes / num_params
        nearest = min((1, 2, 4, 8), key=lambda b: abs(b - per))
        if abs(nearest - per) < 0.05 * nearest:
            return nearest, "measured", f"{param_bytes:,} parameter bytes / {num_params:,} parameters"
        return 4, "assumed", f"mixed dtypes ({per:.2f} B per parameter): fp32 assumed"
    return 4, "assumed", "fp32 parameters (their bytes were not recorded)"


def _nnodes(meta: dict[int, dict[str, Any]], info: dict[str, Any]) -> tuple[int, str, str]:
    hosts = {str(m["hostname"]) for m in meta.values() if isinstance(m.get("hostname"), str) and m["hostname"]}
    if hosts:
        names = sorted(hosts)
        shown = ", ".join(names[:4]) + (f", … ({len(names) - 4} more)" if len(names) > 4 else "")
        return len(hosts), "detected", f"distinct hostnames in the ranks' meta.json ({shown})"
    for value, where in ((info.get("nnodes"), "run.json nnodes"),
                         (dig(info, "config", "launch", "nnodes"), "run.json launch.nnodes")):
        if _int(value):
            return int(value), "detected", where
    return 1, "assumed", "no hostnames recorded: one node assumed"


def _gpus(meta: dict[int, dict[str, Any]], system: pd.DataFrame) -> bool:
    if any(str(m.get("device", "")).startswith("cuda") for m in meta.values()):
        return True
    return bool(_max_by_rank(system, "gpu_mem_total_bytes"))


def _device_memory(meta: dict[int, dict[str, Any]], info: dict[str, Any], system: pd.DataFrame, *,
                   gpus: bool) -> tuple[int | None, str]:
    """Memory one rank may hold its model state in: its GPU, or its share of the host's RAM."""
    if gpus:
        totals = _max_by_rank(system, "gpu_mem_total_bytes")
        if totals:
            return min(totals.values()), "smallest GPU's total memory (NVML system records)"
        return None, "no NVML memory records: the advisor cannot tell what fits"
    host_of = {r: str(m.get("hostname") or "localhost") for r, m in meta.items()}
    ranks_on: dict[str, int] = {}
    for host in host_of.values():
        ranks_on[host] = ranks_on.get(host, 0) + 1
    host_total: dict[str, int] = {}
    for rank, total in _max_by_rank(system, "mem_total_bytes").items():
        if rank in host_of:
            host_total[host_of[rank]] = max(host_total.get(host_of[rank], 0), total)
    shares = {h: total // ranks_on[h] for h, total in host_total.items()}
    if shares:
        host = min(shares, key=shares.__getitem__)
        return shares[host], f"host memory of {host} / its {ranks_on[host]} rank(s) (system records)"
    host_mem = _int(info.get("mem_total_bytes"))
    if host_mem and ranks_on:
        n = max(ranks_on.values())
        return host_mem // n, f"run.json host memory / {n} rank(s) per host"
    return None, "no host memory recorded: the advisor cannot tell what fits"


def _link_gbps(info: dict[str, Any], meta: dict[int, dict[str, Any]]) -> tuple[float | None, str, str]:
    """The inter-node link: a bench reference (measured), else the nodes' NIC line rate (detected), else unknown."""
    ref = info.get("reference_busbw_gbps")
    if isinstance(ref, (int, float)) and not isinstance(ref, bool) and ref > 0:
        if info.get("reference_source") == "emulated":  # `--emulate` without --reference-bench
            return float(ref) * 8, "detected", "the emulated link's configured rate (tc tbf, --emulate)"
        return float(ref) * 8, "measured", (f"all-reduce bus bandwidth {ref:g} GB/s × 8 from the bench run "
                                            f"{info.get('reference_bench') or '(--reference-bench)'}")
    nic = _nic_line_rate_gbps(meta)
    if nic is not None:
        return nic
    return None, "assumed", ("no bench reference in run.json (profile with --reference-bench BENCH_RUN): the advisor "
                             "advises no gradient compression without a link speed")


def _nic_line_rate_gbps(meta: dict[int, dict[str, Any]]) -> tuple[float, str, str] | None:
    """The slowest node's fastest link (InfiniBand port rate, else physical NIC speed), from meta.json `node_facts`.

    One local-rank-0 meta per node carries `node_facts` (`fabric.detect_node`). A line
    rate, not what collectives reach: `--reference-bench` measures that.
    """
    per_host: dict[str, tuple[float, str]] = {}
    for m in meta.values():
        facts, host = m.get("node_facts"), m.get("hostname")
        if not isinstance(facts, list) or not isinstance(host, str):
            continue
        best: tuple[float, str] | None = None
        for f in facts:
            name, value, detail = str(f.get("name", "")), f.get("value"), str(f.get("detail", ""))
            gbps = None
            if name.startswith("infiniband.") and isinstance(value, dict) and "ACTIVE" in str(value.get("state")):
                head = str(value.get("rate") or "").split()
                gbps = float(head[0]) if head and head[0].replace(".", "", 1).isdigit() else None
                what = f"InfiniBand {name.split('.', 1)[1]}"
            elif name.startswith("nic.") and isinstance(value, int) and value > 0 and "physical" in detail \
                    and "operstate=up" in detail:
                gbps, what = value / 1000.0, f"NIC {name.split('.')[1]}"
            if gbps and (best is None or gbps > best[0]):
                best = (gbps, what)
        if best is not None:
            per_host[host] = best
    hosts = {str(m.get("hostname")) for m in meta.values() if m.get("hostname")}
    if not per_host or set(per_host) != hosts:
        return None  # a node without facts could be the slow one
    host, (gbps, what) = min(per_host.items(), key=lambda kv: kv[1][0])
    return gbps, "detected", (f"line rate of {what} on {host} (slowest of the {len(per_host)} nodes' fastest links, "
                              "sysfs); a line rate, not a measurement: --reference-bench measures the fabric")


def _max_by_rank(df: pd.DataFrame, col: str) -> dict[int, int]:
    if df is None or df.empty or col not in df.columns:
        return {}
    v = pd.to_numeric(df[col], errors="coerce").groupby(df["rank"]).max().dropna()
    return {int(r): int(x) for r, x in v.items() if x > 0}


# -- the run's own strategy ---------------------------------------------------------------

_DEFAULTS = {"compression": "none", "hierarchical": False, "reshard_after_forward": True, "cpu_offload": False}


def _run_strategy(meta: dict[int, dict[str, Any]], config: dict[str, Any],
                  info: dict[str, Any]) -> tuple[str | None, str, dict[str, Any]]:
    """(label like the advisor's names, where from, the keys a candidate must match)."""
    strategies = [config.get("strategy"), dig(info, "config", "strategy")]
    cfg = next((s for s in strategies if isinstance(s, dict)), {})
    api = next((m["strategy"] for _, m in sorted(meta.items()) if isinstance(m.get("strategy"), dict)), None)
    if api is not None and isinstance(api.get("kind"), str):
        kind, where = api["kind"], "meta.json strategy.kind (torsh_tune.parallelize)"
    elif any(isinstance(m.get("ddp"), dict) for m in meta.values()):
        kind, where = "ddp", "a DDP model in meta.json"
    elif any(dig(m, "trained", "sharded") and dig(m, "collectives", "fsdp") for m in meta.values()):
        # FSDP2 applied by the script: its sharding options are not recorded; fully_shard's default
        # (reshard after forward) is taken.
        kind, where = "fsdp", "sharded parameters and FSDP's collectives in meta.json (fully_shard by the script)"
    elif isinstance(cfg.get("kind"), str) and cfg["kind"] != "ddp":
        # What the config asked parallelize for, in a run that recorded no call (it failed first). Its
        # "ddp", the default, says nothing: a script without DDP (a hand-written all-reduce) runs none.
        kind, where = cfg["kind"], "config.json strategy.kind"
    else:
        return None, "no strategy recorded", {}
    keys: dict[str, Any] = {"kind": kind}
    if kind == "ddp":
        keys["compression"] = dig(cfg, "compression", "method") or "none"
        keys["hierarchical"] = bool(dig(cfg, "collectives", "hierarchical"))
        name = ("ddp + hierarchical all-reduce" if keys["hierarchical"] else
                "ddp" if keys["compression"] == "none" else f"ddp + {keys['compression']} compression")
    elif kind in ("fsdp", "hsdp"):
        fsdp = (api or {}).get("fsdp") if isinstance((api or {}).get("fsdp"), dict) else cfg.get("fsdp") or {}
        # An int (reshard to a smaller group) still reshards: the full-shard family.
        keys["reshard_after_forward"] = fsdp.get("reshard_after_forward") is not False
        keys["cpu_offload"] = bool(fsdp.get("cpu_offload"))
        name = kind if kind == "hsdp" else f"fsdp {'full' if keys['reshard_after_forward'] else 'grad-op'} shard"
        if keys["cpu_offload"]:
            name += " + cpu offload"
    else:
        name = kind
    return name, where, keys


def _current_index(rows: list[dict[str, Any]], run: dict[str, Any]) -> int | None:
    """The row whose strategy is the run's: same kind and the same comm hook / sharding choices."""
    if not run:
        return None
    for i, row in enumerate(rows):
        if row.get("kind") != run["kind"]:
            continue
        patch = row.get("config_patch") or {}
        cand = {
            "compression": dig(patch, "compression", "method") or _DEFAULTS["compression"],
            "hierarchical": bool(dig(patch, "collectives", "hierarchical")),
            "reshard_after_forward": dig(patch, "fsdp", "reshard_after_forward") is not False,
            "cpu_offload": bool(dig(patch, "fsdp", "cpu_offload")),
        }
        if all(cand[k] == v for k, v in run.items() if k != "kind"):
            return i
    return None
