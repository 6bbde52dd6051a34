"""Process settings: one declaration per setting, and everything that follows from it.

Where Redis, the bucket and the proxy are, the token, TLS, each service's own knobs: each is one
dataclass field declared with `setting(...)` (or a shared declaration below, `PROXY.field()`),
holding its default, its `BRIGADE_*` variable, its flag, its bound or choices and one line of doc.
From that field come the service's typer command (`command`: a flag that falls back to the
variable, then to the default), its validation and the reference table (`markdown_table`, which
`make docs-tables` writes into docs/configuration.md). The dataclass is the service's config: a
new setting is one line.

Run parameters (GRPO, sampling, LoRA, staleness) are not settings: they live in a run spec,
declared in `brigade.spec` and read from YAML or TOML by `brigade.spec_file`.

typer is imported only where a command or an option is built, so reading a setting
(`PROXY.from_env()`, the container health check) does not pay for it.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import socket
from collections.abc import Callable, Iterator
from typing import Annotated, Any, TypeVar

KEY = "brigade.setting"  # the field metadata holding a field's Setting
GROUP = "brigade.settings_group"  # ... or marking a field whose value is a nested settings class
S = TypeVar("S")


@dataclasses.dataclass(frozen=True)
class Setting:
    default: Any
    doc: str
    env: str | tuple[str, ...] = ()  # BRIGADE_* variables the flag falls back to, the first set wins
    flag: str | tuple[str, ...] = ""  # "" = --<field name, dashed>; "--on/--off" for a switch
    low: float | None = None  # inclusive bounds: click checks a flag, `validate` a config built in code
    high: float | None = None
    choices: tuple[str, ...] = ()
    # the command passes parse(the flag's value) to the dataclass, whose default is then
    # parse(default): a flag spelling ("" or -1 for "the run spec's") for a richer config value
    parse: Callable[[Any], Any] | None = None
    show_default: bool | str = True
    panel: str | None = None  # a section of --help

    @property
    def envs(self) -> tuple[str, ...]:
        return (self.env,) if isinstance(self.env, str) else self.env

    def flags(self, name: str = "") -> tuple[str, ...]:
        if self.flag:
            return (self.flag,) if isinstance(self.flag, str) else self.flag
        if not name:
            raise ValueError("a setting used outside a dataclass needs its flag")
        dashed = name.replace("_", "-")
        return (f"--{dashed}/--no-{dashed}",) if isinstance(self.default, bool) else (f"--{dashed}",)

    def field(self, **overrides: Any) -> Any:
        """A dataclass field for this setting; `overrides` replace parts of it (a service whose
        --run defaults to "" where the others say `demo`)."""
        s = dataclasses.replace(self, **overrides) if overrides else self
        if s.parse is not None:
            return dataclasses.field(default_factory=lambda: s.parse(s.default), metadata={KEY: s})
        if isinstance(s.default, list | dict | set):
            return dataclasses.field(default_factory=lambda: type(s.default)(s.default), metadata={KEY: s})
        return dataclasses.field(default=s.default, metadata={KEY: s})

    def from_env(self) -> Any:
        """The value a process gets without its flag: the first variable set, else the default
        (a string as the environment holds it)."""
        return next((os.environ[e] for e in self.envs if e in os.environ), self.default)

    def bound(self) -> str:
        if self.choices:
            return ", ".join(self.choices)
        if self.low is not None and self.high is not None:
            return f"{self.low:,} - {self.high:,}"
        if self.low is not None:
            return f">= {self.low}"
        return f"<= {self.high}" if self.high is not None else ""

    def problem(self, value: Any) -> str | None:
        """Why `value` is not allowed (as the flag or variable spells it), or None."""
        if self.choices and value not in self.choices:
            return f"{value!r}: use {' or '.join(self.choices)}"
        if self.low is None and self.high is None:
            return None
        if isinstance(self.default, int) and (not isinstance(value, int) or isinstance(value, bool)):
            return f"must be an integer, not {value!r}"
        if not isinstance(value, int | float) or isinstance(value, bool):
            return f"must be a number, not {value!r}"
        if (self.low is not None and value < self.low) or (self.high is not None and value > self.high):
            return f"must be {self.bound()}, not {value!r}"
        return None

    def option(self, name: str = "", panel: str | None = None) -> Any:
        """The typer option of this setting."""
        import typer

        numeric = isinstance(self.default, int | float) and not isinstance(self.default, bool)
        # one variable as a string: click's errors would print a list of one as "['BRIGADE_X']"
        envvar = self.envs[0] if len(self.envs) == 1 else list(self.envs) or None
        return typer.Option(
            *self.flags(name), envvar=envvar, help=self.doc, show_default=self.show_default,
            min=self.low if numeric else None, max=self.high if numeric else None,
            rich_help_panel=self.panel or panel)

    def annotated(self) -> Any:
        """`Annotated[type, typer.Option]`, for a command's parameter outside a settings class."""
        return Annotated[type(self.default), self.option()]


