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

import torch
from torch.utils.data import IterableDataset

__all__ = ["DataFingerprint"]

_ELEMENTS = 128  # elements hashed per sample and tensor (evenly strided over the row)
_SKETCH = 64  # smallest distinct hashes kept
_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
# Fixed weights for up to 16-byte elements: the same in every process, so hashes compare across runs.
_WEIGHTS = torch.randint(-(2**62), 2**62, (_ELEMENTS * 16,), generator=torch.Generator().manual_seed(0x70C5),
                         dtype=torch.int64)


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
        per_part = [_row_hashes(t, batch_size).tolist() for t in hashed]
        while len(self._parts) < len(per_part):
            self._parts.append(0)
        combined = [0] * batch_size
        for i, (t, hashes) in enumerate(zip(hashed, per_part)):
            salt = _hash_text(_signature(t, per_sample=True)) + i
            for j, h in enumerate(hashes):
                h = _mix((h + salt) & _MASK)
                self._parts[i] = (self._parts[i] + h) & _MASK
                combined[j] = _mix((combined[j] * _GOLDEN + h) & _MASK)
        for h in combined:
            self._digest = (self._digest + h) & _MASK
            if h not in self._distinct:
                self._distinct.add(h)
                _keep_smallest(rec["sketch"], h)
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


def _row_hashes(t: torch.Tensor, n: int) -> torch.Tensor:
    """One int64 per sample: a weighted sum of the bytes of up to `_ELEMENTS` strided elements of its row."""
    flat = t.detach().reshape(n, -1)
    m = flat.shape[1]
    if m == 0:
        return torch.zeros(n, dtype=torch.int64)
    if m > _ELEMENTS:
        flat = flat.index_select(1, torch.arange(_ELEMENTS) * (m - 1) // (_ELEMENTS - 1))
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(n, -1)
    raw = flat.contiguous().view(torch.uint8).to(torch.int64)
    return (raw * _WEIGHTS[: raw.shape[1]]).sum(dim=1)


def _mix(x: int) -> int:
    """splitmix64's finaliser: spreads a sum's bits evenly (the sketch keeps the smallest values)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _keep_smallest(sketch: list[int], h: int) -> None:
    if len(sketch) < _SKETCH:
        sketch.append(h)
        sketch.sort()
    elif h < sketch[-1]:
        sketch[-1] = h
        sketch.sort()
