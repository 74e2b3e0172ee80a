"""The bench results as terminal tables."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from ._run import BenchResult

__all__ = ["render_bench_table"]


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{int(n)} B"


def render_bench_table(result: BenchResult, console: Console) -> None:
    """Print the sweep (one table per collective and level) and the fitted model.

    Args:
        result: a `BenchResult`.
        console: a rich Console (`Console(record=True)` captures it for tests).
    """
    from rich.table import Table

    keys = []
    for row in result.rows:
        key = (row["collective"], row["level"], row["group_size"])
        if key not in keys:
            keys.append(key)
    mem = result.memcopy_gbps
    for name, level, n in keys:
        fit = result.model.get(name, level)
        title = f"{name} ({level}, {n} ranks, {result.meta.get('backend', '?')})"
        if fit is not None:
            title += (f" - fit: alpha {fit.alpha_s * 1e6:.1f} us, 1/beta {fit.busbw_gbps or float('inf'):.3g} GB/s"
                      + ("" if fit.heldout_median_rel_err is None
                         else f", held-out err {fit.heldout_median_rel_err * 100:.0f} %"))
        table = Table(title=title, title_justify="left")
        for col in ("size", "time (us)", "min..max (us)", "algbw GB/s", "busbw GB/s", "% of memcopy", "model (us)"):
            table.add_column(col, justify="right")
        for row in result.rows:
            if (row["collective"], row["level"], row["group_size"]) != (name, level, n):
                continue
            if row["status"] != "ok":
                table.add_row(_fmt_bytes(row["size_bytes"]), row["status"], "", "", "", "", "")
                continue
            busbw = row["busbw_gbps"]
            table.add_row(
                _fmt_bytes(row["size_bytes"]), f"{row['time_s'] * 1e6:.1f}",
                f"{row['time_min_s'] * 1e6:.0f}..{row['time_max_s'] * 1e6:.0f}",
                f"{row['algbw_gbps']:.3f}", f"{busbw:.3f}",
                "" if not mem else f"{busbw / mem * 100:.1f}",
                "" if fit is None else f"{fit.predict_s(row['size_bytes']) * 1e6:.1f}",
            )
        console.print(table)
    if result.topology is not None:
        topo = result.topology
        links = {f.name: f for f in topo.facts}.get("inter_node_link")
        console.print(f"topology: {topo.nnodes} node(s), ranks per node {topo.ranks_per_node}"
                      + ("" if links is None or links.value is None else f", inter-node {links.value} ({links.source})"))
    if mem:
        console.print(f"memory-copy ceiling: {mem:.2f} GB/s per rank (tensor copy_, bytes copied / s)")
    if result.reference_busbw_gbps is not None:
        console.print(f"reference busbw (all_reduce, large sizes): {result.reference_busbw_gbps:.3f} GB/s")
    console.print(f"results: {result.paths.get('json')}  {result.paths.get('csv')}  {result.paths.get('model')}")
