"""`Table`: named, equal-length numpy columns — the trace analyzers' frame.

The analyzers run on numpy alone: importing pandas (and the pyarrow it pulls in) costs
~80 MB of RSS and ~0.3 s before the first event is read, more than parsing and analysing
a small trace. Tables become DataFrames only at the API edge (`Table.to_pandas`,
`TraceAnalysis.breakdown` ...), where a user or a report asks for one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Table", "strings"]


class Table:
    """Columns of equal length, in order; rows are selected with a mask or indices.

    Example:
        >>> t = Table({"rank": [0, 1, 1], "dur_us": [2.0, 3.0, 5.0]})
        >>> t[t["rank"] == 1]["dur_us"].sum(), len(t), t.columns
        (np.float64(8.0), 3, ['rank', 'dur_us'])
    """

    __slots__ = ("_cols",)

    def __init__(self, columns: Mapping[str, Any] | None = None, *, names: Sequence[str] = ()) -> None:
        cols: dict[str, np.ndarray] = {}
        for name, values in (columns or {}).items():
            cols[name] = values if isinstance(values, np.ndarray) else _array(values)
        for name in names:  # declared columns of an empty table
            cols.setdefault(name, np.empty(0, dtype=np.float64))
        sizes = {v.shape[0] for v in cols.values()}
        if len(sizes) > 1:
            raise ValueError(f"columns of unequal length: { {k: v.shape[0] for k, v in cols.items()} }")
        self._cols = cols

    @property
    def columns(self) -> list[str]:
        return list(self._cols)

    @property
    def empty(self) -> bool:
        return len(self) == 0

    def __len__(self) -> int:
        return next(iter(self._cols.values())).shape[0] if self._cols else 0

    def __contains__(self, name: object) -> bool:
        return name in self._cols

    def __iter__(self) -> Iterator[str]:
        return iter(self._cols)

    def __repr__(self) -> str:
        return f"Table({len(self)} rows: {', '.join(self._cols)})"

    def __getitem__(self, key: str | np.ndarray | slice) -> Any:
        if isinstance(key, str):
            return self._cols[key]
        return Table({k: v[key] for k, v in self._cols.items()})

    def select(self, names: Iterable[str]) -> Table:
        """The named columns only, in that order."""
        return Table({n: self._cols[n] for n in names})

    def with_columns(self, **columns: Any) -> Table:
        """A copy with columns added or replaced."""
        return Table({**self._cols, **columns})

    def sort(self, by: str) -> Table:
        """Rows ordered by column `by` (stable; NaN last)."""
        return self[np.argsort(self._cols[by], kind="stable")]

    def rows(self) -> list[dict[str, Any]]:
        """Rows as dicts of plain Python values."""
        cols = {k: v.tolist() for k, v in self._cols.items()}
        return [dict(zip(cols, vals)) for vals in zip(*cols.values())]

    def to_pandas(self) -> pd.DataFrame:
        """The table as a DataFrame (imports pandas)."""
        import pandas as pd

        return pd.DataFrame({k: v for k, v in self._cols.items()}, columns=list(self._cols))

    @staticmethod
    def from_rows(rows: Sequence[Mapping[str, Any]], names: Sequence[str]) -> Table:
        """A table of dict rows (columns `names`; strings become object columns)."""
        if not rows:
            return Table(names=names)
        return Table({n: _array([r[n] for r in rows]) for n in names})

    @staticmethod
    def concat(tables: Sequence[Table], names: Sequence[str]) -> Table:
        """Rows of `tables` one after another; a table with no rows may lack columns."""
        full = [t for t in tables if len(t)]
        if not full:
            return Table(names=names)
        return Table({n: np.concatenate([t[n] for t in full]) for n in names})


def strings(values: Iterable[str | None]) -> np.ndarray:
    """An object column of str (None allowed), whatever the values look like."""
    values = list(values)
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _array(values: Any) -> np.ndarray:
    """A numpy column; strings (and None) as object arrays, never fixed-width unicode."""
    if np.isscalar(values):
        raise TypeError("a column needs a sequence, not a scalar")
    values = list(values) if not isinstance(values, (list, tuple)) else values
    if any(isinstance(v, str) for v in values):
        return strings(values)
    return np.asarray(values) if len(values) else np.empty(0, dtype=np.float64)
