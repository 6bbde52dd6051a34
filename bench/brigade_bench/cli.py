"""`brigade bench NAME`: the benchmarks' command. The bench distribution declares it as an entry point
of the `brigade.commands` group, which `brigade` mounts under its name, and as a script of its own,
`brigade-bench NAME`. Only typer is imported until a benchmark runs: `brigade --help` stays fast."""

from __future__ import annotations

import json

import typer

BENCHMARKS = ["bucket", "proxy", "create-stall", "learner", "rollout", "fleet", "sync-latency", "preemption", "topology", "scale",
              "real", "real-gen"]


def bench(
    name: str = typer.Argument(..., help=f"One of: {', '.join(BENCHMARKS)}, or 'all'."),
    as_json: bool = typer.Option(False, "--json", help="Print one flat JSON object as the last line."),
    quick: bool = typer.Option(False, "--quick", help="Fewer rounds; finishes in a few minutes."),
    report: str = typer.Option("", "--report", help="With 'all': write a Markdown report here."),
    repeat: int = typer.Option(0, "--repeat", min=0, show_default=False,
                               help="Run each benchmark N times in a row; every figure is then its median, with "
                                    "its worst run as <figure>_worst, and each run's load average is recorded "
                                    "(default: 3 with --quick, else 5; `real` and `real-gen` 3, each run about an hour)."),
) -> None:
    """Run a benchmark; ratios compare with a baseline measured in the same run."""
    allow_own_files()
    if name == "all":
        from brigade_bench.report import run_all

        run_all(quick=quick, report_path=report or "bench/report.md", repeat=repeat)
        return
    if name not in BENCHMARKS:
        raise typer.BadParameter(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)} or all")
    from brigade_bench.repeat import default_repeat, run_repeated, summarize

    times = repeat or default_repeat(name, quick)
    result = summarize(run_repeated(name, quick, times))
    if not as_json:
        width = max(len(k) for k in result)
        for key, value in result.items():
            shown = f"{value:.4g}" if isinstance(value, float) else value
            typer.echo(f"{key:<{width}}  {shown}")
    typer.echo(json.dumps(result))
    if result.get("runs_failed") == times:
        raise typer.Exit(1)


def allow_own_files() -> None:
    """A benchmark writes its models and data to temporary folders and runs them on this machine: the
    host's policy (brigade.code_policy) lets those in, for the processes it starts as well."""
    import os
    import tempfile

    from brigade.code_policy import ALLOW_PATHS_ENV

    paths = os.environ.get(ALLOW_PATHS_ENV, "")
    os.environ[ALLOW_PATHS_ENV] = ",".join(filter(None, (paths, tempfile.gettempdir())))


app = typer.Typer(name="brigade-bench", add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode=None)
app.command()(bench)


def main() -> None:
    """The `brigade-bench` script: `brigade bench` without the rest of `brigade`."""
    app()


if __name__ == "__main__":
    main()
