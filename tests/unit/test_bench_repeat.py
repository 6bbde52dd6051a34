"""`--repeat`: every benchmark's runs summarised alike (median, worst run by the figure's name, load
average around each run), and the report's targets judged on the worst run."""

from __future__ import annotations

import math
import os
import time

import pytest

from brigade_bench import notes, repeat, report, targets


def test_which_way_is_better_is_read_off_the_name():
    for key in ("lease_cycles_per_s", "get_mb_s", "speedup", "speedup_fair_assignment", "fleet_to_learner_capacity"):
        assert repeat.better(key) == "higher", key
    for key in ("get_ratio", "overhead_ratio_cpu", "acquire_p99_ms", "wall_s", "async_learner_idle",
                "async_learner_idle_from_go", "throughput_loss", "async_rejection_rate", "denied"):
        assert repeat.better(key) == "lower", key
    for key in ("reward_diff_per_step", "size_mib", "rounds", "staleness_mean"):
        assert repeat.better(key) is None, key


def _runs(*results: dict) -> list[dict]:
    return [{"result": r, "seconds": 1.0, "load_before": (0.5 + i, 0.4, 0.3), "load_after": (1.5 + i, 0.4, 0.3),
             "cpu_probe_ms": 30.0 + i, "net_probe_ms": 25.5, "steal_pct": 2.0 * i} for i, r in enumerate(results)]


def test_summary_is_median_and_worst_with_the_load_of_each_run():
    runs = _runs({"get_ratio": 1.05, "get_mb_s": 300.0, "rounds": 3, "plot": "a.png", "ok": True},
                 {"get_ratio": 1.30, "get_mb_s": 250.0, "rounds": 3, "plot": "b.png", "ok": False},
                 {"get_ratio": 1.01, "get_mb_s": 310.0, "rounds": 3, "plot": "c.png", "ok": True})
    s = repeat.summarize(runs)
    assert s["get_ratio"] == 1.05 and s["get_ratio_worst"] == 1.30          # lower is better: worst = largest
    assert s["get_mb_s"] == 300.0 and s["get_mb_s_worst"] == 250.0          # higher is better: worst = smallest
    assert s["rounds"] == 3 and type(s["rounds"]) is int and "rounds_worst" not in s  # a setting: as given
    assert s["ok"] is True and s["ok_worst"] is False                        # most runs said true; one did not
    assert s["plot"] == "c.png" and s["repeat"] == 3
    assert s["load_before"] == "0.50,1.50,2.50" and s["load_after"] == "1.50,2.50,3.50"
    assert s["cpu_probe_ms"] == "30,31,32" and s["net_probe_ms"] == "25.5,25.5,25.5" and s["steal_pct"] == "0,2,4"
    two = repeat.summarize(runs[:2])
    assert two["rounds"] == 3 and type(two["rounds"]) is int and two["get_ratio"] == 1.175  # mean of the pair
    one = repeat.summarize(runs[:1])
    assert one["get_ratio"] == 1.05 and not any(k.endswith("_worst") for k in one) and one["repeat"] == 1


def test_a_failed_run_is_recorded_and_the_others_still_count(capsys):
    calls = iter([{"x_ms": 2.0}, RuntimeError("boom"), {"x_ms": 4.0}])

    def once(name, quick, out_dir):
        item = next(calls)
        time.sleep(0.05)  # a few of the machine's clock ticks pass during each run
        if isinstance(item, Exception):
            raise item
        return item

    runs = repeat.run_repeated("fake", True, 3, once=once)
    assert [r["result"].get("error") for r in runs] == [None, "RuntimeError: boom", None]
    assert all(r["load_before"] is not None and r["load_after"] is not None for r in runs)
    # the machine's speed before each run: fixed pieces of work, timed (positive, and not absurd)
    assert all(0 < r["cpu_probe_ms"] < 60_000 and 0 < r["net_probe_ms"] < 60_000 for r in runs)
    # and the hypervisor's share of the machine during each: a percentage read off /proc/stat
    assert all(0 <= r["steal_pct"] <= 100 for r in runs)
    s = repeat.summarize(runs)
    assert len(s["steal_pct"].split(",")) == 3
    assert s["x_ms"] == 3.0 and s["x_ms_worst"] == 4.0 and s["runs_failed"] == 1 and "boom" in s["error"]
    assert "Traceback" in capsys.readouterr().err


def test_targets_are_judged_on_the_worst_run():
    runs = _runs({"put_ratio": 1.02, "get_ratio": 1.04}, {"put_ratio": 1.08, "get_ratio": 1.21},
                 {"put_ratio": 1.01, "get_ratio": 1.02})
    rows = {r.what.split(",")[0]: r for r in report.evaluate({"bucket": runs})}
    put, get = rows["put 34 MiB"], rows["get 34 MiB with sha256 check"]
    assert put.status == "pass" and put.measured.startswith("1.08x") and "median 1.02x" in put.measured
    assert get.status == "miss" and get.measured.startswith("1.21x") and get.worst_run == "run 2, load 1.50 -> 2.50, steal 2 %"
    # one run without the figure: judged on the others, and the row says so
    partial = report.evaluate({"bucket": [*runs[:1], {"result": {"error": "x"}}]})
    assert partial[0].status == "pass" and "1 of 2 runs" in partial[0].measured
    table = report.render_table(rows.values())
    assert "worst run" in table and "run 2, load 1.50 -> 2.50, steal 2 %" in table
    assert "| 2 | 1.50 0.40 0.30 | 2.50 0.40 0.30 | 31.0 / 25.5 | 2 |" in report.render_runs(runs, repeat.summarize(runs))


