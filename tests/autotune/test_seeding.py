"""The strategy advisor's candidates as enqueued trials: translation into the space, and the seeding."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import optuna

from torsh_tune.autotune import advisor_params, build_space
from torsh_tune.autotune.seeding import asked_for, seed_study
from torsh_tune.config import RunConfig
from torsh_tune.strategies.advisor import advice_table, advise

optuna.logging.set_verbosity(optuna.logging.WARNING)

RECORDED = Path(__file__).resolve().parents[1] / "data" / "recorded"


def _row(rank, name, patch):
    return {"rank": rank, "name": name, "config_patch": patch}


def test_ddp_compression_candidates_become_complete_trial_params():
    space = build_space(nproc_per_node=2, cpu_count=8)
    rows = [
        _row(1, "ddp + powersgd compression",
             {"strategy": {"kind": "ddp"}, "compression": {"method": "powersgd"},
              "training": {"lr_scaling": "linear", "lr_warmup_steps": 100}}),
        _row(2, "ddp + fp16 compression", {"strategy": {"kind": "ddp"}, "compression": {"method": "fp16"}}),
        _row(3, "ddp + topk", {"strategy": {"kind": "ddp"}, "compression": {"method": "topk", "ratio": 0.05}}),
    ]
    skipped: list[str] = []
    out = advisor_params(rows, space, skipped=skipped)
    assert [rank for rank, _ in out] == [1, 2, 3] and skipped == []
    base = space.baseline_params()
    powersgd = out[0][1]
    # The PyTorch defaults, the advised method, and PowerSGD's own knobs at their defaults.
    assert powersgd == {**base, "compression.method": "powersgd", "compression.rank": 4, "compression.start_iter": 10}
    assert out[1][1] == {**base, "compression.method": "fp16"}
    assert out[2][1] == {**base, "compression.method": "topk", "compression.ratio": 0.05}
    for _, params in out:
        RunConfig().apply_patch(space.patch_of(params))  # valid configurations


def test_candidates_the_zero_code_space_cannot_run_are_skipped_with_a_reason():
    space = build_space(nproc_per_node=4, cpu_count=8)
    rows = advice_table(advise(num_params=300_000_000, world_size=8, nnodes=2, link_gbps=5.0, gpus=True,
                               device_memory_bytes=80 * 10**9))
    skipped: list[str] = []
    out = advisor_params(rows, space, skipped=skipped)
    assert [(rank, params["compression.method"]) for rank, params in out] == [(1, "powersgd")]
    text = "\n".join(skipped)
    for kind in ("hsdp", "fsdp", "pipeline"):
        assert f"strategy kind '{kind}' needs torsh_tune.parallelize" in text
    # The hierarchical all-reduce is searched only across nodes.
    assert "#2 ddp + hierarchical all-reduce: collectives.hierarchical is not searched here (one node" in text
    assert "collectives.hierarchical" in text


def test_values_outside_a_narrowed_space_and_duplicates_are_skipped():
    fp16 = _row(1, "ddp + fp16 compression", {"strategy": {"kind": "ddp"}, "compression": {"method": "fp16"}})
    plain = _row(2, "ddp", {"strategy": {"kind": "ddp"}})
    again = _row(3, "ddp + fp16 compression", {"strategy": {"kind": "ddp"}, "compression": {"method": "fp16"}})
    narrowed = build_space(nproc_per_node=2, cpu_count=8, spec={"compression.method": {"choices": ["none", "bf16"]}})
    skipped: list[str] = []
    assert advisor_params([fp16], narrowed, skipped=skipped) == []
    assert "compression.method = 'fp16' lies outside the search space" in skipped[0]

    fixed = build_space(nproc_per_node=2, cpu_count=8, spec={"compression.method": {"value": "none"}})
    assert advisor_params([fp16], fixed) == []
    off = build_space(nproc_per_node=2, cpu_count=8, include_compression=False)
    skipped = []
    assert advisor_params([fp16], off, skipped=skipped) == [] and "not searched here" in skipped[0]

    space = build_space(nproc_per_node=2, cpu_count=8)
    skipped = []
    assert [rank for rank, _ in advisor_params([fp16, plain, again], space, skipped=skipped)] == [1]
    assert len(skipped) == 2
    # Parameter sets the user already enqueued are not enqueued twice.
    user = {"compression.method": "fp16"}
    assert advisor_params([fp16], space, exclude=[user]) == []


def test_a_knob_that_needs_the_scripts_workers_is_seeded_with_them():
    """`persistent_workers` alone (keep the workers the script starts every epoch): laid over PyTorch's
    0 workers it would not be asked at all; with the script's own workers it is the trial the finding means."""
    keep = _row(1, "Keep the DataLoader's workers between epochs", {"dataloader": {"persistent_workers": True}})
    space = build_space(nproc_per_node=2, cpu_count=8)
    skipped: list[str] = []
    assert advisor_params([keep], space, skipped=skipped) == []
    assert "the same trial as the PyTorch defaults" in skipped[0]
    [(rank, params)] = advisor_params([keep], space, script={"dataloader.num_workers": 2})
    assert rank == 1 and params["dataloader.num_workers"] == 2 and params["dataloader.persistent_workers"] is True
    assert params["dataloader.prefetch_factor"] == 2  # the condition's other dimension at its default
    config = space.to_config(RunConfig(), params)
    assert (config.strategy.dataloader.num_workers, config.strategy.dataloader.persistent_workers) == (2, True)
    # A patch that names the workers keeps its own; a script without workers, or a space that fixes them, adds none.
    both = _row(2, "Load data in 3 workers", {"dataloader": {"num_workers": 3, "persistent_workers": True}})
    [(_, params)] = advisor_params([both], space, script={"dataloader.num_workers": 2})
    assert params["dataloader.num_workers"] == 3
    assert advisor_params([keep], space, script={"dataloader.num_workers": 0}) == []
    fixed = build_space(nproc_per_node=2, cpu_count=8, spec={"dataloader.num_workers": {"value": 0}})
    assert advisor_params([keep], fixed, script={"dataloader.num_workers": 2}) == []


