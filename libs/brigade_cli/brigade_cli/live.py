"""`brigade up`'s progress: on a terminal one live line (rich), redrawn as the run moves; otherwise
the plain line per step that logs and tests read (`up.progress_line`)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import typer


def eta_s(metrics: list[dict], max_steps: int, window: int = 10) -> float | None:
    """Seconds to max_steps at the pace of the last `window` steps; None without a goal or a pace."""
    timed = [m for m in metrics if isinstance(m.get("time_unix"), int | float)][-window:]
    if max_steps <= 0 or len(timed) < 2:
        return None
    per_step = (timed[-1]["time_unix"] - timed[0]["time_unix"]) / (timed[-1]["step"] - timed[0]["step"] or 1)
    return max(max_steps - timed[-1]["step"], 0) * per_step


def clock(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


def live_text(m: dict, max_steps: int, live_workers: int, heldout: float | None, eta: float | None) -> str:
    goal = f"/{max_steps}" if max_steps else ""
    held = f"{heldout:.3f}" if heldout is not None else "-"
    return (f"[bold]step {m.get('step', 0)}{goal}[/]  ETA {clock(eta)}  reward {m.get('reward_mean', float('nan')):.3f}"
            f"  held-out {held}  staleness {m.get('staleness_mean', 0.0):.2f}"
            f"  rejected {m.get('rejection_rate', 0.0):.1%}  workers {live_workers}")


class Progress:
    def __init__(self, max_steps: int, plain_line: Callable[..., str], rate: Callable[[list[dict]], float],
                 tty: bool | None = None):
        self.max_steps, self.plain_line, self.rate = max_steps, plain_line, rate
        self.live = None
        if sys.stdout.isatty() if tty is None else tty:
            from rich.console import Console
            from rich.live import Live

            # other output (typer.echo, to stdout or stderr) scrolls above the line
            self.live = Live("[dim]waiting for the first step...[/]", console=Console(), refresh_per_second=4)
            self.live.start()

    def show(self, metrics: list[dict], shown: int, live_workers: int, heldout: float | None) -> None:
        """Steps from index `shown` on are new (each gets a plain line when not on a terminal)."""
        if self.live is None:
            for i in range(max(shown, 0), len(metrics)):
                typer.echo(self.plain_line(metrics[i], self.max_steps, live_workers, self.rate(metrics[: i + 1]),
                                           heldout, clock(eta_s(metrics[: i + 1], self.max_steps))))
        elif metrics:
            self.live.update(live_text(metrics[-1], self.max_steps, live_workers, heldout,
                                       eta_s(metrics, self.max_steps)))

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
