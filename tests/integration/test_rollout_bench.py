"""Smoke test of `brigade bench rollout`'s two halves at one round each (the figures are not checked:
this machine's timings are not the benchmark's business)."""

from __future__ import annotations

import pytest

from brigade_bench import rollout as bench


@pytest.mark.asyncio(loop_scope="session")
async def test_adapter_half(s3_bucket_url):
    out = await bench._adapter_bench(s3_bucket_url, rounds=1)
    assert out["adapter_params_m"] == pytest.approx(16.8, abs=0.1)   # rank 16 x q/k/v/o x 32 layers of 4096
    assert 31 < out["adapter_mib"] < 35
    for key in ("fetch_ms", "raw_fetch_ms", "fetch_ratio", "decode_ms", "swap_ms", "load_ms"):
        assert out[key] > 0


def test_generate_half():
    out = bench._generate_bench(rounds=1, prompts_n=2, group=4, max_new_tokens=4)
    assert out["same_completions_as_plain"] is True   # same seed, same tokens: the ratio is pure overhead
    assert out["generate_ratio"] > 0 and out["hf_samples_per_s"] > 0 and out["generate_rows"] == 8
