"""`brigade ctl`: look at a run through the proxy (RunService). Readable tables on a terminal,
`--json` for scripts. Talks gRPC only: no Redis, no bucket, no torch.

Which proxy and run: `--proxy` / `--run` (or BRIGADE_PROXY / BRIGADE_RUN). Without them, the runs
`brigade up` started here (`./brigade-runs/*/endpoint.json`): the named run, or the latest one. A
finished local run is read from the snapshot `up` left in its folder (`brigade_cli.local_runs`).

A connection or auth problem prints one line (what failed, what to check) and exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

import grpc
import typer
from google.protobuf import json_format
from google.protobuf.message import Message

from brigade.rpc import ProxyClient, describe_rpc_error
from brigade.settings import PROXY, ProxyAddr, Run, TlsCa, Token
from brigade.spec import admission_capacity
from brigade.v1 import brigade_pb2 as pb
from brigade_cli.local_runs import SnapshotClient, find_local_run

app = typer.Typer(
    name="ctl",
    help="Inspect a run through the proxy: status, events, leases, workers, adapters, dead letters, metrics.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help text is plain: `brigade[vllm]` must print as written
)

AsJson = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
Timeout = Annotated[float, typer.Option("--timeout", help="Seconds to wait for the proxy.")]
T = TypeVar("T")
RUNS_PAGE = 500          # `ctl runs` reads the run list in pages of this many (ListRuns takes at most 1,000)
WATCH_GIVE_UP_S = 30.0  # a watch whose proxy stays away this long ends: the run is probably over


# ---------------------------------------------------------------- plumbing

def shown(value: Any) -> str:
    """`value` as text safe on an operator's terminal: control characters (escape sequences
    included) written as Python escapes. Everything ctl prints from the proxy goes through here;
    anyone holding a worker token chose some of it (ids, messages, capacity_class, engine)."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _fail(message: str) -> None:
    typer.echo(f"brigade ctl: {shown(message)}", err=True)
    raise typer.Exit(1)


def _resolve_proxy(proxy: str) -> str:
    """--proxy / BRIGADE_PROXY, else the latest live local run's proxy, else the default."""
    if proxy:
        return proxy
    local = find_local_run()
    return local.proxy if local is not None and local.live else PROXY.default


def resolve_target(run: str, proxy: str) -> tuple[str, str | Path]:
    """The run id, and where to read it: a proxy address, or the snapshot of a finished local run."""
    local = find_local_run(run) if not proxy else None
    if not run:
        if local is None and not proxy:
            local = find_local_run()
        if local is None:
            _fail("which run? pass --run RUN (or set BRIGADE_RUN); `brigade ctl runs` lists them")
        run = local.run
    if proxy:
        return run, proxy
    if local is None:
        return run, PROXY.default
    if not local.live and local.snapshot is not None:
        typer.echo(f"(run {run} has ended; reading the snapshot in {local.snapshot})", err=True)
        return run, local.snapshot
    return run, local.proxy


def call_proxy(target: str | Path, token: str, tls_ca: str, fn: Callable[[ProxyClient], Awaitable[T]]) -> T:
    """Run one async exchange with the proxy (or a finished run's snapshot); any failure is one
    line on stderr and exit 1."""

    async def main() -> T:
        if isinstance(target, Path):
            return await fn(SnapshotClient(target))
        async with ProxyClient.connect(target, token, tls_ca) as client:
            return await fn(client)

    try:
        return asyncio.run(main())
    except grpc.aio.AioRpcError as e:
        _fail(describe_rpc_error(e, target))
    except OSError as e:  # e.g. the --tls-ca file cannot be read
        _fail(f"{e.strerror or e}: {e.filename or ''}".rstrip(": "))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    raise AssertionError("unreachable")  # pragma: no cover


