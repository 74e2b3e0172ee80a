"""Pipeline parallelism (`torsh_tune.strategies.pipeline`) on real gloo process groups, and its input checks.

One 2-rank torchrun launch trains a small chain model (embed, 8 Linear+Tanh blocks, head)
with every schedule (gpipe and 1f1b with a stage per rank; interleaved1f1b, loopedbfs,
interleavedzb and zbv with two), measures the bubble of a wider model for every schedule
and GPipe at 2 and 8 microbatches, and feeds a batch that does not divide by the
microbatch count. One 4-rank launch runs gpipe and 1f1b over 4 stages
(`tests/data/scripts/strategy_pipeline.py`). Every schedule's first-step gradients are
compared with a single-process reference on the whole batch.

Measured bubbles are only checked for sanity: on a shared 2-core machine they carry
gloo's send/recv time and other processes' load, so they sit well above the theory.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

from torsh_tune.config import PipelineConfig
from torsh_tune.errors import ConfigError
from torsh_tune.strategies.pipeline import build_pipeline, chain_segments, stage_indices_of, theoretical_bubble_pct

from data.scripts._pipeline_model import DEPTH, Net
from helpers import SCRIPTS, torchrun_results

SCRIPT = SCRIPTS / "strategy_pipeline.py"
LAUNCH_TIMEOUT_S = 240
SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "loopedbfs", "interleavedzb", "zbv")
LOOPED = ("interleaved1f1b", "loopedbfs", "interleavedzb", "zbv")
BUBBLE_RUNS = ("gpipe:2", "gpipe:8", "1f1b:8", "interleaved1f1b:8", "loopedbfs:8", "interleavedzb:8", "zbv:8")
PARAM_NAMES = {"embed.weight", "embed.bias", "head.weight", "head.bias",
               *(f"blocks.{i}.0.{k}" for i in range(DEPTH) for k in ("weight", "bias"))}


class _Residual(Net):
    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _build(cfg: PipelineConfig, *, world_size: int = 2, split_points: list[str] | None = None, model=None):
    return build_pipeline(model or Net(), cfg, loss_fn=nn.functional.mse_loss, example_inputs=torch.randn(4, 8),
                          device="cpu", rank=0, world_size=world_size, split_points=split_points)


def _one_line_error(exc: pytest.ExceptionInfo, what: str, value: str) -> None:
    message = str(exc.value)
    assert message.startswith(f"{what} must be ") and message.endswith(f"but got {value}"), message
    assert "\n" not in message


def _launch(tmp_path_factory, name: str, nproc: int, *args: str) -> list[dict]:
    return torchrun_results(SCRIPT, str(tmp_path_factory.mktemp(name) / "out"), nproc, *args, timeout=LAUNCH_TIMEOUT_S)


# -- the split and the theory (fast, no processes) ----------------------------------------------
def test_chain_segments_walk_module_lists_and_sequentials_in_order():
    names = [name for name, _ in chain_segments(Net())]
    assert names[:3] == ["embed", "blocks.0.0", "blocks.0.1"] and names[-1] == "head" and len(names) == 2 + 2 * DEPTH


@pytest.mark.parametrize(
    ("split_points", "world_size", "value"),
    [
        (["blocks.99"], 2, "'blocks.99'"),  # unknown module
        (["blocks.2.0.weight"], 2, "'blocks.2.0.weight'"),  # a parameter, not a module
        (["embed"], 2, "'embed'"),  # stage 0 would be empty
        (["blocks.4", "blocks.2", "blocks.6"], 4, "['blocks.4', 'blocks.2', 'blocks.6']"),  # out of order
        (["blocks.2", "blocks.2.0", "blocks.6"], 4, "['blocks.2', 'blocks.2.0', 'blocks.6']"),  # an empty stage
        (["blocks.2", "blocks.4"], 2, "['blocks.2', 'blocks.4']"),  # 3 stages for 2 ranks x 1
        ([], 2, "[]"),
    ],
)
def test_bad_split_points_are_one_line_errors(split_points, world_size, value):
    with pytest.raises(ConfigError) as exc:
        _build(PipelineConfig(schedule="1f1b", n_microbatches=4), world_size=world_size, split_points=split_points)
    _one_line_error(exc, "pipeline.split_points", value)


def test_wrong_stage_count_names_the_expected_count():
    with pytest.raises(ConfigError, match=r"must be 3 names \(2 ranks x 2 stages per rank = 4 stages\)"):
        _build(PipelineConfig(schedule="interleaved1f1b", n_microbatches=4, stages_per_rank=2),
               split_points=["blocks.4"])


def test_split_points_argument_overrides_the_config():
    cfg = PipelineConfig(schedule="1f1b", n_microbatches=4, split_points=["blocks.99"])
    with pytest.raises(ConfigError, match="but got 'blocks.77'"):
        _build(cfg, split_points=["blocks.77"])
    with pytest.raises(ConfigError, match="but got 'blocks.99'"):
        _build(cfg)


def test_a_model_whose_forward_is_not_its_chain_is_refused():
    with pytest.raises(ConfigError) as exc:
        _build(PipelineConfig(schedule="1f1b", n_microbatches=4), split_points=["blocks.4"], model=_Residual())
    message = str(exc.value)
    assert message.startswith("model must be a chain of its children applied in order")
    assert "torch.distributed.pipelining.pipeline" in message and "\n" not in message


@pytest.mark.parametrize(
    ("cfg", "what", "value"),
    [
        (PipelineConfig(schedule="1f1b", n_microbatches=1), "pipeline.n_microbatches", "1"),  # 1F1B needs m >= stages
        (PipelineConfig(schedule="gpipe", stages_per_rank=2), "pipeline.stages_per_rank", "2"),
        (PipelineConfig(schedule="zbv", stages_per_rank=3), "pipeline.stages_per_rank", "3"),
        (PipelineConfig(schedule="interleaved1f1b", n_microbatches=5, stages_per_rank=1), "pipeline.n_microbatches", "5"),
        (PipelineConfig(schedule="pipedream"), "pipeline.schedule", "'pipedream'"),  # type: ignore[arg-type]
    ],
)
def test_schedule_constraints_are_one_line_errors(cfg, what, value):
    stages = 2 * cfg.stages_per_rank
    splits = [f"blocks.{s * DEPTH // stages}" for s in range(1, stages)]
    with pytest.raises(ConfigError) as exc:
        _build(cfg, split_points=splits)
    _one_line_error(exc, what, value)


def test_stage_placement_is_looped_or_a_v():
    assert stage_indices_of(1, schedule="1f1b", world_size=4, stages_per_rank=1) == [1]
    assert stage_indices_of(1, schedule="interleaved1f1b", world_size=4, stages_per_rank=3) == [1, 5, 9]
    assert stage_indices_of(1, schedule="zbv", world_size=4, stages_per_rank=2) == [1, 6]


def test_theoretical_bubbles():
    def pct(schedule, p, m, v=1):
        return theoretical_bubble_pct(schedule, ranks=p, n_microbatches=m, stages_per_rank=v)[0]

    assert pct("gpipe", 4, 4) == pytest.approx(100 * 3 / 7)
    assert pct("1f1b", 2, 8) == pytest.approx(100 / 9)
    assert pct("interleaved1f1b", 2, 4, 2) == pct("loopedbfs", 2, 4, 2) == pytest.approx(100 / 9)
    assert pct("interleavedzb", 2, 4, 2) == pytest.approx(100 / 25)
    assert pct("zbv", 2, 4, 2) == 0.0
    assert pct("gpipe", 2, 8) < pct("gpipe", 2, 2)


# -- every schedule on 2 ranks -----------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return _launch(tmp_path_factory, "pipeline2", 2, "--schedules", ",".join(SCHEDULES), "--microbatches", "4",
                   "--steps", "10", "--bubble", ",".join(BUBBLE_RUNS), "--bubble-steps", "4", "--check-errors")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict]:
    return _launch(tmp_path_factory, "pipeline4", 4, "--schedules", "gpipe,1f1b", "--microbatches", "4",
                   "--steps", "10")


def _check_training(results: list[dict], schedule: str, *, expected_stages: list[list[int]]) -> None:
    assert [r[schedule]["stats"]["stage_indices"] for r in results] == expected_stages
    # Every parameter lives on exactly one rank, with the single-process gradient.
    compared = [name for r in results for name in r[schedule]["grads_compared"]]
    assert sorted(compared) == sorted(PARAM_NAMES)
    for r in results:
        assert r[schedule]["max_grad_diff"] < 1e-5
    last = [r[schedule] for r in results if r[schedule]["losses"]]
    assert len(last) == 1
    losses = last[0]["losses"]
    assert len(losses) == 10 and losses[0] == pytest.approx(last[0]["ref_loss"], abs=1e-6)
    assert losses[-1] < 0.95 * losses[0] and all(b < a for a, b in zip(losses, losses[1:]))


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_matches_the_single_process_gradients_and_trains(two_ranks, schedule):
    expected = {"zbv": [[0, 3], [1, 2]]}.get(schedule, [[0, 2], [1, 3]] if schedule in LOOPED else [[0], [1]])
    _check_training(two_ranks, schedule, expected_stages=expected)


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_all_schedules_follow_the_same_loss_curve(two_ranks):
    curves = {s: next(r[s]["losses"] for r in two_ranks if r[s]["losses"]) for s in SCHEDULES}
    for schedule, curve in curves.items():
        assert curve == pytest.approx(curves["gpipe"], abs=1e-5), schedule


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stats_report_a_sane_bubble_and_the_theory(two_ranks, schedule):
    v = 2 if schedule in LOOPED else 1
    theory = theoretical_bubble_pct(schedule, ranks=2, n_microbatches=4, stages_per_rank=v)[0]
    for r in two_ranks:
        stats = r[schedule]["stats"]
        assert (stats["stages"], stats["ranks"], stats["microbatches"], stats["stages_per_rank"]) == (2 * v, 2, 4, v)
        assert stats["schedule"] == schedule and stats["steps_measured"] == 9
        # On CPU the host runs the kernels: the host clock is the truth, and it says so.
        assert (stats["clock"], stats["device"], stats["steps_pending"]) == ("host", "cpu", 0)
        assert stats["host_step_s"] == stats["step_s"]
        assert stats["theoretical_bubble_pct"] == pytest.approx(theory)
        assert 0 <= stats["bubble_pct"] < 100
        assert 0 < stats["busy_s"] < stats["step_s"]
        assert len(stats["stage_busy_s"]) == v and all(t > 0 for t in stats["stage_busy_s"])


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_more_microbatches_do_not_grow_the_gpipe_bubble(two_ranks):
    # Theory: 33.3 % at m=2, 11.1 % at m=8. Measured medians are noisy on a shared
    # 2-core machine and each microbatch adds a send/recv: only a generous bound.
    for r in two_ranks:
        m2, m8 = r["bubble.gpipe.m2"]["stats"], r["bubble.gpipe.m8"]["stats"]
        assert m2["theoretical_bubble_pct"] == pytest.approx(100 / 3)
        assert m8["theoretical_bubble_pct"] == pytest.approx(100 / 9)
        assert m8["bubble_pct"] < m2["bubble_pct"] + 30


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("run", BUBBLE_RUNS)
def test_wide_model_bubbles_are_measured_for_every_schedule(two_ranks, run):
    schedule, m = run.split(":")
    for r in two_ranks:
        result = r[f"bubble.{schedule}.m{m}"]
        assert result["max_grad_diff"] < 1e-5
        assert 0 <= result["stats"]["bubble_pct"] < 100 and result["stats"]["steps_measured"] == 3


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_a_batch_that_does_not_divide_by_the_microbatches_is_a_one_line_error(two_ranks):
    for r in two_ranks:
        assert r["errors"]["indivisible_batch"] == (
            "pipeline.n_microbatches must be a divisor of the batch's first dimension (30), but got 4")


# -- four stages on 4 ranks --------------------------------------------------------------------
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_four_stages_on_four_ranks(four_ranks, schedule):
    _check_training(four_ranks, schedule, expected_stages=[[0], [1], [2], [3]])
    for r in four_ranks:
        stats = r[schedule]["stats"]
        assert stats["theoretical_bubble_pct"] == pytest.approx(100 * 3 / 7)
        assert 0 <= stats["bubble_pct"] < 100


# -- the clock of the bubble (no processes) ------------------------------------------------------
def test_host_clock_counts_the_spans_of_each_stage_against_the_step():
    from torsh_tune.strategies.pipeline import _Clock

    clock = _Clock([1, 3], torch.device("cpu"))
    for _ in range(2):
        clock.begin_step()
        with clock.span(1):
            busy_until = time.perf_counter() + 0.02
            while time.perf_counter() < busy_until:
                pass
        clock.timed(lambda: time.sleep(0.01), 3)()
        time.sleep(0.03)  # idle: the bubble
        clock.end_step()
    assert clock.clock == "host" and clock.steps_pending == 0 and len(clock.steps) == 2
    step = clock.steps[-1]
    assert step["stage_busy_s"][0] >= 0.02 and step["stage_busy_s"][1] >= 0.01
    assert step["busy_s"] == pytest.approx(sum(step["stage_busy_s"]))
    assert step["step_s"] >= step["busy_s"] + 0.03 and step["host_step_s"] == step["step_s"]

