"""Per-rank timelines: which events are GPU kernels of which kind, and the CPU fallback.

Kernel kinds follow HTA's definitions (so the numbers agree with it): communication =
name matches a NCCL kernel pattern, memory = memcpy/memset, computation = the rest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ._model import RankTrace
from ._symbols import SymbolTable

__all__ = ["CommPatterns", "Timeline", "rank_timeline", "step_spans"]

COMPUTATION, COMMUNICATION, MEMORY = 0, 1, 2
KIND_NAMES = ("computation", "communication", "memory")


@dataclass(frozen=True, kw_only=True)
class CommPatterns:
    """Regexes (``re.search``) recognising communication in traces.

    Attributes:
        nccl_kernels: GPU kernel names that are NCCL collectives. Both the pre-2.19
            ``ncclKernel_*`` and the newer ``ncclDevKernel_*`` spellings by default.
        gloo_worker: annotations the gloo ``pt_gloo_runloop`` worker threads record.
        c10d_ops: main-thread c10d operators that issue a collective.
        comm_waits: host operators that block until a collective finishes (idle-time causes).
        syncs: host calls that block until the device is done (idle-time causes).
    """

    nccl_kernels: tuple[str, ...] = (r"ncclKernel", r"ncclDevKernel")
    gloo_worker: str = r"^gloo:"
    c10d_ops: str = r"^c10d::(?!wait|_wait|barrier_wait)"
    comm_waits: str = (r"^(?:wait|aten::wait|c10d::_?wait\w*|c10d::barrier\w*|_c10d_functional::wait_tensor)$"
                       r"|Awaitable wait\(\)|wait_tensors")
    syncs: str = (r"^(?:cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cudaMemcpy"
                  r"|hipStreamSynchronize|hipDeviceSynchronize|aten::item|aten::_local_scalar_dense)$")

    def nccl_regex(self) -> re.Pattern[str]:
        """One regex for all `nccl_kernels` patterns."""
        return re.compile("|".join(f"(?:{p})" for p in self.nccl_kernels))


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """One rank's device timeline as arrays (µs).

    ``device`` is "gpu" when the trace has GPU kernels, else "cpu": then ``kind`` labels
    main-thread operators (computation) and communication comes from gloo worker
    annotations, so the same breakdown/overlap code serves CPU runs. ``launch_us`` (GPU
    only) is when the host launched each kernel (NaN when the launch is not in the trace).
    """

    device: str
    start_us: np.ndarray
    end_us: np.ndarray
    kind: np.ndarray
    name_id: np.ndarray
    window_us: tuple[float, float]
    launch_us: np.ndarray | None = None


def step_spans(events: pd.DataFrame, symbols: SymbolTable) -> pd.DataFrame:
    """``ProfilerStep#N`` spans: columns step, start_us, end_us (sorted by start)."""
    ids = symbols.ids_matching(r"^ProfilerStep#\d+$")
    rows = events[events["name_id"].isin(ids) & events["dur_us"].notna()]
    steps = [int(symbols[i].split("#")[1]) for i in rows["name_id"].tolist()]
    out = pd.DataFrame({"step": steps, "start_us": rows["ts_us"].to_numpy(),
                        "end_us": (rows["ts_us"] + rows["dur_us"]).to_numpy()})
    return out.sort_values("start_us", ignore_index=True)


def _gpu_rows(events: pd.DataFrame, symbols: SymbolTable, exclude_last_step: bool) -> pd.DataFrame:
    """GPU events (stream >= 0 with a launch correlation), HTA's iteration filter applied.

    HTA drops kernels launched at or after the start of the last ProfilerStep (that step
    is usually cut off by the end of the profiling window) when a trace has two or more
    steps; ``exclude_last_step`` does the same so the numbers are comparable.
    """
    gpu_mask = (events["stream"].to_numpy() >= 0) & (events["correlation"].to_numpy() >= 0)
    gpu = events[gpu_mask]
    steps = step_spans(events, symbols)
    if exclude_last_step and steps["step"].nunique() >= 2:
        cpu = events[~gpu_mask]
        launched = cpu.loc[cpu["ts_us"] < steps["start_us"].max(), "correlation"].to_numpy()
        gpu = gpu[np.isin(gpu["correlation"].to_numpy(), launched[launched >= 0])]
    return gpu[gpu["dur_us"].notna()]