def setting(default: Any, doc: str, **kw: Any) -> Any:
    """A dataclass field declaring a setting: `timeout: float = setting(5.0, "Seconds ...",
    env="BRIGADE_TIMEOUT", low=0)`. See `Setting` for the keywords."""
    return Setting(default, doc, **kw).field()


def group(cls: type, panel: str | None = None) -> Any:
    """A field holding a nested settings class (the proxy's `Limits`): its settings are flags of
    the command like the others, built into one `cls` (whose __post_init__ may check them together)."""
    return dataclasses.field(default_factory=cls, metadata={GROUP: panel})


def settings_of(cls: type, panel: str | None = None) -> Iterator[tuple[str, Setting, str | None]]:
    """(name, setting, help panel) of each setting of `cls`, nested groups flattened, in order."""
    for f in dataclasses.fields(cls):
        if GROUP in f.metadata:
            yield from settings_of(f.default_factory, f.metadata[GROUP])  # type: ignore[arg-type]
        elif KEY in f.metadata:
            yield f.name, f.metadata[KEY], panel


def validate(obj: Any) -> None:
    """Raise ValueError for the first setting of `obj` outside its bound or choices (settings with
    `parse` hold a parsed value: the command checked their flag)."""
    for f in dataclasses.fields(obj):
        s = f.metadata.get(KEY)
        if s is not None and s.parse is None and (why := s.problem(getattr(obj, f.name))):
            raise ValueError(f"{f.name} {why}")


def build(cls: type[S], values: dict[str, Any]) -> S:
    """`cls` from flag values by name (nested groups included), each parsed by its setting."""
    import typer

    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if GROUP in f.metadata:
            kwargs[f.name] = build(f.default_factory, values)  # type: ignore[arg-type]
        elif (s := f.metadata.get(KEY)) is not None:
            value = values[f.name]
            if why := s.problem(value):
                raise typer.BadParameter(why, param_hint="/".join(s.flags(f.name)))
            if s.parse is None:
                kwargs[f.name] = value
                continue
            try:
                kwargs[f.name] = s.parse(value)
            except ValueError as e:
                raise typer.BadParameter(str(e), param_hint="/".join(s.flags(f.name))) from None
    try:
        return cls(**kwargs)
    except ValueError as e:  # a check across settings (Limits: a request no bigger than a message)
        raise typer.BadParameter(str(e)) from None


def command(cls: type[S]) -> Callable[[Callable[[S], None]], Callable[..., None]]:
    """Decorator: `body(settings: cls)` becomes a typer command with one option per setting of
    `cls`, which builds and checks a `cls` from them and calls `body` with it. typer reads the
    options from the command's `__signature__` (`inspect.signature` honours it)."""

    def decorate(body: Callable[[S], None]) -> Callable[..., None]:
        params = []
        for name, s, panel in settings_of(cls):
            if any(p.name == name for p in params):
                raise TypeError(f"{cls.__name__}: two settings named {name}")
            params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=s.default,
                                            annotation=Annotated[type(s.default), s.option(name, panel)]))

        def run(**values: Any) -> None:
            return body(build(cls, values))

        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        run.__name__, run.__qualname__, run.__doc__ = body.__name__, body.__qualname__, body.__doc__
        run.__module__ = body.__module__
        run.settings = cls  # type: ignore[attr-defined]  # for the reference table
        return run

    return decorate


