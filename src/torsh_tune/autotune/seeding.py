"""Seed a study with the strategy advisor's candidates: config patches as trial parameters.

The advisor (`torsh_tune.strategies.advisor`, run on the baseline by
`torsh_tune.analysis.strategy_advice`) ranks strategies by rules; the tuner measures them.
Only what the zero-code search space can apply becomes a trial: DDP candidates, with their
values for the space's dimensions (`compression.method`, `compression.rank`,
`ddp.bucket_cap_mb`, ...). FSDP, HSDP and pipeline need `torsh_tune.parallelize` in the
script, so they are skipped; patch keys the space has no dimension for (e.g.
`training.lr_scaling`) are dropped; a value outside a (narrowed or fixed) dimension skips
the candidate.

Example:
    >>> from torsh_tune.autotune import build_space
    >>> space = build_space(nproc_per_node=2, cpu_count=8)
    >>> rows = [{"rank": 1, "name": "ddp + fp16 compression",
    ...          "config_patch": {"strategy": {"kind": "ddp"}, "compression": {"method": "fp16"}}}]
    >>> [(rank, params["compression.method"]) for rank, params in advisor_params(rows, space)]
    [(1, 'fp16')]
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .space import BASELINE_PARAMS, SearchSpace

__all__ = ["advisor_params"]

# The strategy kinds a zero-code trial can run (the others need torsh_tune.parallelize).


def advisor_params(
    candidates: Sequence[Mapping[str, Any]],
    space: SearchSpace,
    *,
    exclude: Sequence[Mapping[str, Any]] = (),
    skipped: list[str] | None = None,
) -> list[tuple[int, dict[str, Any]]]:
    """The advisor's candidates as trial parameters of `space`, best first, distinct.

    Each candidate's patch is laid over the PyTorch defaults (`space.baseline_params()`,
    trial 0), and the conditional dimensions follow as `space.suggest` would ask them
    (`compression.rank` only for PowerSGD, ...; a missing one takes its PyTorch default).

    Args:
        candidates: `strategy_advice` / `advisor.advice_table` rows (`rank`, `name`,
            `config_patch`), best first.
        space: the study's search space.
        exclude: parameter sets already enqueued (trial 0 is always excluded).
        skipped: receives one line per candidate left out, with the reason.

    Returns:
        (advisor rank, parameters) per candidate that differs from trial 0, `exclude`
        and every earlier candidate.
    """
    notes = skipped if skipped is not None else []
    seen = {_key(_complete(space, space.baseline_params()))}
    seen.update(_key(_complete(space, {**space.baseline_params(), **dict(p)})) for p in exclude)
    out: list[tuple[int, dict[str, Any]]] = []
    for row in candidates:
        rank, name = int(row.get("rank", len(out) + 1)), str(row.get("name", "?"))
        patch = row.get("config_patch") or {}
        kind = (patch.get("strategy") or {}).get("kind", space.base_kind)
        kind_dim = space.dims.get("strategy.kind")
        if kind_dim is not None and kind_dim.contains(kind):
            wanted_kind = {} if kind_dim.fixed else {"strategy.kind": kind}
        elif kind != space.base_kind:
            notes.append(f"#{rank} {name}: strategy kind {kind!r} needs torsh_tune.parallelize (API mode), "
                         "not a zero-code trial")
            continue
        else:
            wanted_kind = {}
        wanted, dropped, problem = _translate(patch, space)
        if problem:
            notes.append(f"#{rank} {name}: {problem}")
            continue
        params = _complete(space, {**space.baseline_params(), **wanted_kind, **wanted})
        key = _key(params)
        if key in seen:
            extra = f" without {', '.join(dropped)} (not in the search space)" if dropped else ""
            notes.append(f"#{rank} {name}: the same trial as the PyTorch defaults or an earlier one{extra}")
            continue
        seen.add(key)
        out.append((rank, params))
    return out


def _translate(patch: Mapping[str, Any], space: SearchSpace) -> tuple[dict[str, Any], list[str], str]:
    """(dimension -> value, patch keys the space has no dimension for, why the candidate is skipped or '')."""
    wanted: dict[str, Any] = {}
    dropped: list[str] = []
    for section, values in patch.items():
        if section == "strategy" or not isinstance(values, Mapping):
            continue
        for key, value in values.items():
            name = f"{section}.{key}"
            if name in space.unavailable:
                return {}, [], f"{name} is not searched here ({space.unavailable[name]})"
            dim = space.dims.get(name)
            if dim is None:
                dropped.append(name)
            elif not dim.contains(value):
                return {}, [], f"{name} = {value!r} lies outside the search space"
            elif not dim.fixed:
                wanted[name] = value
    return wanted, dropped, ""


class _Replay:
    """A stand-in for an Optuna trial that answers `space.suggest` from a dict of values."""

    def __init__(self, space: SearchSpace, values: Mapping[str, Any]) -> None:
        self.space, self.values, self.missing = space, values, set()

    def _take(self, name: str, fallback: Any) -> Any:
        if name in self.values:
            return self.values[name]
        default = BASELINE_PARAMS.get(name)
        if default is not None and self.space.dims[name].contains(default):
            return default
        self.missing.add(name)  # left to the sampler
        return fallback

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        return self._take(name, choices[0])

    def suggest_int(self, name: str, low: int, high: int, *, log: bool = False) -> int:
        return self._take(name, low)

    def suggest_float(self, name: str, low: float, high: float, *, log: bool = False) -> float:
        return self._take(name, low)


def _complete(space: SearchSpace, values: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters `space.suggest` would ask for under `values` (fixed dimensions are not asked)."""
    replay = _Replay(space, values)
    params = space.suggest(replay)  # type: ignore[arg-type]  # duck-typed trial
    return {k: v for k, v in params.items() if not space.dims[k].fixed and k not in replay.missing}


def _key(params: Mapping[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, default=str)
