"""The single `brigade` entry point. Service commands live in their service folders and keep heavy
imports (torch, transformers) inside the command body, so `brigade proxy`, `brigade janitor` and
`brigade ctl` start without them. Other distributions add commands of their own through entry points
(PLUGIN_GROUP): `brigade bench` is the benchmarks' (bench/), which this package never imports."""

from __future__ import annotations

import importlib
import importlib.metadata

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
    "export": "brigade_cli.export:export",
    "migrate-keys": "brigade_cli.migrate:migrate_keys",
}
SUB_APPS = {
    "ctl": "brigade_cli.ctl:app",
}
# Entry points of this group are typer command functions, mounted under their names (a distribution's
# pyproject: [project.entry-points."brigade.commands"] bench = "brigade_bench.cli:bench"); each keeps
# its heavy imports inside its body. One that is not installed says how to get it.
PLUGIN_GROUP = "brigade.commands"
PLUGIN_HINTS = {
    "bench": ("the benchmarks (bench/ of a checkout) are not installed here; "
              "`make install` or `pip install -e bench`"),
}


def _load(target: str):
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def _not_installed(name: str, distribution: str):
    return _missing(name, f"the {distribution} package is not installed here "
                          f"(pip install {distribution}, or `make install` in a checkout)",
                    f"(not installed: pip install {distribution})")


def _missing(name: str, message: str, doc: str):
    def command() -> None:
        typer.echo(f"brigade {name}: {message}", err=True)
        raise typer.Exit(2)

    command.__doc__ = doc
    return command


def _plugin(entry_point: importlib.metadata.EntryPoint | None):
    """The command an entry point names; None when its distribution is not installed here."""
    if entry_point is None:
        return None
    try:
        return entry_point.load()
    except ModuleNotFoundError as e:  # its metadata outlived its code
        if (e.name or "").split(".")[0] != entry_point.module.split(".")[0]:
            raise
        return None


# whatever flags the caller gave a missing command, the answer is the install hint
ANY_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}


for _name, (_target, _distribution) in SERVICE_COMMANDS.items():
    try:
        app.command(_name)(_load(_target))
    except ModuleNotFoundError as _e:
        if not (_e.name or "").startswith(_target.split(".")[0]):
            raise
        app.command(_name, context_settings=ANY_ARGS)(_not_installed(_name, _distribution))
for _name, _target in LOCAL_COMMANDS.items():
    app.command(_name)(_load(_target))
for _name, _target in SUB_APPS.items():
    app.add_typer(_load(_target), name=_name)
_plugins = {ep.name: ep for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP)}
for _name in sorted(_plugins.keys() | PLUGIN_HINTS.keys()):
    if (_command := _plugin(_plugins.get(_name))) is not None:
        app.command(_name)(_command)
    else:
        _hint = PLUGIN_HINTS.get(_name, "its distribution is declared but its code is missing here")
        app.command(_name, context_settings=ANY_ARGS)(_missing(_name, _hint, "(not installed)"))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
