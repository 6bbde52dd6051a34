"""The proxy benchmark's tail figures from per-call latencies and end times (no proxy needed)."""

from __future__ import annotations

from brigade_bench.proxy import _longest_slow_stretch_s


def test_slow_stretch_counts_consecutive_windows_by_call_start():
    # calls placed by their start (end - latency): starts 1.05, 1.15, 1.25 (windows 10, 11, 12) are
    # slow, 1.55 is not, 2.05 (window 20) is slow alone
    ms = [30.0, 40.0, 26.0, 5.0, 50.0, 1.0]
    ends = [1.08, 1.19, 1.276, 1.555, 2.10, 3.051]
    assert _longest_slow_stretch_s(ms, ends, 25.0) == 0.3
    assert _longest_slow_stretch_s(ms, ends, 45.0) == 0.1      # only the 50 ms call is over
    assert _longest_slow_stretch_s(ms, ends, 100.0) == 0.0     # none over
    # a slow call that ended in a later window counts where it started
    assert _longest_slow_stretch_s([90.0, 30.0], [1.14, 1.28], 25.0) == 0.1   # starts 1.05, 1.25: windows 10, 12 apart
    assert _longest_slow_stretch_s([90.0, 30.0], [1.24, 1.25], 25.0) == 0.2   # starts 1.15 and 1.22: windows 11, 12