def _baseline_run(tmp_path, *, reference_busbw_gbps=None):
    run = tmp_path / "baseline" / "00"
    shutil.copytree(RECORDED / "comm_bound", run)
    if reference_busbw_gbps is not None:
        info = json.loads((run / "run.json").read_text())
        info["reference_busbw_gbps"] = reference_busbw_gbps
        (run / "run.json").write_text(json.dumps(info))
    return run


def test_seeding_enqueues_advisor_trials_after_the_defaults_once(tmp_path):
    # 0.5 GB/s measured by a bench = 4 Gbit/s: the advisor ranks DDP + fp16 first for 13 M params.
    run = _baseline_run(tmp_path, reference_busbw_gbps=0.5)
    space = build_space(nproc_per_node=2, cpu_count=8)
    study = optuna.create_study(direction="maximize")
    seed_study(study, space, [str(run)], [{"ddp.bucket_cap_mb": 50.0}])

    trials = study.get_trials(deepcopy=False)
    # The baseline's sized recommendation (Top-K at the ratio its overlap allows) follows the advisor's.
    assert [t.user_attrs["role"] for t in trials] == ["pytorch-defaults", "initial", "advisor", "recommendation"]
    advisor = trials[2]
    assert advisor.user_attrs["advisor_rank"] == 1 and advisor.user_attrs["advisor_name"] == "ddp + fp16 compression"
    record = study.user_attrs["advisor"]
    assert record["enqueued"][0]["params"]["compression.method"] == "fp16"
    assert any("needs torsh_tune.parallelize" in line for line in record["skipped"])
    # The sampler's next asks get the enqueued values, in order.
    for name, expected in (("compression.method", "none"), ("ddp.bucket_cap_mb", 50.0),
                           ("compression.method", "fp16")):
        trial = study.ask()
        assert space.suggest(trial)[name] == expected
        study.tell(trial, 1.0)

    # A resumed study (it has trials) enqueues nothing again.
    seed_study(study, space, [str(run)], [])
    assert len(study.trials) == 4


