"""Loaded traces: one `RankTrace` (event table + metadata) per rank, in a `TraceSet`."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import invalid
from . import _parser
from ._parser import parse_trace_file, rank_from_file_name
from ._symbols import SymbolTable
from ._table import Table

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["RankTrace", "TraceSet", "find_trace_files", "load_traces"]

_SUFFIXES = (".json", ".json.gz")


@dataclass(frozen=True, kw_only=True)
class RankTrace:
    """The events of one rank's trace file.

    Attributes:
        rank: global rank (from ``distributedInfo``, else the file name, else file order).
        path: the trace file.
        table: one row per complete (``X``) or instant (``i``) event, columns
            ``name_id, cat_id, ph, ts_us, dur_us, pid, tid, stream, correlation,
            external_id, device, coll_name_id, in_nelems, out_nelems, group_size,
            coll_seq, dtype_id, pg_name_id, pg_ranks_id, input_numel, input_bytes``;
            ``*_id`` columns index the TraceSet's `SymbolTable`, -1 means absent; ``ph``
            is 0 for X, 1 for i. `events` is the same as a DataFrame.
        metadata: the file's top-level keys except ``traceEvents``.
        thread_names: ``(pid, tid) -> name`` from ``thread_name`` metadata events.
        rank_source: where `rank` came from: "distributedInfo", "file name" or "file order".
    """

    rank: int
    path: Path
    table: Table
    metadata: dict[str, Any]
    thread_names: dict[tuple[int, int], str]
    rank_source: str

    @cached_property
    def events(self) -> pd.DataFrame:
        """`table` as a DataFrame (``ph`` categorical X / i); imports pandas on first use."""
        import pandas as pd

        df = self.table.to_pandas()
        df["ph"] = pd.Categorical.from_codes(self.table["ph"].astype(np.int8), categories=["X", "i"])
        return df

    @property
    def distributed_info(self) -> dict[str, Any]:
        """``distributedInfo`` ({} when the trace has none)."""
        info = self.metadata.get("distributedInfo")
        return info if isinstance(info, dict) else {}

    @property
    def backend(self) -> str:
        """Process-group backend ("nccl", "gloo"...) or "" when unknown."""
        return str(self.distributed_info.get("backend", ""))

    @property
    def world_size(self) -> int:
        """World size from ``distributedInfo``, or 0 when unknown."""
        return int(self.distributed_info.get("world_size", 0) or 0)

    @property
    def process_groups(self) -> list[dict[str, Any]]:
        """``pg_config`` entries (name, desc, size, ranks); [] when absent."""
        pgs = self.distributed_info.get("pg_config")
        return [p for p in pgs if isinstance(p, dict)] if isinstance(pgs, list) else []


@dataclass(frozen=True, kw_only=True)
class TraceSet:
    """Every rank's trace of one capture window, sharing one symbol table.

    Example:
        >>> ts = load_traces("tests/data/traces/gloo-ddp-2rank")  # doctest: +SKIP
        >>> sorted(ts.ranks), ts.symbols[int(ts.ranks[0].table["name_id"][0])]  # doctest: +SKIP
    """

    path: Path
    ranks: dict[int, RankTrace]
    symbols: SymbolTable
    warnings: tuple[str, ...] = field(default=())

    def names(self, rank: int) -> pd.Series:
        """Decoded event names of `rank`, aligned with its events (a convenience, not fast)."""
        import pandas as pd

        ev = self.ranks[rank].events
        return pd.Series(self.symbols.decode(ev["name_id"].tolist()), index=ev.index, dtype="string")


def find_trace_files(path: str | Path) -> list[Path]:
    """Kineto trace files (``*.json``, ``*.json.gz``) in directory `path`, or `path` itself.

    Raises:
        ConfigError: `path` does not exist or holds no trace file.
    """
    p = Path(path)
    if not p.exists():
        raise invalid("trace path", "an existing directory or trace file", str(p))
    if p.is_file():
        return [p]
    files = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(_SUFFIXES))
    if not files:
        raise invalid(f"trace directory {p}", "a directory holding *.json or *.json.gz Kineto traces",
                      "none found")
    return files


def load_traces(path: str | Path, *, chunk_bytes: int | None = None) -> TraceSet:
    """Parse every Kineto trace in `path` (a directory of per-rank files, or one file).

    Args:
        path: directory with one ``.json``/``.json.gz`` file per rank, or a single file.
        chunk_bytes: decompressed bytes parsed at a time (bounds memory on huge traces).

    Returns:
        A `TraceSet` keyed by rank.

    Raises:
        ConfigError: missing path, a file that is not a trace, a truncated gzip, or two
            files claiming the same rank.

    Example:
        >>> ts = load_traces("tests/data/traces/hta-sampled-2rank")  # doctest: +SKIP
        >>> sorted(ts.ranks)  # doctest: +SKIP
        [0, 1]
    """
    files = find_trace_files(path)
    symbols = SymbolTable()
    ranks: dict[int, RankTrace] = {}
    warnings: list[str] = []
    kwargs = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    if _parser.SCANNER != "c":
        warnings.append("the C event scanner is not built (no compiler at install time?): parsed with Python's "
                        "json, several times slower; reinstall torsh-tune with a C compiler")
    for order, f in enumerate(files):
        columns, meta, threads = parse_trace_file(f, symbols, **kwargs)
        events = Table(columns)
        info = meta.get("distributedInfo") if isinstance(meta.get("distributedInfo"), dict) else {}
        if "rank" in info:
            rank, source = int(info["rank"]), "distributedInfo"
        elif (from_name := rank_from_file_name(f)) is not None:
            rank, source = from_name, "file name"
        else:
            rank, source = order, "file order"
            warnings.append(f"{f.name}: no distributedInfo and no rank in the file name; assumed rank {rank}")
        if rank in ranks:
            raise invalid(f"trace file {f}", "the only trace of its rank",
                          f"a second trace of rank {rank} (first: {ranks[rank].path.name})")
        ranks[rank] = RankTrace(rank=rank, path=f, table=events, metadata=meta, thread_names=threads,
                                rank_source=source)
    return TraceSet(path=Path(path), ranks=dict(sorted(ranks.items())), symbols=symbols,
                    warnings=tuple(warnings))
