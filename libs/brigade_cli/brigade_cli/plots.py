"""PNG plots of a run's learner metrics: reward, KL, staleness and rejection rate, each against
learner step and against wall clock."""

from __future__ import annotations

from pathlib import Path

CURVES = [("reward_mean", "reward"), ("kl", "KL to reference"), ("staleness_mean", "staleness (versions)"),
          ("rejection_rate", "rejection rate")]


def plot_run(metrics: list[dict], out_dir: Path, title: str = "") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # no display here or in containers
    import matplotlib.pyplot as plt

    steps = [m.get("step", i + 1) for i, m in enumerate(metrics)]
    t0 = min((m["time_unix"] for m in metrics if "time_unix" in m), default=None)
    wall = [m.get("time_unix", t0 or 0) - (t0 or 0) for m in metrics]
    paths = []
    for x_name, xs in (("step", steps), ("wall_clock", wall)):
        fig, axes = plt.subplots(1, len(CURVES), figsize=(4 * len(CURVES), 3.2))
        for ax, (key, label) in zip(axes, CURVES, strict=True):
            ys = [m.get(key, float("nan")) for m in metrics]
            ax.plot(xs, ys, lw=1.5)
            ax.set_title(label)
            ax.set_xlabel("learner step" if x_name == "step" else "wall clock (s)")
            ax.grid(alpha=0.3)
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        path = Path(out_dir) / f"curves_vs_{x_name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