def test_a_nan_figure_is_the_worst_run():
    t = targets.TARGETS[0]
    assert math.isnan(t.margin({"put_ratio": float("nan")})) and not t.check({"put_ratio": float("nan")})
    rows = report.evaluate({"bucket": _runs({"put_ratio": 1.0}, {"put_ratio": float("nan")})})
    assert rows[0].status == "miss" and rows[0].worst_run.startswith("run 2")


@pytest.mark.parametrize("strict,value,ok", [(True, 0.10, False), (True, 0.09, True), (False, 1.10, True)])
def test_strict_and_inclusive_bounds(strict, value, ok):
    t = targets.Target("b", "w", targets._const(""), targets._const(""), lambda r: r["v"], targets._num(0.10 if strict else 1.10),
                      strict=strict)
    assert t.check({"v": value}) is ok


def test_the_proxy_p99_is_shown_with_the_floor_of_its_own_run():
    runs = _runs({"one_call_p99_ms": 12.0, "floor_one_call_p99_ms": 2.5, "target_acquire_p99_ms": 25.0},
                 {"one_call_p99_ms": 40.0, "floor_one_call_p99_ms": 31.0, "target_acquire_p99_ms": 25.0},
                 {"one_call_p99_ms": 9.0, "target_acquire_p99_ms": 25.0})  # from before the floor was measured
    def row_of(runs: list[dict]) -> report.Row:
        return next(r for r in report.evaluate({"proxy": runs}) if "one process" in r.what)

    row = row_of(runs)
    # judged on the proxy's figure alone; the floor beside it is the worst run's own, not the median's
    assert row.status == "miss" and row.worst_run.startswith("run 2")
    assert row.measured.startswith("40.0 ms, floor 31.0 ms (median 12.0 ms, floor ")
    assert row_of(runs[2:]).measured == "9.0 ms"


def test_the_two_call_p99_is_shown_with_the_cores_its_phase_used():
    runs = _runs({"acquire_p99_ms": 12.0, "phase_cores": 1.4, "target_acquire_p99_ms": 25.0},
                 {"acquire_p99_ms": 60.0, "phase_cores": 1.95, "target_acquire_p99_ms": 25.0,
                  "floor_acquire_p99_ms": 20.0, "floor_phase_cores": 1.2},
                 {"acquire_p99_ms": 9.0, "target_acquire_p99_ms": 25.0})  # from before the cores were measured
    row = next(r for r in report.evaluate({"proxy": runs}) if r.what.startswith("AcquireLease p99"))
    assert row.status == "miss" and row.worst_run.startswith("run 2")
    assert row.measured.startswith("60.0 ms, phase used 1.95 cores; floor 20.0 ms, 1.20 cores (median 12.0 ms, ")
    figures = {"proxy_cpu_ms_per_cycle": 0.8, "clients_cpu_ms_per_cycle": 0.9, "redis_cpu_ms_per_cycle": 0.3,
               "phase_cores": 1.95, "machine_busy": 0.97, "machine_slow_busy": 0.99, "over_target_share": 0.02,
               "slow_stretch_s": 0.4, "target_acquire_p99_ms": 25.0, "one_call_phase_cores": 1.3,
               "one_call_cpu_ms_per_cycle": 0.7, "one_call_clients_cpu_ms_per_cycle": 0.4,
               "one_call_redis_cpu_ms_per_cycle": 0.25, "one_call_p99_ms": 6.0}
    note = notes.proxy_notes(figures)
    assert f"together 1.95 cores of this machine's {os.cpu_count()}, which was 97 % busy" in note and "1.3 cores" in note
    assert "Against a gRPC server" not in note  # from before the two-call floor was measured
    assert "99 % in the 100 ms windows holding a call over 25 ms (2.0 % of the calls" in note
    quiet = notes.proxy_notes({**figures, "machine_slow_busy": math.nan, "over_target_share": 0.0,
                                "floor_phase_cores": 1.2, "floor_cpu_ms_per_two_call_cycle": 0.64,
                                "floor_acquire_p99_ms": 1.7})
    assert "busy over the phase (no call over 25 ms)" in quiet and "nan" not in quiet
    assert "used 1.2 cores (the server 0.64 ms a cycle: gRPC alone), with a p99 of 1.7 ms" in quiet
    assert notes.proxy_notes({"acquire_p99_ms": 9.0}) == ""
    assert "At 1000 cycles/s offered (757 carried) with two calls" in notes.proxy_notes(
        {**figures, "paced_cycles_per_s": 757.0})


def test_a_p99_stands_only_where_its_phase_carried_the_rate():
    """A machine that could not keep up measured its p99 at a lower rate: a miss, whatever the p99."""
    runs = _runs({"acquire_p99_ms": 12.0, "paced_cycles_per_s": 998.0, "one_call_p99_ms": 8.0,
                  "one_call_paced_cycles_per_s": 999.0, "target_acquire_p99_ms": 25.0, "target_cycles_per_s": 1000},
                 {"acquire_p99_ms": 11.0, "paced_cycles_per_s": 757.0, "one_call_p99_ms": 9.0,
                  "one_call_paced_cycles_per_s": 955.0, "target_acquire_p99_ms": 25.0, "target_cycles_per_s": 1000})
    rows = report.evaluate({"proxy": runs})
    two = next(r for r in rows if r.what.startswith("AcquireLease p99"))
    assert two.status == "miss" and two.worst_run.startswith("run 2")
    assert two.measured.startswith("11.0 ms; carried only 757 of the 1000 cycles/s (median ")
    one = next(r for r in rows if "one process" in r.what)  # 955 of 1000 is within the 95 % it takes
    assert one.status == "pass" and "carried" not in one.measured
    assert next(r for r in report.evaluate({"proxy": runs[:1]}) if r.what.startswith("AcquireLease p99")).status == "pass"
