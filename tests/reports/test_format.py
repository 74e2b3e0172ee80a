"""Number formatting by unit suffix, and config patches as TOML."""

from __future__ import annotations

import tomllib

import pytest

from torsh_tune.reports import fmt_bytes, fmt_s, fmt_value, gain_text, patch_to_toml


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0, "0 ms"), (4.77e-7, "0.48 µs"), (0.000999, "999 µs"), (0.0009999, "1.00 ms"), (0.0213, "21.3 ms"),
     (0.151, "151 ms"), (1.5, "1.50 s"), (5000.0, "5,000 s"), (None, "–")],
)
def test_fmt_s(seconds, text):
    assert fmt_s(seconds) == text


def test_fmt_bytes_and_values_by_unit_suffix():
    assert fmt_bytes(512) == "512 B"
    assert fmt_bytes(50.1 * 2**20) == "50.1 MiB"
    assert fmt_value("bytes_per_step", 2**30) == "1.00 GiB"
    assert fmt_value("cpu_pct_mean", 95.5) == "95.5 %"
    assert fmt_value("lateness_s", 0.03) == "30.0 ms"
    assert fmt_value("busbw_gbps", 0.168) == "0.168 GB/s"
    assert fmt_value("num_steps", 12000) == "12,000"
    assert fmt_value("ranks", [0, 3]) == "0, 3"
    assert fmt_value("static_graph", True) == "true"


def test_gain_text():
    assert gain_text({"low_pct": 5.0, "high_pct": 20.0}, 0.1) == "5.0–20 % of the step (≈ 5.00 ms–20.0 ms)"
    assert gain_text({"low_pct": 0.0, "high_pct": 24.0}, None) == "0–24 % of the step"
    assert gain_text({"low_pct": 33.0, "high_pct": 33.0}, 0.152) == "33 % of the step (≈ 50.2 ms)"
    # A gain over rare, long steps (a save, an evaluation, a DataLoader's restart): no median step holds it.
    assert gain_text({"low_pct": 35.0, "high_pct": 40.0, "of": "measured"}, 0.02) == "35–40 % of the measured time"


def test_patch_to_toml_round_trips_through_tomllib():
    patch = {"ddp": {"bucket_cap_mb": 12.5, "static_graph": True},
             "dataloader": {"num_workers": 3, "persistent_workers": True},
             "launch": {"env": {"NCCL_ALGO": "Ring"}}}
    text = patch_to_toml(patch)
    assert text.startswith("[ddp]\nbucket_cap_mb = 12.5\nstatic_graph = true\n")
    assert tomllib.loads(text) == patch
    assert patch_to_toml({}) == ""


def test_patch_to_toml_writes_defaults_as_comments():
    text = patch_to_toml({"ddp": {"bucket_cap_mb": None, "static_graph": False}})
    assert "# bucket_cap_mb = (default)" in text
    assert tomllib.loads(text) == {"ddp": {"static_graph": False}}
