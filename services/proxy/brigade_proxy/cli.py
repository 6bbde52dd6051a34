"""`brigade proxy`: the lease proxy. Its flags come from `ProxySettings`; heavy imports (grpc
server, Redis) happen inside the command, so `brigade --help` stays fast."""

from __future__ import annotations

import typer

from brigade.settings import command
from brigade_proxy.processes import serve_one, serve_processes
from brigade_proxy.settings import ProxySettings


@command(ProxySettings)
def proxy(s: ProxySettings) -> None:
    """The lease proxy: hands out prompt batches, takes rollout manifests, feeds the learner.

    Stateless (everything is in Redis); run as many replicas as you like behind one address.
    `--bucket ''` keeps run specs in Redis only.
    """
    from brigade.log import configure_logging

    try:
        configure_logging("proxy", s.log_level)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--log-level") from None
    if bool(s.tls_cert) != bool(s.tls_key):
        raise typer.BadParameter("TLS needs both --tls-cert and --tls-key (BRIGADE_TLS_CERT / BRIGADE_TLS_KEY)")
    if s.token and s.tokens_file:
        typer.echo("brigade proxy: give --token (one token, every role: a laptop) or --tokens-file (a token per "
                   "role and credential), not both", err=True)
        raise typer.Exit(2)
    if s.tokens_file:  # a file that cannot be used: one line now, not a crash in each process
        from brigade_proxy.credentials import CredentialsError, TokenTable

        try:
            TokenTable(s.tokens_file)
        except CredentialsError as e:
            typer.echo(f"brigade proxy: {e}", err=True)
            raise typer.Exit(2) from None
    if s.processes == 1:
        raise typer.Exit(serve_one(s))
    if s.listen.rsplit(":", 1)[-1] in ("0", ""):
        raise typer.BadParameter("several processes share one port: give it (--listen HOST:PORT, not port 0)",
                                 param_hint="--processes")
    raise typer.Exit(serve_processes(s))


def main() -> None:
    """`brigade-proxy` (and `python -m brigade_proxy`): the same command as `brigade proxy`."""
    typer.run(proxy)
