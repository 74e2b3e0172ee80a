"""Symbol table: every event name, category and string argument interned to an int."""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np

__all__ = ["SymbolTable"]


class SymbolTable:
    """Interns strings to dense ids shared by all ranks of a `TraceSet`.

    Event frames store ``name_id``/``cat_id`` (and string arguments) as ids so a trace
    with millions of events holds each distinct string once.

    Example:
        >>> t = SymbolTable()
        >>> t.intern("aten::mm"), t.intern("aten::mm"), t[0]
        (0, 0, 'aten::mm')
    """

    def __init__(self) -> None:
        self._names: list[str] = []
        self._ids: dict[str, int] = {}
        # Analyzers ask for the same patterns again and again; valid while no symbol is added.
        self._matches: dict[tuple[str | bytes, int, int], np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._names)

    def __getitem__(self, sym_id: int) -> str:
        return self._names[sym_id]

    def intern(self, name: str) -> int:
        """Id of `name`, adding it if new."""
        sym_id = self._ids.get(name)
        if sym_id is None:
            sym_id = len(self._names)
            self._names.append(name)
            self._ids[name] = sym_id
        return sym_id

    def intern_many(self, names: Iterable[str | None]) -> np.ndarray:
        """Ids of `names` as int32 (-1 for None)."""
        return np.fromiter((-1 if n is None else self.intern(n) for n in names), dtype=np.int32)

    def id_of(self, name: str) -> int:
        """Id of `name`, or -1 when the traces never mention it."""
        return self._ids.get(name, -1)

    def ids_matching(self, pattern: str | re.Pattern[str]) -> np.ndarray:
        """Ids of every symbol that `re.search` matches (for vectorised ``isin`` filters)."""
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        key = (rx.pattern, rx.flags, len(self._names))
        ids = self._matches.get(key)
        if ids is None:
            ids = np.fromiter((i for i, n in enumerate(self._names) if rx.search(n)), dtype=np.int32)
            ids.setflags(write=False)
            self._matches[key] = ids
        return ids

    def decode(self, ids: Iterable[int]) -> list[str | None]:
        """Strings of `ids` (None for -1)."""
        return [None if i < 0 else self._names[i] for i in ids]

    @property
    def names(self) -> list[str]:
        """All symbols, indexed by id (a copy)."""
        return list(self._names)