def test_seeding_without_usable_advice_enqueues_only_the_defaults(tmp_path, caplog):
    run = _baseline_run(tmp_path)  # no link speed: plain DDP, the same as the defaults
    space = build_space(nproc_per_node=2, cpu_count=8)
    study = optuna.create_study(direction="maximize")
    seed_study(study, space, [str(tmp_path / "missing"), str(run)], [])
    assert [t.user_attrs["role"] for t in study.trials if t.user_attrs["role"] != "recommendation"] == [
        "pytorch-defaults"]
    assert study.user_attrs["advisor"]["enqueued"] == []

    # A failure of the advisor only warns: the study goes on with trial 0.
    broken = optuna.create_study(direction="maximize")
    with caplog.at_level(logging.WARNING, logger="torsh_tune.autotune.study"):
        seed_study(broken, space, None, [])  # type: ignore[arg-type]  # not iterable
    assert [t.user_attrs["role"] for t in broken.trials] == ["pytorch-defaults"]
    assert "strategy advisor candidates not enqueued: TypeError" in caplog.text


def test_a_study_without_compression_gets_no_compression_candidate(tmp_path):
    run = _baseline_run(tmp_path, reference_busbw_gbps=0.5)
    space = build_space(nproc_per_node=2, cpu_count=8, include_compression=False)
    study = optuna.create_study(direction="maximize")
    seed_study(study, space, [str(run)], [])
    assert len(study.trials) == 1
    assert any("compression.method is not searched here" in line for line in study.user_attrs["advisor"]["skipped"])


def test_the_bench_model_s_predicted_best_follow_the_advisor_s_candidates():
    """With a bench model of a slow link, its fastest predicted settings are enqueued last (role "model")."""
    from torsh_tune.fabric import AlphaBeta, CommModel

    def fit(collective):
        return AlphaBeta(collective=collective, level="intra", group_size=2, alpha_s=1e-3,
                         beta_s_per_byte=1.0 / 0.1e9, num_points=4)  # 0.1 GB/s: a shaped 1 Gbit/s link

    model = CommModel(world_size=2, nnodes=1, nproc_per_node=2, fits=(fit("all_reduce"), fit("all_gather")))
    space = build_space(nproc_per_node=2, cpu_count=8)
    study = optuna.create_study(direction="maximize")
    seed_study(study, space, [str(RECORDED / "comm_bound")], [{"ddp.bucket_cap_mb": 50.0}],
                comm_model=model, reference_bench="bench-run")
    roles = [t.user_attrs["role"] for t in study.trials]
    assert roles[:2] == ["pytorch-defaults", "initial"] and roles.count("model") >= 1
    assert roles.index("model") > max(i for i, r in enumerate(roles) if r != "model")  # after the advisor's
    record = study.user_attrs["model"]
    assert record["bench"] == "bench-run" and len(record["enqueued"]) == roles.count("model")
    for trial, entry in zip([t for t in study.trials if t.user_attrs["role"] == "model"], record["enqueued"]):
        assert trial.user_attrs["predicted_speedup"] == entry["predicted_speedup"] > 1.05
        assert entry["predicted_step_s"] < entry["baseline_predicted_step_s"] and entry["why"]
        assert space.to_config(RunConfig(), entry["params"])  # a valid configuration of this space
    assert any("powersgd" in line for line in record["skipped"])  # what the model cannot predict, said
    # Distinct from everything enqueued before them.
    keys = [json.dumps(t.system_attrs["fixed_params"], sort_keys=True) for t in study.trials]
    assert len(keys) == len(set(keys))


def test_the_knobs_asked_for_are_those_named_and_those_the_seeded_trials_change():
    """The ablation's suspects: a recommendation's knob counts even when its trial was left out."""
    space = build_space(nproc_per_node=2, cpu_count=8)
    study = optuna.create_study(direction="maximize")
    assert asked_for(study, space) == set()  # nothing seeded: every change is tested alone
    study.set_user_attr("recommendations", {"enqueued": [], "asked": ["dataloader.num_workers"],
                                            "skipped": ["#1 ...: dataloader.num_workers = 7 lies outside"]})
    study.set_user_attr("model", {"enqueued": [{"params": {**space.baseline_params(), "ddp.bucket_cap_mb": 5.0}}]})
    study.set_user_attr("advisor", {"enqueued": [{"params": space.baseline_params()}], "asked": []})
    assert asked_for(study, space) == {"dataloader.num_workers", "ddp.bucket_cap_mb"}
