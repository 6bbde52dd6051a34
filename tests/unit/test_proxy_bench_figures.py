"""The proxy benchmark's tail figures from per-call latencies and end times (no proxy needed)."""

from __future__ import annotations

from brigade_bench.proxy import _longest_slow_stretch_s, _machine_during
from brigade_bench.system import Ticks, machine_ticks, shares


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


def test_machine_during_splits_the_timed_windows_by_slow_calls():
    # windows 9..13 sampled; the timed calls start in windows 10..12 and end by 1.3 s; the slow one
    # starts in window 11. Window 9 (clients starting) and 13 (after the last end) are not timed.
    windows = {9: (0.1, 0.0), 10: (0.6, 0.0), 11: (0.9, 0.2), 12: (0.7, 0.1), 13: (0.1, 0.0)}
    ms, ends = [5.0, 60.0, 4.0], [1.06, 1.2, 1.25]
    m = _machine_during(windows, ms, ends, 25.0)
    assert m["busy"] == round((0.6 + 0.9 + 0.7) / 3, 3) and m["steal"] == 0.1
    assert m["slow_busy"] == 0.9 and m["slow_steal"] == 0.2
    quiet = _machine_during(windows, ms, ends, 100.0)  # no call over the limit: no slow windows
    assert quiet["busy"] == m["busy"] and quiet["slow_busy"] != quiet["slow_busy"]  # NaN
    assert _machine_during(windows, [], [], 25.0) == {}


def test_shares_are_the_busy_and_stolen_parts_of_the_ticks_between_two_readings():
    before, after = Ticks(busy=100, steal=10, total=400), Ticks(busy=180, steal=30, total=600)
    assert shares(before, after) == (0.4, 0.1)
    assert shares(before, None) is None and shares(after, before) is None  # no time passed
    now = machine_ticks()
    assert now is not None and 0 <= now.steal <= now.busy <= now.total   # this machine's own /proc/stat
