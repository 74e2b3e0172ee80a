"""What a rank's DataLoaders hand the script in the measured window, as cheap order-insensitive hashes.

The autotuner compares a trial's data with the baseline's (`autotune.dataguard`): a trial
that reads other samples, the same samples twice, or other batches is not the same training,
however fast it is. Each batch a DataLoader iterator yields in the measured steps (after the
warm-up, before the budget's end) is hashed per sample: every tensor of the batch whose first
dimension is the batch size contributes a 64-bit hash of up to `_ELEMENTS` evenly strided
elements of its row (their bytes, weighted by fixed pseudo-random 64-bit constants, wrapping),
mixed with the tensor's dtype and per-sample shape. The record is a multiset, so legitimate
reordering (shuffling, workers interleaving) leaves it unchanged:

    meta.json "data_fingerprint":
      window      [first, last] step that read a batch
      batches     batches read;  samples: samples read;  distinct: distinct sample hashes
      digest      sum of the sample hashes mod 2**64 (hex): equal multisets, equal digests
      parts       the same sum per tensor position (inputs, labels, ...), so a difference in the
                  inputs alone (random augmentation drawn in workers) is told from one in every part
      sketch      the `_SKETCH` smallest distinct sample hashes (a bottom-k sketch: estimates the
                  share of samples two runs have in common)
      batch_shapes  "16 x float32[3,32,32] int64[]" -> batches
      iterable    the (last) DataLoader's dataset is an IterableDataset;  num_workers: its workers

Cost: a gather of at most `_ELEMENTS` elements per sample and tensor, one multiply-add, and a
few Python operations per sample, only for the measured steps. Tensors not on the CPU (a
DataLoader never yields them; a custom iterator might) count in `batch_shapes` but are not
hashed: reading them back would synchronise the device.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

__all__ = ["DataFingerprint"]

_ELEMENTS = 128  # elements hashed per sample and tensor (evenly strided over the row)
_SKETCH = 64  # smallest distinct hashes kept
_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
# Fixed weights for up to 16-byte elements: the same in every process, so hashes compare across runs.
_WEIGHTS = torch.randint(-(2**62), 2**62, (_ELEMENTS * 16,), generator=torch.Generator().manual_seed(0x70C5),
                         dtype=torch.int64).numpy().view(np.uint64)
_GOLDEN_U64 = np.uint64(_GOLDEN)


class DataFingerprint:
    """Accumulates one rank's data fingerprint into `meta["data_fingerprint"]` (see the module docstring).

    Args:
        meta: The rank's meta.json document (the record is kept up to date in it; the runtime writes it).
        first_step: First measured step (the warm-up's length).
        end_step: The step budget's end (exclusive), None when unbounded.
    """

    def __init__(self, meta: dict[str, Any], *, first_step: int, end_step: int | None) -> None:
        self.first_step, self.end_step = first_step, end_step
        self._distinct: set[int] = set()
        self._digest = 0
        self._parts: list[int] = []
        self._record: dict[str, Any] | None = None
        self._meta = meta

    def observe(self, batch: Any, batch_size: int, step: int, iterator: Any) -> None:
        """Hash one batch the script received at `step` (ignored outside the measured window)."""
        if step < self.first_step or (self.end_step is not None and step >= self.end_step) or batch_size <= 0:
            return
        rec = self._record
        if rec is None:
            rec = self._record = self._meta["data_fingerprint"] = {
                "window": [step, step], "batches": 0, "samples": 0, "distinct": 0, "digest": "0", "parts": [],
                "sketch": [], "batch_shapes": {}, "iterable": False, "num_workers": 0}
        tensors = _tensors(batch)
        per_sample = [t.dim() >= 1 and t.shape[0] == batch_size for t in tensors]
        rows = [t for t, p in zip(tensors, per_sample) if p]
        shape = f"{batch_size} x " + " ".join(_signature(t, per_sample=p) for t, p in zip(tensors, per_sample))
        rec["batch_shapes"][shape] = rec["batch_shapes"].get(shape, 0) + 1
        rec["window"][1] = step
        rec["batches"] += 1
        rec["samples"] += batch_size
        rec["iterable"] = isinstance(getattr(iterator, "_dataset", None), IterableDataset)
        rec["num_workers"] = int(getattr(iterator, "_num_workers", 0))
        hashed = [t for t in rows if t.device.type == "cpu"]
        if not hashed:
            return
        # Per sample, in uint64 array arithmetic (wrapping): a few numpy operations per batch (each
        # ~1 us; torch's per-operation dispatch costs several), not Python operations per sample.
        while len(self._parts) < len(hashed):
            self._parts.append(0)
        combined = np.zeros(batch_size, dtype=np.uint64)
        with np.errstate(over="ignore"):
            for i, t in enumerate(hashed):
                h = _mix(_row_hashes(t, batch_size) + np.uint64((_salt(t) + i) & _MASK))
                self._parts[i] = (self._parts[i] + int(h.sum(dtype=np.uint64))) & _MASK
                combined = _mix(combined * _GOLDEN_U64 + h)
        values = combined.tolist()
        self._digest = (self._digest + sum(values)) & _MASK
        new = [v for v in values if v not in self._distinct]
        self._distinct.update(new)
        sketch = rec["sketch"]
        if new and (len(sketch) < _SKETCH or min(new) < sketch[-1]):
            sketch[:] = sorted(set(sketch).union(new))[:_SKETCH]
        rec["distinct"] = len(self._distinct)
        rec["digest"] = f"{self._digest:016x}"
        rec["parts"] = [f"{p:016x}" for p in self._parts]


def _hash_text(text: str) -> int:
    """A stable 64-bit hash of a string (Python's `hash` is salted per process)."""
    h = 0xCBF29CE484222325
    for b in text.encode():
        h = ((h ^ b) * 0x100000001B3) & _MASK
    return h


def _tensors(batch: Any, depth: int = 0) -> list[torch.Tensor]:
    """The tensors of a (nested list/tuple/dict) batch, in a deterministic order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if depth >= 4:
        return []
    if isinstance(batch, dict):
        return [t for k in batch for t in _tensors(batch[k], depth + 1)]
    if isinstance(batch, (list, tuple)):
        return [t for item in batch for t in _tensors(item, depth + 1)]
    return []


def _signature(t: torch.Tensor, *, per_sample: bool) -> str:
    dims = list(t.shape[1:] if per_sample else t.shape)
    where = "" if t.device.type == "cpu" else f"@{t.device.type}"
    return f"{str(t.dtype).removeprefix('torch.')}[{','.join(map(str, dims))}]{where}"


def _row_hashes(t: torch.Tensor, n: int) -> np.ndarray:
    """One uint64 per sample: a weighted sum of the bytes of up to `_ELEMENTS` strided elements of its row."""
    flat = t.detach().reshape(n, -1)
    m = flat.shape[1]
    if m == 0:
        return np.zeros(n, dtype=np.uint64)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(n, -1)
        m = flat.shape[1]
    if flat.dtype == torch.bfloat16:  # numpy has no bfloat16: the same bits as int16
        flat = flat.view(torch.int16)
    rows = flat.numpy()
    if m > _ELEMENTS:
        rows = rows[:, _columns(m)]
    raw = np.ascontiguousarray(rows).view(np.uint8).reshape(n, -1)
    with np.errstate(over="ignore"):
        return (raw.astype(np.uint64) * _WEIGHTS[: raw.shape[1]]).sum(axis=1, dtype=np.uint64)


_COLUMNS: dict[int, np.ndarray] = {}


def _columns(m: int) -> np.ndarray:
    """`_ELEMENTS` evenly strided column indices of a row of `m` elements (cached per width)."""
    cols = _COLUMNS.get(m)
    if cols is None:
        cols = _COLUMNS[m] = np.arange(_ELEMENTS, dtype=np.int64) * (m - 1) // (_ELEMENTS - 1)
    return cols


_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping): spreads a sum's bits evenly (the sketch keeps the smallest values)."""
    x = (x ^ (x >> _S30)) * _MIX1
    x = (x ^ (x >> _S27)) * _MIX2
    return x ^ (x >> _S31)


_SALTS: dict[tuple, int] = {}


def _salt(t: torch.Tensor) -> int:
    """The stable hash of a tensor's per-sample signature (dtype, row shape, device), computed once per signature."""
    key = (t.dtype, tuple(t.shape[1:]), t.device.type)
    salt = _SALTS.get(key)
    if salt is None:
        salt = _SALTS[key] = _hash_text(_signature(t, per_sample=True))
    return salt
