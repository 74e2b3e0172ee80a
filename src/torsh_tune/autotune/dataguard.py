"""The data-integrity guard: a trial must train on the data the baseline trains on.

Each rank records what its DataLoaders yielded in the measured window (meta.json
`data_fingerprint`, written by `runtime.fingerprint`: a multiset of per-sample hashes, so
shuffling and workers interleaving leave it unchanged). `check_data` compares a trial's
records with the baseline repeats', rank by rank, and names the first difference found:

1. **Duplicated samples**: the trial reads each sample more often than the baseline does
   (samples / distinct samples beyond the baseline's by `_DUPLICATE_SLACK`). With DataLoader
   workers over an `IterableDataset` this is the classic unsharded stream: every worker yields
   the whole data set.
2. **Another batch**: the batch's layout (batch size, dtypes, per-sample shapes) or the samples
   read per step differ. Knobs that change the batch by design (gradient accumulation) are
   only searched with `allow_batch_changes`, and then this check and the next are waived.
3. **Other samples**: the baseline's repeats (two or more) read the very same samples (their
   digests agree), the trial changes a knob that can change what is read, and its samples
   differ in every tensor of the batch, labels included (a changed sampler or data order). A
   difference in the inputs alone is only noted: random augmentation drawn in worker
   processes changes the inputs of a legitimately identical data set.

A trial that fails the guard is a FAIL whose reason names the cause, and the knob that caused
it (`DataCheck.knob`) leaves the search space for the rest of the study.

Example:
    >>> base = [run_fingerprints("study/baseline/00")]  # doctest: +SKIP
    >>> check_data(run_fingerprints("study/trials/0003"), base, changed={"dataloader.num_workers": 2})  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..rundir import RunDir

__all__ = ["BATCH_KNOBS", "DATA_KNOBS", "DataCheck", "check_data", "run_fingerprints"]

#: Search dimensions that change the batch by design (searched only with allow_batch_changes).
BATCH_KNOBS = ("training.gradient_accumulation_steps",)
#: Search dimensions that can change what the ranks read, most likely culprit first. Persistent
#: workers come before the workers they need: a persistent iterator draws no worker seed from the
#: global RNG per epoch, so a sampler seeded from it (shuffle=True, no generator) orders the next
#: epochs otherwise; blaming the workers for that would drop the knob a data-bound study needs.
DATA_KNOBS = ("dataloader.persistent_workers", "dataloader.num_workers", *BATCH_KNOBS, "strategy.kind",
              "pipeline.n_microbatches", "pipeline.schedule", "dataloader.prefetch_factor", "dataloader.pin_memory")
# A trial may read each sample this much more often than the baseline before it is a duplication
# (the last, partial batch of an epoch or a window edge moves the ratio a little).
_DUPLICATE_SLACK = 1.2


@dataclass(frozen=True, kw_only=True)
class DataCheck:
    """The guard's verdict on one trial.

    Attributes:
        ok: The trial read the baseline's data (or nothing comparable was recorded).
        reason: One line naming the cause when not ok ("" otherwise).
        knob: The search dimension that caused it (it leaves the search space), None when
            none of the trial's changes can explain it.
        notes: What was not compared and why, or differences that are not failures.
    """

    ok: bool
    reason: str = ""
    knob: str | None = None
    notes: tuple[str, ...] = ()


def run_fingerprints(run_dir: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """Rank -> its meta.json `data_fingerprint` ({} when no rank recorded one)."""
    run = RunDir(run_dir)
    out: dict[int, dict[str, Any]] = {}
    for path in sorted(run.path.glob("ranks/rank*.meta.json")):
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(meta.get("data_fingerprint"), dict):
            out[int(meta.get("rank", len(out)))] = meta["data_fingerprint"]
    return out


def check_data(trial: Mapping[int, Mapping[str, Any]], baseline: Sequence[Mapping[int, Mapping[str, Any]]], *,
               changed: Mapping[str, Any], allow_batch_changes: bool = False) -> DataCheck:
    """Compare a trial's data fingerprints with the baseline repeats' (see the module docstring).

    Args:
        trial: Rank -> fingerprint of the trial run (`run_fingerprints`).
        baseline: The same for each baseline repeat.
        changed: The trial's parameters that differ from the baseline's (name -> trial value).
        allow_batch_changes: Knobs that change the batch by design may change it.
    """
    baseline = [b for b in baseline if b]
    if not trial or not baseline:
        return DataCheck(ok=True, notes=("data not compared: " + ("the trial" if not trial else "the baseline")
                                         + " recorded no DataLoader batch in the measured window",))
    notes: list[str] = []
    by_design = allow_batch_changes and any(k in changed for k in BATCH_KNOBS)
    for rank in sorted(set(trial) & set(baseline[0])):
        t, bases = trial[rank], [b[rank] for b in baseline if rank in b]
        failure = _duplicated(rank, t, bases, changed)
        if failure is None and not by_design:
            failure = _other_batch(rank, t, bases, changed) or _other_samples(rank, t, bases, changed, notes)
        if failure is not None:
            return failure
    if by_design:
        notes.append("batch layout and samples not compared: the trial changes the batch by design "
                     f"({', '.join(k for k in BATCH_KNOBS if k in changed)}, allowed by --allow-batch-changes)")
    return DataCheck(ok=True, notes=tuple(dict.fromkeys(notes)))


def _repeats(fp: Mapping[str, Any]) -> float:
    return fp["samples"] / fp["distinct"] if fp.get("distinct") else 1.0


def _duplicated(rank: int, t: Mapping[str, Any], bases: Sequence[Mapping[str, Any]],
                changed: Mapping[str, Any]) -> DataCheck | None:
    if not t.get("distinct"):
        return None
    trial_x, base_x = _repeats(t), max(_repeats(b) for b in bases)
    if trial_x <= base_x * _DUPLICATE_SLACK:
        return None
    workers = int(t.get("num_workers") or 0)
    measured = (f"rank {rank} read each sample {trial_x:.2g} times in the measured steps"
                f"{f' with {workers} DataLoader workers' if workers else ''}, the baseline {base_x:.2g}")
    if t.get("iterable") and workers > 1 and "dataloader.num_workers" in changed:
        return DataCheck(ok=False, knob="dataloader.num_workers", reason=(
            "data_duplicated: the IterableDataset yields the same samples from every worker: shard it with "
            f"get_worker_info() ({measured})"))
    return DataCheck(ok=False, knob=_culprit(changed), reason=f"data_duplicated: {measured}")


def _other_batch(rank: int, t: Mapping[str, Any], bases: Sequence[Mapping[str, Any]],
                 changed: Mapping[str, Any]) -> DataCheck | None:
    def layout(fp: Mapping[str, Any]) -> str:
        shapes = Counter(fp.get("batch_shapes") or {})
        return shapes.most_common(1)[0][0] if shapes else ""

    def per_step(fp: Mapping[str, Any]) -> float:
        first, last = fp["window"]
        return fp["samples"] / (last - first + 1)

    base = bases[0]
    if layout(t) != layout(base):
        return DataCheck(ok=False, knob=_culprit(changed), reason=(
            f"data_batch_changed: rank {rank} read batches of {layout(t)}, the baseline {layout(base)}"))
    if abs(per_step(t) - per_step(base)) > 0.25 * per_step(base):
        return DataCheck(ok=False, knob=_culprit(changed), reason=(
            f"data_batch_changed: rank {rank} read {per_step(t):.3g} samples per step, the baseline "
            f"{per_step(base):.3g}"))
    return None


def _other_samples(rank: int, t: Mapping[str, Any], bases: Sequence[Mapping[str, Any]], changed: Mapping[str, Any],
                   notes: list[str]) -> DataCheck | None:
    if len(bases) < 2 or len({b.get("digest") for b in bases}) > 1:
        notes.append("samples not compared: " + (
            "one baseline run cannot show that the data is the same from run to run" if len(bases) < 2 else
            "the baseline's own repeats read different samples (unseeded shuffling or data)")
            + "; duplication and batch layout were compared")
        return None
    base = bases[0]
    if t.get("digest") == base.get("digest"):
        return None
    parts_t, parts_b = t.get("parts") or [], base.get("parts") or []
    same_parts = [i for i, (a, b) in enumerate(zip(parts_t, parts_b)) if a == b]
    overlap = _overlap(t.get("sketch") or [], base.get("sketch") or [])
    if same_parts:
        notes.append(f"rank {rank}: the inputs differ from the baseline's but tensor(s) {same_parts} of each batch "
                     "(e.g. the labels) match: random augmentation drawn in DataLoader workers, not other samples")
        return None
    share = f" (about {100 * overlap:.0f} % of the samples in common)" if overlap is not None else ""
    if _culprit(changed) is None:  # no knob of this trial changes what is read: the data itself varies
        notes.append(f"rank {rank} read other samples than the baseline{share} without changing a data knob")
        return None
    return DataCheck(ok=False, knob=_culprit(changed), reason=(
        f"data_changed: rank {rank} read other samples than the baseline in the measured steps{share}: a changed "
        "sampler or data order"))


def _overlap(a: Sequence[int], b: Sequence[int]) -> float | None:
    """Share of samples two runs have in common (Jaccard), estimated from their bottom-k sketches."""
    if not a or not b:
        return None
    k = min(len(a), len(b))
    union = sorted(set(a) | set(b))[:k]
    both = set(a) & set(b)
    return sum(h in both for h in union) / len(union)


def _culprit(changed: Mapping[str, Any]) -> str | None:
    """The changed knob most likely to change what the ranks read (`DATA_KNOBS` order)."""
    return next((k for k in DATA_KNOBS if k in changed), None)
