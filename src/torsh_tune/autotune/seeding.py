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
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ConfigError
from ..fabric import CommModel
from .space import BASELINE_PARAMS, CONDITIONS, SearchSpace

__all__ = ["advisor_params", "asked_for", "script_values", "seed_study"]

_log = logging.getLogger(__name__)

# The strategy kinds a zero-code trial can run (the others need torsh_tune.parallelize).


def advisor_params(
    candidates: Sequence[Mapping[str, Any]],
    space: SearchSpace,
    *,
    exclude: Sequence[Mapping[str, Any]] = (),
    skipped: list[str] | None = None,
    script: Mapping[str, Any] | None = None,
) -> list[tuple[int, dict[str, Any]]]:
    """The advisor's candidates as trial parameters of `space`, best first, distinct.

    Each candidate's patch is laid over the PyTorch defaults (`space.baseline_params()`,
    trial 0), and the conditional dimensions follow as `space.suggest` would ask them
    (`compression.rank` only for PowerSGD, ...; a missing one takes its PyTorch default).
    A patch that names a conditional dimension but not its condition (`persistent_workers`
    without `num_workers`: keep the script's workers alive) takes the condition's value from
    `script`, what the baseline ran with; PyTorch's default 0 would leave the knob unasked.

    Args:
        candidates: `strategy_advice` / `advisor.advice_table` rows (`rank`, `name`,
            `config_patch`), best first.
        space: the study's search space.
        exclude: parameter sets already enqueued (trial 0 is always excluded).
        skipped: receives one line per candidate left out, with the reason.
        script: dimension -> the baseline's own value (`script_values`), for those conditions.

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
        wanted = {**_conditions_of(wanted, space, script or {}), **wanted}
        params = _complete(space, {**space.baseline_params(), **wanted_kind, **wanted})
        key = _key(params)
        if key in seen:
            extra = f" without {', '.join(dropped)} (not in the search space)" if dropped else ""
            notes.append(f"#{rank} {name}: the same trial as the PyTorch defaults or an earlier one{extra}")
            continue
        seen.add(key)
        out.append((rank, params))
    return out


def _conditions_of(wanted: Mapping[str, Any], space: SearchSpace, script: Mapping[str, Any]) -> dict[str, Any]:
    """The script's values of the conditions `wanted`'s dimensions need and do not name (`CONDITIONS`)."""
    out: dict[str, Any] = {}
    for name in wanted:
        condition = CONDITIONS.get(name)
        if condition is None or condition in wanted or condition not in script:
            continue
        dim = space.dims.get(condition)
        value = script[condition]
        if dim is not None and not dim.fixed and dim.contains(value) and value > 0:
            out[condition] = value
    return out


def script_values(run_dirs: Sequence[str]) -> dict[str, Any]:
    """The search dimensions' values the baseline ran with, where the trials' conditions need them.

    `dataloader.num_workers`: the most workers any of the first recorded run's DataLoaders had
    (the training loader's, next to an evaluation loader's fewer).
    """
    from .objective import effective_settings

    for run_dir in run_dirs:
        try:
            settings = effective_settings(run_dir)
        except (OSError, ValueError):
            settings = None
        if settings is None:
            continue
        workers = [int(d.get("num_workers") or 0) for d in settings.get("dataloaders") or ()]
        return {"dataloader.num_workers": max(workers)} if workers else {}
    return {}


def _asked(rows: Sequence[Mapping[str, Any]], space: SearchSpace) -> list[str]:
    """The search dimensions the rows' config patches name, whether their trial was enqueued or not.

    A recommendation left out because its value lies outside the space (7 workers where the space
    offers 0 and 2) still says which knob its finding is about.
    """
    names = set()
    for row in rows:
        for section, values in (row.get("config_patch") or {}).items():
            if isinstance(values, Mapping):
                names.update(f"{section}.{key}" for key in values)
    return sorted(n for n in names if n in space.dims)


def asked_for(study: Any, space: SearchSpace) -> set[str]:
    """The dimensions the baseline's analysis proposed changing (the ablation's `suspects`).

    Those its recommendations' and the strategy advisor's patches name (user attrs `recommendations`
    and `advisor`, key `asked`), and those the trials it seeded change from the PyTorch defaults
    (`enqueued`, and the communication model's): kept in the study, so a resumed study has them.
    """
    defaults = space.normalize(space.baseline_params())
    attrs = study.user_attrs
    asked: set[str] = set()
    for source in ("recommendations", "advisor", "model"):
        attr = attrs.get(source) or {}
        asked.update(str(n) for n in attr.get("asked") or ())
        for row in attr.get("enqueued") or ():
            params = space.normalize({**defaults, **dict(row.get("params") or {})})
            asked.update(k for k, v in params.items() if defaults.get(k) != v)
    return asked


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


def seed_study(study, space: SearchSpace, run_dirs: Sequence[str], initial_params: Sequence[Mapping[str, Any]], *,
                comm_model: CommModel | None = None, reference_bench: Any = None) -> None:
    """Enqueue the study's first trials: trial 0 (PyTorch defaults), `initial_params`, the strategy
    advisor's candidates, the baseline's sized recommendations, then the communication model's.

    Only into a study without trials: a resumed study already holds them (run or waiting).
    """
    if study.trials:
        return
    study.enqueue_trial(space.baseline_params(), user_attrs={"role": "pytorch-defaults"})
    for params in initial_params:
        study.enqueue_trial(dict(params), user_attrs={"role": "initial"})
    seeded = [*initial_params, *_enqueue_advisor(study, space, run_dirs, exclude=initial_params)]
    if comm_model is not None:
        _enqueue_model(study, space, run_dirs, comm_model, exclude=seeded, source=str(reference_bench))


def _enqueue_model(study, space: SearchSpace, run_dirs: Sequence[str], model: CommModel, *,
                   exclude: Sequence[Mapping[str, Any]], source: str) -> None:
    """Enqueue the configurations the bench's alpha-beta model predicts fastest; a failure only warns.

    Predicted for the first baseline run that recorded its steps and buckets; what was
    enqueued and skipped (and why) is kept in the study's user attr "model".
    """
    from .predict import model_candidates

    skipped: list[str] = []
    try:
        candidates = []
        for run_dir in run_dirs:
            try:
                candidates = model_candidates(model, run_dir, space, exclude=exclude, skipped=skipped)
                break
            except ConfigError as exc:  # this run recorded too little: try the next repeat
                skipped.append(f"{run_dir}: {exc}")
        for c in candidates:
            study.enqueue_trial(c.params, user_attrs={"role": "model", "predicted_speedup": c.predicted_speedup,
                                                      "predicted_why": c.why})
        study.set_user_attr("model", {
            "bench": source,
            "enqueued": [{"params": c.params, "predicted_step_s": c.predicted_step_s,
                          "baseline_predicted_step_s": c.baseline_predicted_step_s,
                          "predicted_speedup": c.predicted_speedup, "why": c.why} for c in candidates],
            "skipped": skipped,
        })
    except Exception as exc:  # noqa: BLE001 - the model only seeds the search; it must not stop it
        _log.warning("communication-model candidates not enqueued: %s: %s", type(exc).__name__, exc)
        study.set_user_attr("model", {"bench": source, "enqueued": [], "skipped": skipped,
                                      "error": f"{type(exc).__name__}: {exc}"})


def _enqueue_advisor(study, space: SearchSpace, run_dirs: Sequence[str], *,
                     exclude: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Enqueue what the baseline's analysis proposes: the strategy advisor's candidates, then the
    recommendations sized from the run (DataLoader workers, bucket cap, compression ratio) whose
    patches the space can express, so the study confirms or refutes each. A failure only warns.

    The advisor's come from the first baseline run with advice (a recorded parameter count), the
    recommendations from the first with step records. What was enqueued and skipped (and why) is
    kept in the study's user attrs "advisor" and "recommendations".

    Returns:
        The parameters enqueued.
    """
    from ..analysis import analyze_run

    analyses: list[Any] = []
    enqueued: list[dict[str, Any]] = []
    try:
        rows: tuple[dict[str, Any], ...] = ()
        for run_dir in run_dirs:
            analyses.append(analyze_run(run_dir))
            rows = analyses[-1].advice
            if rows:
                break
        if not rows:
            study.set_user_attr("advisor", {"enqueued": [], "skipped": [],
                                            "note": "no advice: the baseline recorded no parameter count"})
        else:
            names = {int(r["rank"]): str(r["name"]) for r in rows}
            skipped: list[str] = []
            trials = advisor_params(rows, space, exclude=exclude, skipped=skipped)
            for rank, params in trials:
                study.enqueue_trial(params, user_attrs={"role": "advisor", "advisor_rank": rank,
                                                        "advisor_name": names.get(rank, "")})
            study.set_user_attr("advisor", {
                "enqueued": [{"advisor_rank": rank, "name": names.get(rank, ""), "params": params}
                             for rank, params in trials],
                "skipped": skipped,
                "asked": _asked(rows, space),
            })
            enqueued += [params for _, params in trials]
    except Exception as exc:  # noqa: BLE001 - the advisor only seeds the search; it must not stop it
        _log.warning("strategy advisor candidates not enqueued: %s: %s", type(exc).__name__, exc)
    try:
        analysis = next((a for a in analyses if a.breakdown is not None), None)
        for run_dir in run_dirs[len(analyses):] if analysis is None else ():
            analysis = analyze_run(run_dir)
            if analysis.breakdown is not None:
                break
        recs = analysis.recommendations if analysis is not None else ()
        rows = tuple({"rank": r.priority, "name": r.title, "config_patch": r.config_patch} for r in recs)
        skipped = [f"#{r.priority} {r.title}: no config knob (a code change)" for r in recs if not r.config_patch]
        trials = advisor_params([row for row in rows if row["config_patch"]], space,
                                exclude=[*exclude, *enqueued], skipped=skipped, script=script_values(run_dirs))
        by_rank = {r.priority: r for r in recs}
        for rank, params in trials:
            gain = by_rank[rank].expected_gain
            study.enqueue_trial(params, user_attrs={"role": "recommendation", "recommendation": by_rank[rank].title,
                                                    "expected_gain_pct": [gain.low_pct, gain.high_pct]})
        study.set_user_attr("recommendations", {
            "run_dir": analysis.run_dir if analysis is not None else None,
            "enqueued": [{"priority": rank, "title": by_rank[rank].title, "params": params,
                          "basis": by_rank[rank].expected_gain.basis} for rank, params in trials],
            "skipped": skipped,
            "asked": _asked(rows, space),
        })
        enqueued += [params for _, params in trials]
    except Exception as exc:  # noqa: BLE001 - recommendations only seed the search; they must not stop it
        _log.warning("recommendations not enqueued: %s: %s", type(exc).__name__, exc)
    return enqueued
