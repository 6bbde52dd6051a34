"""The held-out curves of `brigade bench real`, as flat figures: each side's curve is {version:
held-out accuracy} for the versions scored, and {version: seconds from launch} at which that version
existed (a brigade version when the learner published it, a TRL one when its optimizer step ended).

A side reaches a level at the first scored version whose accuracy is at least that level (a curve
that dips afterwards keeps its first crossing); its resolution is the curve's spacing. Every figure
a side never reached is None, and so is every ratio made from one.
"""

from __future__ import annotations

THRESHOLDS = (0.5, 0.7, 0.9)


def level_name(level: float) -> str:
    """0.7 -> "acc70": a flat key has no dot."""
    return f"acc{round(100 * level)}"


def first_reach(curve: dict[int, float], published: dict[int, float], level: float) -> tuple[int | None, float | None]:
    """(version, seconds from launch) of the first scored version at or above `level`."""
    reached = [v for v, x in curve.items() if x >= level]
    if not reached:
        return None, None
    v = min(reached)
    return v, published.get(v)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def flat_curves(curves: dict[str, dict[int, float]], published: dict[str, dict[int, float]]) -> dict:
    """The curves as flat keys (the JSON is one flat object): heldout_async_v3, published_async_v3_s, ..."""
    return {**{f"heldout_{side}_v{v}": round(x, 4) for side, c in curves.items() for v, x in c.items()},
            **{f"published_{side}_v{v}_s": published[side].get(v) for side, c in curves.items() for v in c}}


def thresholds(curves: dict[str, dict[int, float]], published: dict[str, dict[int, float]],
               levels: tuple[float, ...] = THRESHOLDS) -> dict:
    """Per side and level: <side>_versions_to_acc70 and <side>_time_to_acc70_s."""
    out: dict = {}
    for side, curve in curves.items():
        for level in levels:
            v, t = first_reach(curve, published[side], level)
            out[f"{side}_versions_to_{level_name(level)}"] = v
            out[f"{side}_time_to_{level_name(level)}_s"] = t
    return out


def threshold_ratios(reached: dict, asyncs: list[str], levels: tuple[float, ...] = THRESHOLDS) -> dict:
    """For each async side X (the sides that are neither sync nor trl) and level, from thresholds():
    X_over_sync_versions_to_acc70_ratio (versions X needed / sync's: what staleness costs in
    learning per step) and X_over_trl_time_to_acc70_ratio (X's seconds from launch / TRL's)."""
    out: dict = {}
    for side in asyncs:
        for level in levels:
            name = level_name(level)
            out[f"{side}_over_sync_versions_to_{name}_ratio"] = _ratio(
                reached.get(f"{side}_versions_to_{name}"), reached.get(f"sync_versions_to_{name}"))
            out[f"{side}_over_trl_time_to_{name}_ratio"] = _ratio(
                reached.get(f"{side}_time_to_{name}_s"), reached.get(f"trl_time_to_{name}_s"))
    return out


def time_to_target(curves: dict[str, dict[int, float]], published: dict[str, dict[int, float]],
                   asyncs: list[str]) -> dict:
    """The best held-out accuracy every side reached (target_heldout), the version and the seconds
    from launch at which each side first reached it, and for each async side X the speedups
    X_over_sync_speedup and X_over_trl_speedup (the other side's time to the target / X's)."""
    if not curves or not all(curves.values()):
        return {"target_heldout": None}
    target = min(max(c.values()) for c in curves.values())
    out: dict = {"target_heldout": round(target, 4)}
    for side, curve in curves.items():
        v, t = first_reach(curve, published[side], target)
        out[f"{side}_version_at_target"], out[f"{side}_time_to_target_s"] = v, t
    for side in asyncs:
        for other in ("sync", "trl"):
            if other in curves:
                out[f"{side}_over_{other}_speedup"] = _ratio(out[f"{other}_time_to_target_s"],
                                                             out[f"{side}_time_to_target_s"])
    return out
