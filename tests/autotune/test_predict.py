"""The communication model's step predictions and the warm-start candidates (no launches)."""

from __future__ import annotations

import math
from pathlib import Path

import optuna
import pytest

from torsh_tune.autotune import build_space, model_candidates, predict_ddp_step, step_inputs
from torsh_tune.config import LaunchConfig, RunConfig
from torsh_tune.errors import ConfigError
from torsh_tune.fabric import AlphaBeta, CommModel

optuna.logging.set_verbosity(optuna.logging.WARNING)

COMM_BOUND = Path(__file__).resolve().parents[1] / "data" / "recorded" / "comm_bound"
MIB = 1 << 20


def _fit(collective: str, *, alpha_s: float, beta: float, group_size: int = 2, level: str = "intra") -> AlphaBeta:
    return AlphaBeta(collective=collective, level=level, group_size=group_size, alpha_s=alpha_s,
                     beta_s_per_byte=beta, num_points=4)


def _model(alpha_s: float = 1e-3, beta: float = 1e-8) -> CommModel:
    """2 ranks, one node: an all-reduce of S bytes takes alpha + S * beta (bus factor 1)."""
    return CommModel(world_size=2, nnodes=1, nproc_per_node=2,
                     fits=(_fit("all_reduce", alpha_s=alpha_s, beta=beta),
                           _fit("all_gather", alpha_s=alpha_s, beta=beta)))


def _predict(model: CommModel, **kw):
    args = {"grad_bytes": 10 * MIB, "num_tensors": 1, "backward_s": 0.2, "other_s": 0.1, "world_size": 2,
            "nnodes": 1, "params": {}}
    args.update(kw)
    return predict_ddp_step(model, **args)


def test_one_bucket_is_reduced_after_backward():
    p = _predict(_model())
    t = 1e-3 + 10 * MIB * 1e-8  # 0.105857 s
    assert p.bucket_bytes == (10 * MIB,) and p.num_collectives == 1 and p.wire_bytes == 10 * MIB
    assert p.comm_s == pytest.approx(t) and p.exposed_comm_s == pytest.approx(t)
    assert p.step_s == pytest.approx(0.1 + 0.2 + t)
    assert p.notes == ()  # nothing left out without compression


def test_several_buckets_overlap_backward_or_queue_behind_each_other():
    t = 1e-3 + 10 * MIB * 1e-8
    params = {"ddp.bucket_cap_mb": 10.0, "ddp.first_bucket_cap_mb": 10.0}
    # Four 10 MiB buckets ready every 0.25 s: each is done before the next is ready.
    overlapped = _predict(_model(), grad_bytes=40 * MIB, num_tensors=4, backward_s=1.0, params=params)
    assert overlapped.bucket_bytes == (10 * MIB,) * 4
    assert overlapped.exposed_comm_s == pytest.approx(t)
    assert overlapped.step_s == pytest.approx(0.1 + 1.0 + t)
    # Ready every 0.025 s: they queue on the one stream, the last finishes at 0.025 + 4 t.
    queued = _predict(_model(), grad_bytes=40 * MIB, num_tensors=4, backward_s=0.1, params=params)
    assert queued.exposed_comm_s == pytest.approx(0.025 + 4 * t - 0.1)
    assert queued.comm_s == pytest.approx(4 * t)
    # One 40 MiB bucket: no overlap at all, the whole all-reduce after backward.
    single = _predict(_model(), grad_bytes=40 * MIB, num_tensors=4, backward_s=1.0,
                      params={"ddp.bucket_cap_mb": 100.0, "ddp.first_bucket_cap_mb": 100.0})
    assert single.bucket_bytes == (40 * MIB,)
    assert single.exposed_comm_s == pytest.approx(1e-3 + 40 * MIB * 1e-8)


