"""The single `brigade` entry point. Service commands live in their service folders and keep heavy
imports (torch, transformers) inside the command body, so `brigade proxy`, `brigade janitor` and
`brigade ctl` start without them."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json

import typer

app = typer.Typer(
    name="brigade",
    help="Asynchronous GRPO on LoRA adapters across preemptible workers: a bucket, a lease proxy, no NCCL.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)



@app.callback()
def _root() -> None:
    """brigade: one command per service, plus `up`, `ctl`, `cost` and `bench`."""


# name -> "module:function"; each function is a typer command.
SERVICE_COMMANDS = {
    "proxy": "brigade_proxy.cli:proxy",
    "janitor": "brigade_janitor.cli:janitor",
    "learner": "brigade_learner.cli:learner",
    "rollout": "brigade_rollout.cli:rollout",
    "evaluator": "brigade_evaluator.cli:evaluator",
    "up": "brigade.up:up",
    "cost": "brigade.cost:cost",
}
SUB_APPS = {
    "ctl": "brigade.ctl:app",
}

for _name, _target in SERVICE_COMMANDS.items():
    _module, _func = _target.split(":")
    app.command(_name)(getattr(importlib.import_module(_module), _func))
for _name, _target in SUB_APPS.items():
    _module, _attr = _target.split(":")
    app.add_typer(getattr(importlib.import_module(_module), _attr), name=_name)

BENCHMARKS = ["bucket", "proxy", "learner", "rollout", "fleet", "sync-latency", "preemption"]


def run_benchmark(name: str, quick: bool) -> dict:
    """Each benchmark is `brigade.bench.<name>.run(quick) -> dict`, sync or async."""
    module = importlib.import_module(f"brigade.bench.{name.replace('-', '_')}")
    result = module.run(quick=quick)
    if inspect.iscoroutine(result):
        result = asyncio.run(result)
    return result


@app.command()
def bench(
    name: str = typer.Argument(..., help=f"One of: {', '.join(BENCHMARKS)}, or 'all'."),
    as_json: bool = typer.Option(False, "--json", help="Print one flat JSON object as the last line."),
    quick: bool = typer.Option(False, "--quick", help="Fewer rounds; finishes in a few minutes."),
    report: str = typer.Option("", "--report", help="With 'all': write a Markdown report here."),
) -> None:
    """Run a benchmark; ratios compare with a baseline measured in the same run."""
    if name == "all":
        from brigade.bench.report import run_all

        run_all(quick=quick, report_path=report or "bench/report.md")
        return
    if name not in BENCHMARKS:
        raise typer.BadParameter(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)} or all")
    result = run_benchmark(name, quick)
    if not as_json:
        width = max(len(k) for k in result)
        for key, value in result.items():
            shown = f"{value:.4g}" if isinstance(value, float) else value
            typer.echo(f"{key:<{width}}  {shown}")
    typer.echo(json.dumps(result))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
