"""`brigade cost`: the spot-versus-reserved arithmetic of the design essay.

advantage = 1 / (1 - discount) x (1 - preemption_loss) / sample_inflation

A spot GPU-hour costs (1 - discount) of an on-demand one; preemption wastes a share of spot hours;
staleness makes you generate `sample_inflation` samples per usable one. Above 1.0 the spot fleet
buys more usable samples per dollar. The break-even discount is where advantage = 1.
"""

from __future__ import annotations

import json

import typer

from brigade import settings


def advantage(discount: float, preemption_loss: float, sample_inflation: float) -> float:
    return (1.0 / (1.0 - discount)) * (1.0 - preemption_loss) / sample_inflation


def break_even_discount(preemption_loss: float, sample_inflation: float) -> float:
    # 1 / (1 - d) * (1 - loss) / inflation = 1  =>  d = 1 - (1 - loss) / inflation
    return 1.0 - (1.0 - preemption_loss) / sample_inflation


async def measured(client, run: str) -> dict:
    """Preemption loss, rejection rate and dollars per usable sample of a run, through `client`
    (a ProxyClient, or the snapshot of a finished local run)."""
    from brigade.v1 import brigade_pb2 as pb

    state = await client.runs.GetRun(pb.RunRef(run_id=run), timeout=10)
    metrics = await client.runs.GetMetrics(pb.GetMetricsRequest(run_id=run, last=1), timeout=10)
    lost = state.expired + state.revoked
    finished = state.consumed + state.rejected + state.stale_removed + state.deadlettered
    attempts = finished + lost
    rejected = state.rejected + state.stale_removed
    out = {
        "preemption_loss": lost / attempts if attempts else 0.0,
        "rejection_rate": rejected / finished if finished else 0.0,
    }
    out["sample_inflation"] = 1.0 / (1.0 - out["rejection_rate"]) if out["rejection_rate"] < 1 else float("inf")
    if metrics.steps:
        last = json.loads(metrics.steps[-1].metrics_json or "{}")
        if "dollars_per_usable_sample" in last:
            out["dollars_per_usable_sample"] = last["dollars_per_usable_sample"]
    return out


def cost(
    discount: float = typer.Option(0.70, help="Spot discount against on-demand, 0..1."),
    preemption_loss: float = typer.Option(0.15, help="Share of spot GPU-hours lost to preemption and retries."),
    sample_inflation: float = typer.Option(1.5, help="Samples generated per usable sample (staleness waste)."),
    run: str = typer.Option("", "--run", help="Use this run's measured preemption loss and rejection rate "
                            "(a local run of `brigade up` is found without --proxy, live or finished)."),
    proxy: settings.ProxyAddr = "",
    token: settings.Token = "",
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """The spot-versus-reserved break-even: how much more a spot rollout fleet buys per dollar."""
    if not 0 <= discount < 1:
        raise typer.BadParameter("discount must be in [0, 1)", param_hint="--discount")
    if not 0 <= preemption_loss < 1:
        raise typer.BadParameter("preemption loss must be in [0, 1)", param_hint="--preemption-loss")
    if sample_inflation < 1:
        raise typer.BadParameter("sample inflation must be >= 1", param_hint="--sample-inflation")
    extra: dict = {}
    if run:
        from brigade_cli.ctl import call_proxy, resolve_target

        run, target = resolve_target(run, proxy)
        extra = call_proxy(target, token, "", lambda client: measured(client, run))
        preemption_loss, sample_inflation = extra["preemption_loss"], extra["sample_inflation"]
    result = {
        "discount": discount,
        "preemption_loss": preemption_loss,
        "sample_inflation": sample_inflation,
        "advantage": advantage(discount, preemption_loss, sample_inflation),
        "break_even_discount": break_even_discount(preemption_loss, sample_inflation),
        **{k: v for k, v in extra.items() if k not in ("preemption_loss", "sample_inflation")},
    }
    if as_json:
        typer.echo(json.dumps(result))
        return
    source = f"measured on run {run}" if run else "assumed"
    typer.echo(f"spot discount            {discount:.0%}")
    typer.echo(f"preemption loss          {preemption_loss:.1%}  ({source})")
    typer.echo(f"sample inflation         {sample_inflation:.2f}x  ({source})")
    if "dollars_per_usable_sample" in result:
        typer.echo(f"dollars per usable sample {result['dollars_per_usable_sample']:.6f}")
    typer.echo(f"advantage per dollar     {result['advantage']:.2f}x the reserved node")
    typer.echo(f"break-even discount      {result['break_even_discount']:.0%}  (spot wins above it)")
