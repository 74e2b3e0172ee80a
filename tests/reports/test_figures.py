"""Figure info functions over the fixture runs: downsampling, warm-up, stragglers, drawing."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from torsh_tune.analysis import PHASES, load_run
from torsh_tune.reports import figures as F

DATA = Path(__file__).resolve().parents[1] / "data"
SCENARIOS = ("healthy", "data_bound", "comm_bound", "straggler")


def test_downsample_keeps_min_and_max_of_every_bucket():
    rng = np.random.default_rng(1)
    y = rng.normal(1.0, 0.1, 10_000)
    y[1234], y[8765] = 50.0, -7.0  # spikes must survive
    d = F.downsample(np.arange(10_000), y, max_points=2000)
    assert len(d.x) <= 2000 and d.bucket_size == 5
    assert max(d.y_max) == 50.0 and min(d.y_min) == -7.0
    assert all(lo <= med <= hi for lo, med, hi in zip(d.y_min, d.y_median, d.y_max))
    assert d.x[:3] == (0.0, 5.0, 10.0)
    short = F.downsample([3, 4], [1.0, 2.0], max_points=2000)
    assert short.bucket_size == 1 and short.y_min == short.y_max == (1.0, 2.0)


def _big_frames(num_steps: int, num_ranks: int, warmup: int, slow_rank: int):
    frames = load_run(DATA / "healthy")
    step = np.repeat(np.arange(num_steps), num_ranks)
    rank = np.tile(np.arange(num_ranks), num_steps)
    step_s = np.where(rank == slow_rank, 0.15, 0.10) + (step == 31_337) * 2.0
    n = len(step)
    steps = pd.DataFrame({c: np.zeros(n) for c in frames.steps.columns})
    steps["rank"], steps["step"], steps["step_s"] = rank, step, step_s
    steps["t_start"] = 1.76e9 + step * 0.15
    steps["t_end"] = steps["t_start"] + step_s
    steps["forward_s"] = step_s / 2
    steps["samples"] = 32
    steps["loss"] = np.where(step % 10 == 0, 1.0 / (1 + step), np.nan)
    steps["warmup"] = step < warmup
    return frames.__class__(**{**frames.__dict__, "steps": steps, "comm": frames.comm.iloc[0:0],
                               "system": frames.system.iloc[0:0], "ranks": tuple(range(num_ranks)),
                               "world_size": num_ranks})


def test_step_series_of_a_long_run_is_downsampled_and_keeps_the_spike_and_warmup():
    frames = _big_frames(100_000, 8, warmup=5, slow_rank=3)
    info = F.get_step_series_info(frames, max_points=2000)
    assert len(info.step) <= 2000 and info.num_steps == 100_000
    assert max(info.step_max_s) == pytest.approx(2.15)  # the one slow step (slow rank + 2 s) survives
    assert min(info.step_min_s) == pytest.approx(0.15)  # global step = slowest rank
    assert info.warmup_end_step == 4 and info.warmup[0] and not any(info.warmup[1:])
    assert info.throughput_samples_s[1] == pytest.approx(8 * 32 / 0.15)
    heat = F.get_rank_heatmap_info(frames, max_columns=400)
    assert len(heat.step) <= 400 and heat.ranks == tuple(range(8))
    assert heat.lateness_basis == "compute"
    # The slow rank is the bright row of both heatmaps.
    row_means = [np.nanmean(row) for row in heat.lateness_s]
    assert int(np.argmax(row_means)) == 3
    loss = F.get_loss_info(frames, max_points=2000)
    assert len(loss.step) <= 2000 and loss.loss_max[0] == 1.0


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_info_of_fixture_runs(scenario):
    frames = load_run(DATA / scenario)
    steps = F.get_step_series_info(frames)
    assert steps.bucket_size == 1 and steps.num_steps == frames.steps["step"].nunique()
    assert steps.warmup_end_step == int(frames.steps.loc[frames.steps["warmup"], "step"].max())
    assert steps.step_median_s == tuple(frames.steps.groupby("step")["step_s"].max())

    bd = F.get_breakdown_info(frames)
    assert list(bd.phases_s) == list(PHASES)
    stacked = np.sum([bd.phases_s[p] for p in PHASES], axis=0)
    mean_step = frames.steps.groupby("step")["step_s"].mean().to_numpy()
    assert stacked == pytest.approx(mean_step, rel=1e-6)

    tl = F.get_comm_timeline_info(frames)
    assert len(tl.steps) == 3 and set(tl.step) <= set(tl.steps) and set(tl.rank) == set(frames.ranks)
    assert all(s >= -1e-9 for s in tl.start_s)

    ov = F.get_overlap_info(frames)
    assert all(0.0 <= v <= 100.0 for v in ov.overlap_pct if not math.isnan(v))

    res = F.get_resource_info(frames)
    assert [s.rank for s in res.per_rank] == list(frames.ranks) and not res.has_gpu


def test_the_breakdown_figure_shows_a_steps_evaluation_and_checkpoint_out_of_its_other():
    frames = load_run(DATA / SCENARIOS[0])
    steps = frames.steps
    last = int(steps["step"].max())
    # The last step held an evaluation pass of half its time and a save of a tenth (on every rank).
    at = steps["step"] == last
    planted = steps.assign(eval_s=(0.5 * steps["step_s"]).where(at), checkpoint_s=(0.1 * steps["step_s"]).where(at))
    plain = F.get_breakdown_info(frames)
    bd = F.get_breakdown_info(dataclasses.replace(frames, steps=planted))
    assert list(bd.phases_s) == [*PHASES[:-1], "evaluation", "checkpoint", "other"]
    stacked = np.sum([bd.phases_s[p] for p in bd.phases_s], axis=0)
    assert stacked == pytest.approx(steps.groupby("step")["step_s"].mean().to_numpy(), rel=1e-6)
    mean_step = steps.loc[at, "step_s"].mean()
    assert bd.phases_s["evaluation"][-1] == pytest.approx(min(0.5 * mean_step, plain.phases_s["other"][-1]))
    assert bd.phases_s["evaluation"][:-1] == (0.0,) * (len(bd.step) - 1)
    assert bd.phases_s["other"][-1] == pytest.approx(
        plain.phases_s["other"][-1] - bd.phases_s["evaluation"][-1] - bd.phases_s["checkpoint"][-1])
    fig = F.plot_breakdown(bd)
    assert [t.name for t in fig.data][-3:] == ["evaluation", "checkpoint saves", "other"]


def test_straggler_fixture_is_the_bright_row_of_the_lateness_heatmap():
    frames = load_run(DATA / "straggler")
    heat = F.get_rank_heatmap_info(frames)
    assert heat.lateness_basis == "comm"
    medians = [float(np.nanmedian(row)) for row in heat.lateness_s]
    assert heat.ranks[int(np.argmax(medians))] == 2  # the planted straggler
    assert max(medians) > 10 * sorted(medians)[-2]


def test_build_figures_draws_every_figure_and_empty_runs_say_no_data():
    figs = F.build_figures(load_run(DATA / "straggler"))
    assert list(figs) == list(F.FIGURE_TITLES)
    assert all(len(f.data) > 0 for f in figs.values())
    assert figs["rank_heatmap"].data[0].type == "heatmap"
    crashed = F.build_figures(load_run(DATA / "crashed" / "no-such-dir"))
    assert all(any(a.text.startswith("no ") for a in f.layout.annotations) for f in crashed.values())


def test_lateness_does_not_depend_on_the_order_of_comm_records():
    frames = load_run(DATA / "straggler")
    shuffled = frames.__class__(**{**frames.__dict__, "comm": frames.comm.sample(frac=1.0, random_state=3)})
    assert F.get_rank_heatmap_info(shuffled) == F.get_rank_heatmap_info(frames)


def test_comm_timeline_picks_the_newest_measured_steps_however_far_back():
    frames = load_run(DATA / "healthy")
    steps = frames.steps.copy()
    steps["warmup"] = steps["step"] >= 3  # only steps 0-2 measured, far behind the newest collectives
    shifted = frames.__class__(**{**frames.__dict__, "steps": steps})
    assert F.get_comm_timeline_info(shifted).steps == (0, 1, 2)
    assert F.get_comm_timeline_info(shifted, num_steps=1).steps == (2,)  # the first window (4 steps) holds none
    none_measured = frames.__class__(**{**frames.__dict__, "steps": steps.assign(warmup=True)})
    newest = sorted(set(frames.comm["step"]))[-3:]
    assert F.get_comm_timeline_info(none_measured).steps == tuple(newest)
    assert F.get_comm_timeline_info(frames, num_steps=0).steps == ()


def test_study_figures_name_the_objectives_unit():
    import dataclasses

    from torsh_tune.reports import get_tuning_info

    info = get_tuning_info(DATA / "study_pareto")
    assert F.plot_optimization_history(F.get_optimization_history_info(info)).layout.yaxis.title.text == "samples/s"
    tokens = dataclasses.replace(info, study={**info.study, "unit": "tokens/s"})
    assert F.plot_optimization_history(F.get_optimization_history_info(tokens)).layout.yaxis.title.text == "tokens/s"
    assert F.plot_parallel_coordinates(F.get_parallel_coordinates_info(tokens)).data[0].dimensions[-1].label == "tokens/s"
    assert F.plot_pareto_front(F.get_pareto_front_info(tokens)).layout.yaxis.title.text == "tokens/s"
