"""PNG plots of a run: reward (with the evaluator's held-out score), KL, staleness and rejection
rate, each against learner step and against wall clock since launch."""

from __future__ import annotations

from pathlib import Path

CURVES = [("reward_mean", "reward"), ("kl", "KL to reference"), ("staleness_mean", "staleness (versions)"),
          ("rejection_rate", "rejection rate")]


def heldout_score(evaluation: dict) -> float | None:
    """The evaluator's headline number: accuracy for the built-in scorer, else the mean reward."""
    for key in ("accuracy", "reward_mean"):
        if isinstance(evaluation.get(key), int | float):
            return float(evaluation[key])
    return None


def best_version(scores: dict[int, float]) -> tuple[int, float] | None:
    """(version, score) of the best held-out score; the later version on a tie (it trained longer
    for the same score). None when nothing was scored."""
    return max(scores.items(), key=lambda vs: (vs[1], vs[0]), default=None)


def robust_top(values: list[float]) -> float | None:
    """An upper y limit that a couple of spikes cannot set: 1.5x the 95th percentile."""
    finite = sorted(v for v in values if v == v and abs(v) != float("inf"))
    if len(finite) < 10:
        return None
    p95 = finite[int(0.95 * (len(finite) - 1))]
    return 1.5 * p95 if p95 > 0 and finite[-1] > 1.5 * p95 else None


def plot_run(metrics: list[dict], out_dir: Path, title: str = "", evals: list[tuple[int, dict]] = (),
             t0: float | None = None) -> list[Path]:
    """`evals`: (learner step, evaluation) per scored adapter version; `t0`: the launch time, so the
    wall-clock axis covers the whole run, start-up included."""
    import matplotlib

    matplotlib.use("Agg")  # no display here or in containers
    import matplotlib.pyplot as plt

    steps = [m.get("step", i + 1) for i, m in enumerate(metrics)]
    # a resumed run has steps from before this launch: the axis starts at the earliest of the two
    t0 = min([m["time_unix"] for m in metrics if "time_unix" in m] + ([t0] if t0 is not None else []), default=0.0)
    wall = [m.get("time_unix", t0) - t0 for m in metrics]
    wall_at_step = dict(zip(steps, wall, strict=True))
    held = [(step, s) for step, e in evals if (s := heldout_score(e)) is not None]
    paths = []
    for x_name, xs in (("step", steps), ("wall_clock", wall)):
        fig, axes = plt.subplots(1, len(CURVES), figsize=(4 * len(CURVES), 3.4))
        for ax, (key, label) in zip(axes, CURVES, strict=True):
            ys = [m.get(key, float("nan")) for m in metrics]
            ax.plot(xs, ys, lw=1.5, label="train batches")
            if key == "reward_mean" and held:
                hx = [step if x_name == "step" else wall_at_step.get(step, float("nan")) for step, _ in held]
                ax.plot(hx, [s for _, s in held], "o-", ms=3, lw=1.2, label="held-out (evaluator)")
                ax.legend(fontsize=7, loc="lower right")
            top = robust_top(ys)
            if top is not None:  # KL and rejection spikes otherwise flatten the rest of the curve
                ax.set_ylim(top=top)
                ax.set_title(f"{label} (clipped at {top:.3g})", fontsize=9)
            else:
                ax.set_title(label)
            ax.set_xlabel("learner step" if x_name == "step" else "wall clock since launch (s)")
            ax.grid(alpha=0.3)
        if x_name == "wall_clock":
            for ax in axes:
                ax.set_xlim(left=0)
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        path = Path(out_dir) / f"curves_vs_{x_name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