def test_buckets_close_on_the_tensor_that_reaches_the_cap():
    tensors = [MIB // 2, 3 * MIB // 5, 3 * MIB, MIB]  # first cap 1 MiB, then 2 MiB
    p = _predict(_model(), grad_bytes=sum(tensors), tensor_bytes=tensors,
                 params={"ddp.bucket_cap_mb": 2.0, "ddp.first_bucket_cap_mb": 1.0})
    assert p.bucket_bytes == (MIB // 2 + 3 * MIB // 5, 3 * MIB, MIB)


def test_fp16_halves_and_int8_quarters_the_wire():
    model = _model(alpha_s=0.0)
    none = _predict(model)
    fp16 = _predict(model, params={"compression.method": "fp16"})
    bf16 = _predict(model, params={"compression.method": "bf16"})
    int8 = _predict(model, params={"compression.method": "int8"})
    assert fp16.comm_s == pytest.approx(none.comm_s / 2) and fp16.wire_bytes == 5 * MIB
    assert bf16.comm_s == pytest.approx(fp16.comm_s)
    # int8: the 4-byte scale, then the int8 payload: two collectives.
    assert int8.num_collectives == 2 and int8.wire_bytes == 4 + 10 * MIB // 4
    assert int8.comm_s == pytest.approx((4 + 10 * MIB / 4) * 1e-8)
    assert any("compression compute" in n for n in fp16.notes)


def test_topk_all_gathers_values_and_indices_or_falls_back_to_dense():
    model = _model()
    p = _predict(model, grad_bytes=40 * MIB, params={"compression.method": "topk", "compression.ratio": 0.01})
    k = math.ceil(0.01 * 10 * MIB)
    # bench sizing: the gathered output (2 ranks x 8k bytes), all-gather bus factor (n-1)/n = 1/2
    assert p.wire_bytes == 8 * k
    assert p.comm_s == pytest.approx(1e-3 + 0.5 * 2 * 8 * k * 1e-8)
    dense = _predict(model, grad_bytes=40 * MIB, params={"compression.method": "topk", "compression.ratio": 0.6})
    assert dense.wire_bytes == 40 * MIB and dense.comm_s == pytest.approx(1e-3 + 40 * MIB * 1e-8)


def test_hierarchical_beats_flat_for_large_messages_across_slow_nodes():
    # 2 nodes x 4 ranks; inside a node 10 GB/s, between nodes 0.1 GB/s.
    model = CommModel(world_size=8, nnodes=2, nproc_per_node=4, fits=(
        _fit("all_reduce", alpha_s=6e-5, beta=1e-10, group_size=4, level="intra"),
        _fit("all_reduce", alpha_s=1e-3, beta=1e-8, group_size=8, level="inter"),
    ))
    kw = {"grad_bytes": 256 * MIB, "world_size": 8, "nnodes": 2, "backward_s": 0.0, "other_s": 0.0}
    flat = _predict(model, **kw, params={"collectives.hierarchical": False})
    hier = _predict(model, **kw, params={"collectives.hierarchical": True})
    assert (flat.algorithm, hier.algorithm) == ("ring", "hierarchical")
    s = 256 * MIB
    assert flat.step_s == pytest.approx(1e-3 + 2 * 7 / 8 * s * 1e-8)
    # intra reduce-scatter + all-gather, then the inter all-reduce of a quarter of the data
    assert hier.step_s == pytest.approx(2 * (3 * 1e-5 + 3 / 4 * s * 1e-10) + 2 * (1e-3 / 14) + s / 4 * 1e-8)
    assert hier.step_s < flat.step_s / 5
    # One node: the flag changes nothing.
    one = _predict(model, **{**kw, "nnodes": 1}, params={"collectives.hierarchical": True})
    assert one.algorithm == "ring"


def test_powersgd_and_adaptive_are_not_predicted():
    for method in ("powersgd", "adaptive"):
        with pytest.raises(ConfigError, match=method):
            _predict(_model(), params={"compression.method": method})


def test_step_inputs_of_a_recorded_run():
    inputs = step_inputs(COMM_BOUND)
    assert inputs.grad_bytes == 52576320 and inputs.num_tensors == 7
    assert inputs.world_size == 2 and inputs.nnodes == 1 and inputs.samples_per_step == 8
    # DDP's rebuilt buckets: 16.9 MB of 4 tensors (first cap 1 MiB), 35.7 MB of 3 tensors.
    assert len(inputs.tensor_bytes) == 7 and abs(sum(inputs.tensor_bytes) - inputs.grad_bytes) <= 7
    assert inputs.tensor_bytes[3] == 16916544 - MIB // 2  # the tensor that closed the first bucket
    assert 0 < inputs.backward_s and 0 < inputs.other_s
    assert inputs.backward_s + inputs.other_s < inputs.measured_step_s
    assert inputs.settings["ddp.bucket_cap_mb"] == 25.0 and inputs.settings["compression.method"] == "none"


def _space():
    base = RunConfig(launch=LaunchConfig(nproc_per_node=2))
    return build_space(nproc_per_node=2, cpu_count=8, base=base), base


def test_candidates_on_a_slow_link_are_valid_ranked_trials():
    space, base = _space()
    skipped: list[str] = []
    found = model_candidates(_model(alpha_s=1e-3, beta=1e-8), COMM_BOUND, space, top=3, skipped=skipped)
    assert len(found) == 3
    assert [c.predicted_step_s for c in found] == sorted(c.predicted_step_s for c in found)
    assert len({c.predicted_step_s for c in found}) == 3
    baseline = space.baseline_params()
    study = optuna.create_study(direction="maximize")
    for c in found:
        assert c.params != baseline
        assert c.predicted_speedup == pytest.approx(c.baseline_predicted_step_s / c.predicted_step_s)
        assert c.predicted_speedup > 1.05 and " → " in c.why
        assert all(space.dims[k].contains(v) for k, v in c.params.items())
        space.to_config(base, c.params)  # a valid configuration
        # Enqueued, the trial asks exactly these values (nothing left to the sampler).
        study.enqueue_trial(c.params)
        trial = study.ask()
        assert space.suggest(trial) == {**c.params, **{k: d.value for k, d in space.dims.items() if d.fixed}}
    # At 0.1 GB/s the 50 MiB all-reduce dominates: the sparsest exchange wins.
    assert found[0].params["compression.method"] == "topk" and "topk" in found[0].why
    assert found[0].predicted_speedup > 3
    assert any("powersgd" in s for s in skipped) and any("adaptive" in s for s in skipped)
    # Excluding the best (already enqueued) moves the next one up.
    again = model_candidates(_model(alpha_s=1e-3, beta=1e-8), COMM_BOUND, space, top=1, exclude=[found[0].params])
    assert again[0].params == found[1].params


def test_candidates_stay_inside_a_narrowed_space():
    base = RunConfig(launch=LaunchConfig(nproc_per_node=2))
    spec = {"compression.method": {"choices": ["none", "fp16"]}, "ddp.bucket_cap_mb": {"choices": [25.0, 50.0]},
            "dataloader.num_workers": {"value": 0}}
    space = build_space(nproc_per_node=2, cpu_count=8, base=base, spec=spec)
    found = model_candidates(_model(alpha_s=1e-3, beta=1e-8), COMM_BOUND, space, top=5)
    assert found and all(c.params["compression.method"] == "fp16" for c in found)
    assert {c.params["ddp.bucket_cap_mb"] for c in found} <= {25.0, 50.0}
    assert all("dataloader.num_workers" not in c.params for c in found)  # fixed: not a trial param


def test_nothing_is_returned_when_nothing_is_predicted_faster():
    space, _ = _space()
    # A link so fast that communication is negligible: every candidate predicts the baseline's step.
    assert model_candidates(_model(alpha_s=0.0, beta=1e-15), COMM_BOUND, space) == []
    # A real gain, but below min_gain.
    found = model_candidates(_model(alpha_s=1e-3, beta=1e-8), COMM_BOUND, space, top=1, min_gain=0.05)
    assert found and model_candidates(_model(alpha_s=1e-3, beta=1e-8), COMM_BOUND, space,
                                      min_gain=found[0].predicted_speedup) == []


def test_a_study_that_is_not_ddp_gets_no_candidates():
    base = RunConfig(launch=LaunchConfig(nproc_per_node=2)).apply_patch({"strategy": {"kind": "fsdp"}})
    space = build_space(nproc_per_node=2, cpu_count=8, base=base, api_mode=True)
    skipped: list[str] = []
    assert model_candidates(_model(), COMM_BOUND, space, skipped=skipped) == []
    assert skipped == ["strategy kind fsdp: the model predicts DDP only"]