# ---------------------------------------------------------------- shared by several services

REDIS_URL = Setting("redis://127.0.0.1:6379/0",
                    "Redis URL (the message queue); redis+cluster://host:port for Redis Cluster.",
                    flag="--redis-url", env="BRIGADE_REDIS_URL")
RQ_REDIS_URL = Setting("", "Single-node Redis for rq's job queues (evaluations, sandboxed rewards); empty = "
                       "--redis-url, which must then not be a cluster (rq cannot use one).",
                       flag="--rq-redis-url", env="BRIGADE_RQ_REDIS_URL")
BUCKET = Setting("file://./brigade-runs/bucket", "s3://bucket/prefix or file:///path.",
                 flag="--bucket", env="BRIGADE_BUCKET")
PROXY = Setting("127.0.0.1:50051", "Proxy address host:port (https:// for TLS).",
                flag="--proxy", env="BRIGADE_PROXY")
LISTEN = Setting("127.0.0.1:50051", "Address the server listens on.", flag="--listen", env="BRIGADE_LISTEN")
TOKEN = Setting("", "Bearer token; empty = no auth.", flag="--token", env="BRIGADE_TOKEN", show_default=False)
TLS_CERT = Setting("", "Server certificate (PEM); TLS when set.", flag="--tls-cert", env="BRIGADE_TLS_CERT")
TLS_KEY = Setting("", "Server private key (PEM).", flag="--tls-key", env="BRIGADE_TLS_KEY")
TLS_CA = Setting("", "CA file to verify the proxy's TLS certificate.", flag="--tls-ca", env="BRIGADE_TLS_CA")
RUN = Setting("demo", "Run id.", flag="--run", env="BRIGADE_RUN")
# services that execute a run's spec name their run: a default would let whoever creates that run
# first choose what they run
RUN_REQUIRED = {"default": "", "doc": "Run id (required: no default run).", "show_default": False}
NO_RUN = "which run? pass --run RUN (or set BRIGADE_RUN)"
LOG_LEVEL = Setting("info", "debug, info, warning or error.", flag="--log-level", env="BRIGADE_LOG_LEVEL")
METRICS_PORT = Setting(0, "Serve Prometheus metrics at http://HOST:PORT/metrics (HOST: --metrics-host); 0 = off.",
                       flag="--metrics-port", env="BRIGADE_METRICS_PORT", low=0)
METRICS_HOST = Setting("127.0.0.1", "Address the metrics endpoint binds; 0.0.0.0 for a Prometheus on another "
                       "host or container.", flag="--metrics-host", env="BRIGADE_METRICS_HOST")
METRICS_TOKEN = Setting("", "Bearer token a scrape of /metrics must send (Authorization: Bearer ...); empty = "
                        "none.", flag="--metrics-token", env="BRIGADE_METRICS_TOKEN", show_default=False)
TRACKER_DIR = Setting("trackers", "Folder for the experiment trackers' local files (W&B offline runs, "
                      "TensorBoard events).", flag="--tracker-dir", env="BRIGADE_TRACKER_DIR")
SPEC = Setting("", "Run spec file (YAML or TOML).", flag="--spec", env="BRIGADE_SPEC")
STATE_DIR = Setting("", "Folder for this machine's crash journals (crashes/<service>-<run>.jsonl), which stop a "
                    "service that crashes the same way 3 times in a row (exit 3); empty = "
                    "$XDG_STATE_HOME/brigade, else ~/.local/state/brigade.", flag="--state-dir",
                    env="BRIGADE_STATE_DIR")

