"""`brigade bench real`'s time to the same held-out accuracy: the target is the best accuracy both
runs reached, and each run's time is when it first published a version scoring that much."""

from brigade_bench.real import time_to_target


def test_the_target_is_what_both_reached_and_each_time_is_its_first_version_there():
    # async peaks at 0.9, sync at 0.8: the target is 0.8; async passes it at v6, sync at v9
    curve_async = {3: 0.5, 6: 0.85, 9: 0.9}
    curve_sync = {3: 0.4, 6: 0.7, 9: 0.8}
    published_async = {3: 40.0, 6: 70.0, 9: 100.0}
    published_sync = {3: 50.0, 6: 95.0, 9: 140.0}
    r = time_to_target(curve_async, curve_sync, published_async, published_sync)
    assert r["target_heldout"] == 0.8
    assert (r["async_version_at_target"], r["sync_version_at_target"]) == (6, 9)
    assert (r["async_time_to_target_s"], r["sync_time_to_target_s"]) == (70.0, 140.0)
    assert r["async_over_sync_speedup"] == 2.0


def test_a_run_that_dipped_is_timed_at_its_first_crossing_and_an_empty_curve_gives_no_figure():
    r = time_to_target({2: 0.9, 4: 0.6}, {2: 0.5, 4: 0.9}, {2: 20.0, 4: 40.0}, {2: 30.0, 4: 60.0})
    assert (r["async_time_to_target_s"], r["sync_time_to_target_s"]) == (20.0, 60.0)
    assert time_to_target({}, {2: 0.5}, {}, {2: 1.0})["async_over_sync_speedup"] is None


def test_the_curves_come_out_as_flat_keys_with_each_points_publish_time():
    from brigade_bench.real import flat_curves

    got = flat_curves({False: {5: 0.31234, 10: 0.5}, True: {5: 0.4}},
                      {False: {"published_s": {5: 80.0, 10: 160.0}}, True: {"published_s": {}}})
    assert got == {"heldout_async_v5": 0.3123, "heldout_async_v10": 0.5, "heldout_sync_v5": 0.4,
                   "published_async_v5_s": 80.0, "published_async_v10_s": 160.0, "published_sync_v5_s": None}
    assert not any(isinstance(v, dict) for v in got.values())