def _launch_times(events: pd.DataFrame, correlation: np.ndarray) -> np.ndarray:
    """Start of the host event (cudaLaunchKernel, cudaMemcpyAsync...) sharing each correlation id."""
    host = events[(events["stream"].to_numpy() < 0) & (events["correlation"].to_numpy() >= 0)]
    if host.empty:
        return np.full(correlation.size, np.nan)
    corr = host["correlation"].to_numpy()
    order = np.argsort(corr, kind="stable")
    corr, ts = corr[order], host["ts_us"].to_numpy()[order]
    at = np.minimum(np.searchsorted(corr, correlation), corr.size - 1)
    return np.where(corr[at] == correlation, ts[at], np.nan)


def rank_timeline(trace: RankTrace, symbols: SymbolTable, patterns: CommPatterns, *,
                  exclude_last_step: bool = True, hta_rounding: bool = False) -> Timeline:
    """Build `trace`'s timeline (GPU kernels if any, else the CPU main thread + gloo).

    ``hta_rounding`` reproduces HTA 0.5's handling of sub-µs timestamps (start rounded
    up, end rounded down to whole µs), which shortens every kernel by up to 1 µs; off by
    default because it biases short kernels (see docs in the package README).
    """
    ev = trace.events
    gpu = _gpu_rows(ev, symbols, exclude_last_step)
    if len(gpu):
        comm_ids = symbols.ids_matching(patterns.nccl_regex())
        mem_ids = symbols.ids_matching(r"Memcpy|Memset")
        names = gpu["name_id"].to_numpy()
        kind = np.full(len(gpu), COMPUTATION, dtype=np.int8)
        kind[np.isin(names, mem_ids)] = MEMORY
        kind[np.isin(names, comm_ids)] = COMMUNICATION
        s = gpu["ts_us"].to_numpy()
        e = s + gpu["dur_us"].to_numpy()
        if hta_rounding and np.any(s != np.floor(s)):
            s, e = np.ceil(s), np.floor(e)
        return Timeline(device="gpu", start_us=s, end_us=e, kind=kind, name_id=names,
                        window_us=(float(s.min()), float(e.max())),
                        launch_us=_launch_times(ev, gpu["correlation"].to_numpy()))
    return _cpu_timeline(trace, symbols, patterns)


def main_thread(trace: RankTrace, symbols: SymbolTable) -> int:
    """Tid of the training loop: the one with ProfilerStep spans, else tid == pid, else busiest."""
    ev = trace.events
    steps = ev[ev["name_id"].isin(symbols.ids_matching(r"^ProfilerStep#\d+$"))]
    if len(steps):
        return int(steps["tid"].mode().iloc[0])
    cpu = ev[(ev["stream"] < 0) & ev["dur_us"].notna()]
    same = cpu[cpu["tid"] == cpu["pid"]]
    if len(same):
        return int(same["tid"].mode().iloc[0])
    return int(cpu.groupby("tid")["dur_us"].sum().idxmax()) if len(cpu) else -1


def _cpu_timeline(trace: RankTrace, symbols: SymbolTable, patterns: CommPatterns) -> Timeline:
    ev = trace.events[trace.events["dur_us"].notna()]
    tid = main_thread(trace, symbols)
    cpu_op = symbols.id_of("cpu_op")
    c10d_ids = symbols.ids_matching(patterns.c10d_ops)
    gloo_ids = symbols.ids_matching(patterns.gloo_worker)
    main = ev[(ev["tid"] == tid) & (ev["cat_id"] == cpu_op)]
    is_comm_issue = np.isin(main["name_id"].to_numpy(), c10d_ids)
    worker = ev[np.isin(ev["name_id"].to_numpy(), gloo_ids)]
    s = np.concatenate([main["ts_us"].to_numpy(), worker["ts_us"].to_numpy()])
    e = s + np.concatenate([main["dur_us"].to_numpy(), worker["dur_us"].to_numpy()])
    kind = np.concatenate([np.where(is_comm_issue, COMMUNICATION, COMPUTATION).astype(np.int8),
                           np.full(len(worker), COMMUNICATION, dtype=np.int8)])
    names = np.concatenate([main["name_id"].to_numpy(), worker["name_id"].to_numpy()])
    steps = step_spans(trace.events, symbols)
    if len(steps):
        window = (float(steps["start_us"].min()), float(steps["end_us"].max()))
    elif s.size:
        window = (float(s.min()), float(e.max()))
    else:
        window = (0.0, 0.0)
    return Timeline(device="cpu", start_us=s, end_us=e, kind=kind, name_id=names, window_us=window)
