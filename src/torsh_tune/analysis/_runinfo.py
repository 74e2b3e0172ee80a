"""Facts about the run read from run.json, config.json and meta.json, tolerant of absence."""

from __future__ import annotations

from typing import Any

__all__ = ["cpu_count", "dig", "nproc_per_node", "run_status"]

_DONE = ("ok", "budget")


def dig(doc: Any, *path: str) -> Any:
    """doc[path[0]][path[1]]... or None where any level is missing."""
    for key in path:
        if not isinstance(doc, dict) or key not in doc:
            return None
        doc = doc[key]
    return doc


def run_status(info: dict[str, Any]) -> str:
    """run.json's outcome status ("outcome" as a string or {"status": ...}), else "unknown"."""
    for value in (info.get("outcome"), dig(info, "outcome", "status"), info.get("status")):
        if isinstance(value, str) and value:
            return value
    return "unknown"


def cpu_count(info: dict[str, Any]) -> int | None:
    """Logical CPUs of the (first) host, from run.json."""
    for value in (info.get("cpu_count"), dig(info, "hardware", "cpu_count"), dig(info, "host", "cpu_count")):
        if isinstance(value, int) and value > 0:
            return value
    return None


def nproc_per_node(info: dict[str, Any], config: dict[str, Any], world_size: int) -> int:
    """Ranks sharing one host: run.json, then config.json, then the world size."""
    for value in (info.get("nproc_per_node"), dig(info, "config", "launch", "nproc_per_node"),
                  dig(config, "launch", "nproc_per_node")):
        if isinstance(value, int) and value > 0:
            return value
    return max(world_size, 1)


def is_done(status: str) -> bool:
    """Whether an exit/run status means the script ended cleanly (ok, or stopped by the budget)."""
    return status in _DONE