def to_dict(message: Message) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def _print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, sort_keys=False))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], empty: str = "(none)") -> str:
    """A plain aligned table: numbers right-aligned, text left-aligned, two spaces between."""
    if not rows:
        return empty
    headers = [shown(h) for h in headers]
    cells = [[_cell(v) for v in row] for row in rows]
    numeric = [all(isinstance(row[i], int | float) and not isinstance(row[i], bool) for row in rows)
               for i in range(len(headers))]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    return "\n".join([line(list(headers)), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return shown(value)


def _when(ms: int) -> str:
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def _ago(ms: int, now_ms: int | None = None) -> str:
    if not ms:
        return "never"
    now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
    return _duration(now_ms - ms) + " ago"


def _duration(delta_ms: int) -> str:
    s = abs(delta_ms) / 1000
    if s < 60:
        text = f"{s:.0f}s" if s >= 10 else f"{s:.1f}s"
    elif s < 3600:
        text = f"{s / 60:.0f}m"
    elif s < 86400:
        text = f"{s / 3600:.1f}h"
    else:
        text = f"{s / 86400:.1f}d"
    return text


def _deadline(ms: int, now_ms: int) -> str:
    if not ms:
        return "-"
    delta = ms - now_ms
    return f"in {_duration(delta)}" if delta >= 0 else f"passed {_duration(delta)} ago"


# ---------------------------------------------------------------- commands

@app.command()
def status(
    run: Run = "",
    proxy: ProxyAddr = "",
    token: Token = "",
    tls_ca: TlsCa = "",
    as_json: AsJson = False,
) -> None:
    """One run's counters: where every batch is, versions, steps."""
    run, proxy = resolve_target(run, proxy)
    state = call_proxy(proxy, token, tls_ca, lambda c: c.runs.GetRun(pb.RunRef(run_id=run), timeout=15))
    if as_json:
        _print_json(to_dict(state))
        return
    typer.echo(format_status(state))


def format_status(s: pb.RunState) -> str:
    spec = s.spec
    per_epoch = -(-s.num_prompts // max(1, spec.prompts_per_batch))
    cut = f"{s.batches_created}" + (f" / {per_epoch * spec.epochs}" if spec.epochs else f" ({per_epoch} per epoch)")
    steps = f"{s.learner_step}" + (f" / {spec.max_steps}" if spec.max_steps else "")
    outstanding = s.queued + s.leased + s.completed
    mode = ("sync" if spec.sync else "async") + f", max_staleness {spec.staleness.max_staleness}"
    cap = f"{outstanding} / {admission_capacity(spec)} (admission cap)"
    if spec.topology == "local_sgd":
        ls = spec.local_sgd
        mode = (f"local_sgd: {ls.local_steps} local steps, rounds of {ls.min_contributions} contributions or "
                f"{ls.round_timeout_s:g} s, merge {ls.merge}, outer {ls.outer_optimizer}, "
                f"max_staleness {spec.staleness.max_staleness}")
        cap = f"{outstanding} (no admission cap in local_sgd)"
    rows = [
        ("run", spec.run_id),
        ("state", "finished" if s.finished else "running"),
        ("model", spec.model),
        ("created", _when(s.created_ms)),
        ("adapter version", s.latest_version),
        ("learner step", steps),
        ("mode", mode),
        ("prompts", s.num_prompts),
        ("batches cut", cut),
        *([] if spec.topology == "local_sgd" else [("lookahead", format_lookahead(s))]),
        ("outstanding", cap),
        ("  queued", s.queued),
        ("  leased", s.leased),
        ("  completed, waiting", s.completed),
        *([("  contributions, waiting", s.contributions)] if spec.topology == "local_sgd" else []),
        ("consumed", s.consumed),
        ("rejected by learner", s.rejected),
        ("stale removed", s.stale_removed),
        ("dead-lettered", s.deadlettered),
        ("expired leases", s.expired),
        ("revoked leases", s.revoked),
        ("duplicate completions", s.duplicates),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {shown(v)}" for k, v in rows)


def format_lookahead(s: pb.RunState) -> str:
    """How far ahead of the newest version workers may generate now, and why."""
    if s.spec.sync:
        return "0 (sync: every batch waits for the version it trains at)"
    if s.spec.staleness.lookahead:
        return f"{s.lookahead} (fixed by staleness.lookahead)"
    measured = (f"a batch takes {s.generation_s:.1f} s to generate, the learner {s.step_busy_s:.1f} s a step"
                if s.generation_s and s.step_busy_s else "times not measured yet")
    return f"{s.lookahead} version{'s' if s.lookahead != 1 else ''} (auto: {measured})"


@app.command()
def runs(
    proxy: ProxyAddr = "",
    token: Token = "",
    tls_ca: TlsCa = "",
    as_json: AsJson = False,
) -> None:
    """Every run the proxy's Redis knows (read page by page)."""
    proxy = _resolve_proxy(proxy)

    async def every_page(c: ProxyClient) -> list[pb.RunState]:
        found, token = [], ""
        while True:
            page = await c.runs.ListRuns(pb.ListRunsRequest(page_size=RUNS_PAGE, page_token=token), timeout=15)
            found += page.runs
            token = page.next_page_token
            if not token:
                return found

    found = call_proxy(proxy, token, tls_ca, every_page)
    if as_json:
        _print_json([to_dict(r) for r in found])
        return
    rows = [(r.spec.run_id, r.latest_version, r.learner_step, r.batches_created, r.queued, r.leased, r.completed,
             r.consumed, r.rejected + r.stale_removed, r.deadlettered, "finished" if r.finished else "running")
            for r in found]
    typer.echo(table(["RUN", "VERSION", "STEP", "CUT", "QUEUED", "LEASED", "WAITING", "CONSUMED", "REJECTED",
                      "DEAD", "STATE"], rows, "(no runs)"))


@app.command()
def leases(
    run: Run = "",
    proxy: ProxyAddr = "",
    token: Token = "",
    tls_ca: TlsCa = "",
    as_json: AsJson = False,
) -> None:
    """Leases in flight: batch, worker, adapter version, attempt, deadline."""
    run, proxy = resolve_target(run, proxy)
    resp = call_proxy(proxy, token, tls_ca, lambda c: c.runs.ListLeases(pb.RunRef(run_id=run), timeout=15))
    if as_json:
        _print_json([to_dict(x) for x in resp.leases])
        return
    now = int(time.time() * 1000)
    rows = [(x.lease_id, x.batch_id, x.worker_id, x.adapter_version, x.attempt, _deadline(x.deadline_ms, now),
             "REVOKED" if x.revoked else "") for x in resp.leases]
    typer.echo(table(["LEASE", "BATCH", "WORKER", "VERSION", "ATTEMPT", "DEADLINE", ""], rows, "(no leases in flight)"))


@app.command()
def workers(
    run: Run = "",
    proxy: ProxyAddr = "",
    token: Token = "",
    tls_ca: TlsCa = "",
    as_json: AsJson = False,
) -> None:
    """Rollout workers seen by the run: capacity class, price, leases granted and completed."""
    run, proxy = resolve_target(run, proxy)
    resp = call_proxy(proxy, token, tls_ca, lambda c: c.runs.ListWorkers(pb.RunRef(run_id=run), timeout=15))
    if as_json:
        _print_json([to_dict(x) for x in resp.workers])
        return
    now = int(time.time() * 1000)
    rows = [(w.worker_id, w.capacity_class or "-", w.engine or "-", w.price_per_hour, w.leases_granted,
             w.leases_completed, _ago(w.last_seen_ms, now)) for w in resp.workers]
    typer.echo(table(["WORKER", "CLASS", "ENGINE", "$/H", "GRANTED", "COMPLETED", "LAST SEEN"], rows,
                     "(no workers yet)"))


@app.command()
def adapters(
    run: Run = "",
    proxy: ProxyAddr = "",
    token: Token = "",
    tls_ca: TlsCa = "",
    as_json: AsJson = False,
) -> None:
    """Published adapter versions, with evaluator results when there are any."""
    run, proxy = resolve_target(run, proxy)
    resp = call_proxy(proxy, token, tls_ca, lambda c: c.runs.ListAdapters(pb.RunRef(run_id=run), timeout=15))
    if as_json:
        out = []
        for a in resp.adapters:
            d = to_dict(a)
            d["eval"] = _parse_json(a.eval_json)
            out.append(d)
        _print_json(out)
        return
    rows = [(a.version, a.step, a.payload or "-", _when(a.created_ms), _summary(_parse_json(a.eval_json)), a.uri)
            for a in resp.adapters]
    typer.echo(table(["VERSION", "STEP", "PAYLOAD", "CREATED", "EVAL", "URI"], rows, "(no adapters published yet)"))


@app.command()
def deadletters(
    run: Run = "",
    proxy: ProxyAddr = "",
    token: Token = "",
    tls_ca: TlsCa = "",
    as_json: AsJson = False,
) -> None:
    """Batches given up on after max_attempts failures, and why."""
    run, proxy = resolve_target(run, proxy)
    resp = call_proxy(proxy, token, tls_ca, lambda c: c.runs.ListDeadLetters(pb.RunRef(run_id=run), timeout=15))
    if as_json:
        _print_json([to_dict(x) for x in resp.dead_letters])
        return
    rows = [(d.batch_id, d.attempts, d.last_worker or "-", _when(d.time_ms), d.reason) for d in resp.dead_letters]
    typer.echo(table(["BATCH", "ATTEMPTS", "LAST WORKER", "TIME", "REASON"], rows, "(no dead letters)"))


@app.command()
def metrics(
    run: Run = "",
    last: Annotated[int, typer.Option("--last", help="The last N steps; 0 = all kept.")] = 20,
    proxy: ProxyAddr = "",
    token: Token = "",
    tls_ca: TlsCa = "",
    as_json: AsJson = False,
) -> None:
    """The learner's per-step metrics, then the evaluator's held-out scores per adapter version."""
    run, proxy = resolve_target(run, proxy)

    async def both(c: ProxyClient):
        return (await c.runs.GetMetrics(pb.GetMetricsRequest(run_id=run, last=max(0, last)), timeout=15),
                await c.runs.ListAdapters(pb.RunRef(run_id=run), timeout=15))

    resp, adapters = call_proxy(proxy, token, tls_ca, both)
    parsed = [(s.step, _parse_json(s.metrics_json)) for s in resp.steps]
    evals = [(a.version, _parse_json(a.eval_json)) for a in adapters.adapters if a.eval_json]
    if as_json:
        _print_json({"steps": [{"step": step, "metrics": m} for step, m in parsed],
                     "evals": [{"version": v, "eval": e} for v, e in evals]})
        return
    columns: list[str] = []
    for _, m in parsed:
        if isinstance(m, dict):
            for key, value in m.items():
                if key not in columns and key != "step" and isinstance(value, int | float) and len(columns) < 8:
                    columns.append(key)
    rows = [(step, *((m.get(c, "") if isinstance(m, dict) else "") for c in columns)) for step, m in parsed]
    typer.echo(table(["STEP", *(c.upper() for c in columns)], rows, "(no metrics yet)"))
    if evals:
        typer.echo("")
        typer.echo(table(["VERSION", "HELD-OUT EVALUATION"], [(v, _summary(e, 100)) for v, e in evals], ""))


@app.command()
def watch(
    run: Run = "",
    from_start: Annotated[bool, typer.Option("--from-start", help="Replay the kept events first.")] = False,
    after: Annotated[str, typer.Option("--after", help="Resume after this event id.")] = "",
    proxy: ProxyAddr = "",
    token: Token = "",
    tls_ca: TlsCa = "",
    as_json: AsJson = False,
) -> None:
    """Tail the run's events (grants, completions, expiries, publishes, steps) until Ctrl-C."""
    run, proxy = resolve_target(run, proxy)

    async def tail(client: ProxyClient) -> None:
        last, start, seen = after, from_start, False
        down_since: float | None = None
        # Ctrl-C cancels the stream call itself: cancelling the task that awaits a grpc.aio stream
        # read was seen, rarely, to be lost, leaving `watch` waiting for an event that never came
        stop, stream = asyncio.Event(), None

        def interrupt() -> None:
            stop.set()
            if cancel := getattr(stream, "cancel", None):  # a finished run's snapshot has nothing to cancel
                cancel()

        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, interrupt)
        while not stop.is_set():
            stream = client.runs.WatchRun(pb.WatchRunRequest(run_id=run, after_id=last, from_start=start and not last))
            try:
                async for event in stream:
                    seen, last, down_since = True, event.id, None
                    if as_json:
                        line = json.dumps({"id": event.id, "type": event.type, "time_ms": event.time_ms,
                                           "attrs": dict(event.attrs)})
                    else:
                        line = format_event(event)
                    sys.stdout.write(line + "\n")
                    sys.stdout.flush()
                return
            except asyncio.CancelledError:
                if stop.is_set():
                    return
                raise
            except grpc.aio.AioRpcError as e:
                if stop.is_set():
                    return
                # the proxy restarted under a watch that was working: resume after the last event
                if not seen or e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                if down_since is None:  # one line per outage, not one per retry
                    down_since = time.monotonic()
                    typer.echo(f"brigade ctl: {shown(describe_rpc_error(e, proxy))}; retrying for up to "
                               f"{WATCH_GIVE_UP_S:.0f}s", err=True)
                elif time.monotonic() - down_since > WATCH_GIVE_UP_S:
                    _fail(f"the proxy at {proxy} has not answered for {WATCH_GIVE_UP_S:.0f}s; the run may have "
                          f"ended (a local run's snapshot: brigade ctl status --run {run})")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)

    try:
        call_proxy(proxy, token, tls_ca, tail)
    except typer.Exit as e:
        if e.exit_code == 130:  # Ctrl-C is how watch ends
            raise typer.Exit(0) from None
        raise


def format_event(event: pb.Event) -> str:
    when = datetime.fromtimestamp(event.time_ms / 1000, tz=UTC).strftime("%H:%M:%S.%f")[:-3]
    attrs = " ".join(f"{shown(k)}={shown(v)}" for k, v in sorted(event.attrs.items()))
    return f"{when}  {shown(event.type):<18} {attrs}"


def _parse_json(text: str) -> Any:
    if not text:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than Python recurses
        return text


def _summary(value: Any, limit: int = 60) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        parts = [f"{k}={_cell(v)}" for k, v in value.items() if isinstance(v, int | float | str)]
        text = shown(" ".join(parts))
    else:
        text = shown(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
