"""The single `brigade` entry point. Service commands live in their service folders and keep heavy
imports (torch, transformers) inside the command body, so `brigade proxy`, `brigade janitor` and
`brigade ctl` start without them."""

from __future__ import annotations

import importlib
import json

import typer

app = typer.Typer(
    name="brigade",
    help="Asynchronous GRPO on LoRA adapters across preemptible workers: a bucket, a lease proxy, no NCCL.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help text is plain: `brigade[vllm]` must print as written
)



@app.callback()
def _root() -> None:
    """brigade: one command per service, plus `up`, `ctl`, `cost` and `bench`."""


# name -> "module:function"; each function is a typer command. Services are separate
# distributions (an image installs only its own), so a service that is not installed gets a
# command that says how to install it instead of breaking `brigade` for everything else.
SERVICE_COMMANDS = {
    "proxy": ("brigade_proxy.cli:proxy", "brigade-proxy"),
    "janitor": ("brigade_janitor.cli:janitor", "brigade-janitor"),
    "learner": ("brigade_learner.cli:learner", "brigade-learner"),
    "rollout": ("brigade_rollout.cli:rollout", "brigade-rollout"),
    "evaluator": ("brigade_evaluator.cli:evaluator", "brigade-evaluator"),
    "trainer": ("brigade_learner.local_cli:trainer", "brigade-learner"),
    "aggregator": ("brigade_aggregator.cli:aggregator", "brigade-aggregator"),
}
LOCAL_COMMANDS = {
    "up": "brigade_cli.up:up",
    "cost": "brigade_cli.cost:cost",
    "real": "brigade_cli.real:real",
    "migrate-keys": "brigade_cli.migrate:migrate_keys",
}
SUB_APPS = {
    "ctl": "brigade_cli.ctl:app",
}


def _load(target: str):
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def _not_installed(name: str, distribution: str):
    def command() -> None:
        typer.echo(f"brigade {name}: the {distribution} package is not installed here "
                   f"(pip install {distribution}, or `make install` in a checkout)", err=True)
        raise typer.Exit(2)

    command.__doc__ = f"(not installed: pip install {distribution})"
    return command


for _name, (_target, _distribution) in SERVICE_COMMANDS.items():
    try:
        app.command(_name)(_load(_target))
    except ModuleNotFoundError as _e:
        if not (_e.name or "").startswith(_target.split(".")[0]):
            raise
        # whatever flags the caller gave, the answer is the install hint
        app.command(_name, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
            _not_installed(_name, _distribution))
for _name, _target in LOCAL_COMMANDS.items():
    app.command(_name)(_load(_target))
for _name, _target in SUB_APPS.items():
    app.add_typer(_load(_target), name=_name)

BENCHMARKS = ["bucket", "proxy", "learner", "rollout", "fleet", "sync-latency", "preemption", "topology", "scale",
              "real"]


@app.command()
def bench(
    name: str = typer.Argument(..., help=f"One of: {', '.join(BENCHMARKS)}, or 'all'."),
    as_json: bool = typer.Option(False, "--json", help="Print one flat JSON object as the last line."),
    quick: bool = typer.Option(False, "--quick", help="Fewer rounds; finishes in a few minutes."),
    report: str = typer.Option("", "--report", help="With 'all': write a Markdown report here."),
    repeat: int = typer.Option(0, "--repeat", min=0, show_default=False,
                               help="Run each benchmark N times in a row; every figure is then its median, with "
                                    "its worst run as <figure>_worst, and each run's load average is recorded "
                                    "(default: 3 with --quick, else 5; `real` runs once in full mode, about 35 min)."),
) -> None:
    """Run a benchmark; ratios compare with a baseline measured in the same run."""
    try:
        importlib.import_module("brigade_bench")
    except ModuleNotFoundError:
        typer.echo("brigade bench: the benchmarks (bench/ of a checkout) are not installed here; "
                   "`make install` or `pip install -e bench`", err=True)
        raise typer.Exit(2) from None
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