# what a rollout worker and a local trainer share: the machines of the fleet
CAPACITY_CLASS = Setting("spot", "spot or on-demand, reported in every manifest.", flag="--capacity-class",
                         env="BRIGADE_CAPACITY_CLASS", choices=("spot", "on-demand"))
PRICE_PER_HOUR = Setting(0.0, "What this machine costs per hour, for dollars per usable sample.",
                         flag="--price-per-hour", env="BRIGADE_PRICE_PER_HOUR", low=0.0)
EXIT_WHEN_FINISHED = Setting(
    False, "Exit 0 once the proxy says the run is finished (max_steps reached or every batch done): right "
    "for spot VMs and jobs that bill until they stop. Off by default: under a supervisor that restarts any "
    "exit (a Deployment, systemd Restart=always) an exit would only reload the model in a loop, while "
    "polling a finished run costs one call per 5 s.",
    flag="--exit-when-finished/--poll-when-finished", env="BRIGADE_EXIT_WHEN_FINISHED")
DEVICE = Setting("", "cpu, cuda or cuda:N; overrides the run spec's device.", flag="--device",
                 env="BRIGADE_DEVICE")
TORCH_THREADS = Setting(0, "Threads torch computes with in this process (generation, a training step); 0 = "
                        "torch's own choice (OMP_NUM_THREADS, else one per core). `brigade up` sets it per service.",
                        flag="--torch-threads", env="BRIGADE_TORCH_THREADS", low=0, high=1024)
REWARD_REDIS = Setting(
    "", "Single-node Redis for the rq queue of sandboxed reward functions (brigade:<run>:rewards); only "
    "needed when the run has sandboxed rewards. BRIGADE_RQ_REDIS_URL, else BRIGADE_REDIS_URL "
    "(not a cluster).",
    flag=("--rq-redis-url", "--redis-url"), env=("BRIGADE_RQ_REDIS_URL", "BRIGADE_REDIS_URL"))
REWARD_WORKERS = Setting(True, "Start a local rq worker subprocess for sandboxed rewards; with "
                         "--no-reward-worker run `rq worker --url $BRIGADE_RQ_REDIS_URL "
                         "brigade:<run>:rewards` yourself.",
                         flag="--reward-worker/--no-reward-worker")


def fleet_id(value: str = "") -> str:
    """A worker's or local trainer's id: `value`, else hostname-pid, unique on a machine and
    telling an operator where it runs."""
    return value or f"{socket.gethostname()}-{os.getpid()}"


# typer parameter types for the commands that take a few of these but are not services (ctl, cost,
# up, migrate-keys); made on first use (module __getattr__) so that importing this module needs no typer
_ANNOTATED = {"RedisUrl": REDIS_URL, "BucketUrl": BUCKET, "ProxyAddr": PROXY, "Token": TOKEN, "TlsCa": TLS_CA,
              "Run": RUN}


def __getattr__(name: str) -> Any:
    if name in _ANNOTATED:
        value = globals()[name] = _ANNOTATED[name].annotated()
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------- the reference


def _default(name: str, s: Setting) -> str:
    if isinstance(s.default, bool):  # the switch's side that is on by default
        return f"`{s.flags(name)[0].split('/')[0 if s.default else 1]}`"
    if isinstance(s.default, int | float):
        return f"{s.default:,}"
    return f"`{s.default}`" if s.default else ""


def markdown_table(classes: dict[str, type]) -> str:
    """One Markdown table per settings class (title -> class): variable, flag, default, allowed, doc."""
    out = []
    for title, cls in classes.items():
        out += [f"### `{title}`", "", "| variable | flag | default | allowed | meaning |",
                "|---|---|---|---|---|"]
        for name, s, _ in settings_of(cls):
            env = ", ".join(f"`{e}`" for e in s.envs)
            flags = ", ".join(f"`{f}`" for f in s.flags(name))
            doc = s.doc.replace("|", "\\|")
            out.append(f"| {env} | {flags} | {_default(name, s)} | {s.bound()} | {doc} |")
        out.append("")
    return "\n".join(out)
