"""What Dynamo did in a compiled test script, as one line rank 0 prints at exit.

Shared by the compiled stacks (`stack_compile_ddp.py`, `stack_fsdp2.py --compile`). Knows
nothing about torsh-tune: `watch()` captures every warning and every WARNING+ log record
of torch's loggers while the script runs; `line(**extra)` is

    DYNAMO {"unique_graphs": N, "graph_breaks": N, "graph_break_reasons": {...},
            "recompiles": N, "frames_ok": N, "dynamo_warnings": N, "torsh_warnings": [...], ...}

from torch._dynamo.utils.counters: unique_graphs = counters["stats"]["unique_graphs"],
graph_breaks = sum(counters["graph_break"].values()), recompiles = compilations whose
recompile_reason is set (torch._dynamo.utils.get_compilation_metrics()), and every warning or
log record that mentions "torsh".
"""

import json
import logging
import warnings

_records: list[dict] = []


class _Capture(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # a malformed record must not break training
            msg = str(record.msg)
        _records.append({"kind": "log", "logger": record.name, "level": record.levelname, "msg": msg})


def watch() -> None:
    """Capture warnings and torch's WARNING+ log records from now on (Dynamo reports most problems by logging)."""
    capture = _Capture(level=logging.WARNING)
    # torch._logging gives its registered loggers ("torch", "torch._dynamo", "torch._inductor",
    # "torch.distributed", ...) their own handlers and propagate=False, so a handler on
    # "torch" alone misses Dynamo's records: attach it to every registered one.
    try:
        from torch._logging._internal import log_registry

        qnames = set(log_registry.get_log_qnames())
    except Exception:  # private API; fall back to the usual suspects
        qnames = set()
    qnames |= {"torch", "torch._dynamo", "torch._inductor", "torch._functorch", "torch.distributed", "torch.fx"}
    for name in sorted(qnames):
        logging.getLogger(name).addHandler(capture)
    show_warning = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        _records.append({"kind": "warning", "category": category.__name__, "msg": str(message),
                         "where": f"{filename}:{lineno}"})
        show_warning(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning


def summary(**extra) -> dict:
    from torch._dynamo.utils import counters

    try:
        from torch._dynamo.utils import get_compilation_metrics

        metrics = get_compilation_metrics()
        recompiles = sum(1 for m in metrics if getattr(m, "recompile_reason", None))
    except Exception:  # the metrics API moved between releases
        recompiles = None
    graph_breaks = counters.get("graph_break", {})
    torsh = [r for r in _records if "torsh" in json.dumps(r).lower()]
    torsh += [{"kind": "graph_break", "msg": k, "count": v} for k, v in graph_breaks.items() if "torsh" in k.lower()]
    return {
        **extra,
        "unique_graphs": counters["stats"].get("unique_graphs", 0),
        "calls_captured": counters["stats"].get("calls_captured", 0),
        "graph_breaks": sum(graph_breaks.values()),
        "graph_break_reasons": {k[:300]: v for k, v in graph_breaks.items()},
        "recompiles": recompiles,
        "frames_ok": counters["frames"].get("ok", 0),
        "frames_total": counters["frames"].get("total", 0),
        "dynamo_warnings": sum(1 for r in _records if r.get("logger", "").startswith("torch._dynamo")),
        "torch_warning_msgs": sorted({r["msg"][:200] for r in _records if r.get("logger", "").startswith("torch")}),
        "torsh_warnings": [{k: (v[:500] if isinstance(v, str) else v) for k, v in r.items()} for r in torsh],
    }


def line(**extra) -> str:
    return "DYNAMO " + json.dumps(summary(**extra), sort_keys=True)
