"""`brigade bench real`'s curve figures (brigade_bench.curves): each side's versions and seconds to
held-out 0.5 / 0.7 / 0.9, the async-over-sync and async-over-TRL ratios, and the time to the best
accuracy every side reached; and a target judged on the median of the runs."""

from brigade_bench.curves import flat_curves, threshold_ratios, thresholds, time_to_target

CURVES = {"async": {3: 0.5, 6: 0.85, 9: 0.9}, "sync": {3: 0.4, 6: 0.7, 9: 0.8}, "trl": {3: 0.6, 6: 0.95}}
PUBLISHED = {"async": {3: 40.0, 6: 70.0, 9: 100.0}, "sync": {3: 50.0, 6: 95.0, 9: 140.0}, "trl": {3: 60.0, 6: 90.0}}


def test_the_target_is_what_every_side_reached_and_each_time_is_its_first_version_there():
    # async peaks at 0.9, sync at 0.8, TRL at 0.95: the target is 0.8; async passes it at v6, sync at v9, TRL at v6
    r = time_to_target(CURVES, PUBLISHED, ["async"])
    assert r["target_heldout"] == 0.8
    assert (r["async_version_at_target"], r["sync_version_at_target"], r["trl_version_at_target"]) == (6, 9, 6)
    assert (r["async_time_to_target_s"], r["sync_time_to_target_s"], r["trl_time_to_target_s"]) == (70.0, 140.0, 90.0)
    assert r["async_over_sync_speedup"] == 2.0 and r["async_over_trl_speedup"] == round(90 / 70, 3)


def test_a_run_that_dipped_is_timed_at_its_first_crossing_and_an_empty_curve_gives_no_figure():
    r = time_to_target({"async": {2: 0.9, 4: 0.6}, "sync": {2: 0.5, 4: 0.9}},
                       {"async": {2: 20.0, 4: 40.0}, "sync": {2: 30.0, 4: 60.0}}, ["async"])
    assert (r["async_time_to_target_s"], r["sync_time_to_target_s"]) == (20.0, 60.0)
    assert time_to_target({"async": {}, "sync": {2: 0.5}}, {"async": {}, "sync": {2: 1.0}}, ["async"]) == \
        {"target_heldout": None}


def test_each_level_is_timed_per_side_and_a_level_never_reached_gives_none_and_no_ratio():
    r = thresholds(CURVES, PUBLISHED)
    assert (r["async_versions_to_acc70"], r["async_time_to_acc70_s"]) == (6, 70.0)
    assert (r["sync_versions_to_acc70"], r["trl_time_to_acc50_s"]) == (6, 60.0)
    assert r["sync_versions_to_acc90"] is None and r["sync_time_to_acc90_s"] is None
    ratios = threshold_ratios(r, ["async"])
    assert ratios["async_over_sync_versions_to_acc70_ratio"] == 1.0
    assert ratios["async_over_sync_versions_to_acc90_ratio"] is None  # sync never reached 0.9
    assert ratios["async_over_trl_time_to_acc90_ratio"] == round(100 / 90, 3)


def test_an_extra_async_side_gets_the_same_figures():
    curves = CURVES | {"async_tis2": {3: 0.7, 6: 0.9}}
    published = PUBLISHED | {"async_tis2": {3: 35.0, 6: 65.0}}
    r = threshold_ratios(thresholds(curves, published), ["async", "async_tis2"])
    assert r["async_tis2_over_sync_versions_to_acc70_ratio"] == 0.5
    assert time_to_target(curves, published, ["async", "async_tis2"])["async_tis2_over_trl_speedup"] is not None


def test_the_curves_come_out_as_flat_keys_with_each_points_publish_time():
    got = flat_curves({"async": {5: 0.31234, 10: 0.5}, "sync": {5: 0.4}},
                      {"async": {5: 80.0, 10: 160.0}, "sync": {}})
    assert got == {"heldout_async_v5": 0.3123, "heldout_async_v10": 0.5, "heldout_sync_v5": 0.4,
                   "published_async_v5_s": 80.0, "published_async_v10_s": 160.0, "published_sync_v5_s": None}
    assert not any(isinstance(v, dict) for v in got.values())


def test_a_median_target_is_judged_on_the_median_run_not_the_worst():
    from brigade_bench.report import TARGETS, evaluate

    runs = [{"result": {"async_over_sync_versions_to_acc70_ratio": x}} for x in (1.0, 1.2, 3.0)]
    row = next(r for r in evaluate({"real": runs}, [t for t in TARGETS if t.bench == "real"])
               if "versions to held-out 0.7" in r.what)
    assert row.status == "pass" and "median 1.20x" in row.measured and "3 runs" in row.worst_run


def test_the_staleness_summary_compares_each_async_side_with_sync_and_trl_of_its_run():
    from brigade_bench.staleness import summary

    def line(side, curve, published):
        return {"tag": "r1", "side": side, "curve": curve, "published_s": published, "s_per_step": 30.0,
                "load_before": "1.0 1.0 1.0", "load_after": "1.5 1.0 1.0"}

    text = summary([
        line("async", {"2": 0.6, "4": 0.95}, {"2": 60.0, "4": 120.0}),
        line("sync", {"2": 0.75, "4": 0.92}, {"2": 70.0, "4": 140.0}),
        line("trl", {"2": 0.8, "4": 0.9}, {"2": 50.0, "4": 100.0}),
    ])
    assert "| async / sync, versions to 0.7 | 2.00 | 2.00 |" in text  # 0.7 at v4 against v2
    assert "| async / TRL, seconds to 0.9 | 1.20 | 1.20 |" in text   # 120 s against 100 s
    assert "| sync | r1 | 2 / 70 s | 2 / 70 s | 4 / 140 s | 0.920 |" in text
