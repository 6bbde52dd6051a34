"""What a host lets a run spec make it import, run and read: no code from the wire.

A run spec arrives over the network (CreateRun), written by whoever can reach the proxy. Its reward
functions are import paths, its models and datasets are paths and URIs, and `trust_remote_code`
runs a model repository's Python. Each service that executes a spec (rollout worker, evaluator,
learner, local trainer, and the proxy at CreateRun) checks it first against the policy of the host
it runs on, never against anything the spec says:

- code (reward functions, by module): brigade's own (`brigade.demo`, `brigade.reward_builtins`,
  `brigade.recipes`), `trl.rewards`, the modules of the entry points installed on this host in the
  group `brigade.rewards` (an entry point's name is also a name a spec may use), and the prefixes in
  BRIGADE_ALLOW_CODE (comma-separated: `mypkg` allows `mypkg` and `mypkg.*`, `test_*` any module
  whose name starts with `test_`, `*` anything: dangerous, for a laptop where the spec's author is
  the person at the keyboard);
- local files (models, datasets, reward models): under the working directory (unless it is `/`),
  the brigade cache (BRIGADE_CACHE) and the folders in BRIGADE_ALLOW_PATHS (comma-separated; `*`:
  any); a path is compared after symbolic links are followed, so `data -> /etc` is outside;
- bucket URIs: under the service's own `--bucket`, or under a URI prefix in BRIGADE_ALLOW_PATHS;
- Hub ids and installed GGUF packages: allowed (weights and data, not code), unless the spec sets
  `trust_remote_code`, which needs BRIGADE_ALLOW_REMOTE_CODE=1 on the host.

`check_spec` imports nothing and reads no file: it is safe to call on a spec from anyone.
`check_function` is what `brigade.rewards.resolve` asks before it imports a reward function, and
`check_defined` what it asks of the object it got (a function an allowed module merely imported,
such as `os.system`, is not allowed).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

ALLOW_CODE_ENV = "BRIGADE_ALLOW_CODE"
ALLOW_PATHS_ENV = "BRIGADE_ALLOW_PATHS"
ALLOW_REMOTE_CODE_ENV = "BRIGADE_ALLOW_REMOTE_CODE"
ENTRY_POINT_GROUP = "brigade.rewards"
DEFAULT_CODE = ("brigade.demo", "brigade.reward_builtins", "brigade.recipes", "trl.rewards")
BUILTINS = {  # brigade.rewards.BUILTINS, here so that checking a spec imports nothing else
    "demo_sum": "brigade.demo.task:demo_reward",
    "math": "brigade.reward_builtins:math_reward",
    "code_exec": "brigade.reward_builtins:code_exec_reward",
}
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")
_DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".gguf")


class CodeRefused(ValueError):
    """A spec names code or a source this host does not allow (one line, saying which and why)."""


def _split(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


@functools.cache
def installed_entry_points() -> dict[str, str]:
    """name -> "module:attr" of the `brigade.rewards` entry points installed here (metadata only,
    nothing imported)."""
    from importlib.metadata import entry_points

    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


@dataclass(frozen=True)
class CodePolicy:
    code: tuple[str, ...] = DEFAULT_CODE  # module prefixes, `x*` globs, `*`
    paths: tuple[str, ...] = ()  # local folders and bucket URI prefixes, `*`
    remote_code: bool = False  # trust_remote_code allowed
    entry_points: dict[str, str] = field(default_factory=dict)  # name -> "module:attr"

    @classmethod
    def from_env(cls, bucket: str = "", environ: os._Environ | dict | None = None) -> CodePolicy:
        """This host's policy: the defaults, BRIGADE_ALLOW_CODE / _PATHS / _REMOTE_CODE, the installed
        entry points, and `bucket` (the service's own --bucket; "" = BRIGADE_BUCKET or its default)."""
        env = os.environ if environ is None else environ
        if not bucket:
            from brigade.settings import BUCKET

            bucket = env.get("BRIGADE_BUCKET", BUCKET.default)
        from brigade.mirror import cache_dir

        cwd = Path.cwd().resolve()
        roots = [] if cwd == Path("/") else [str(cwd)]
        roots += [str(cache_dir()), bucket, *_split(env.get(ALLOW_PATHS_ENV, ""))]
        return cls(code=DEFAULT_CODE + _split(env.get(ALLOW_CODE_ENV, "")), paths=tuple(r for r in roots if r),
                   remote_code=env.get(ALLOW_REMOTE_CODE_ENV, "") not in ("", "0", "false", "no"),
                   entry_points=installed_entry_points())

    # ------------------------------------------------------------ code

    def module_allowed(self, module: str) -> bool:
        ep_modules = {v.partition(":")[0] for v in self.entry_points.values()}
        for p in (*self.code, *ep_modules):
            if p == "*" or (p.endswith("*") and module.startswith(p[:-1])):
                return True
            p = p.rstrip(".")
            if module == p or module.startswith(p + "."):
                return True
        return False

    def check_function(self, name: str, kind: str = "reward function") -> str:
        """The "module:attr" a reward name stands for, if this host allows it; else CodeRefused.
        A name without ':' that is not a built-in or entry point is a reward model: `check_source`.
        `kind` names the thing in the message (a tool and an environment class pass the same check)."""
        target = BUILTINS.get(name) or self.entry_points.get(name) or name
        module, sep, attr = target.partition(":")
        if not sep:
            return target
        if target in self.entry_points.values():
            return target
        if not self.module_allowed(module):
            raise CodeRefused(f"{kind} {name!r}: module {module!r} is not allowed on this host; allow it "
                              f"with {ALLOW_CODE_ENV}={module} or install it as a {ENTRY_POINT_GROUP!r} entry point")
        if attr.startswith("__"):
            raise CodeRefused(f"{kind} {name!r}: {attr!r} is not a function name")
        return target

    def check_defined(self, name: str, obj, kind: str = "reward function") -> None:
        """A function or class an allowed module got from elsewhere (`from subprocess import run`)
        is not allowed by its module: where it is defined must be allowed too."""
        import inspect

        if inspect.ismodule(obj):
            home = obj.__name__
        elif inspect.isroutine(obj) or inspect.isclass(obj):
            home = getattr(obj, "__module__", None) or "builtins"
        else:
            return
        if not self.module_allowed(home) and not any(v.startswith(home + ":") for v in self.entry_points.values()):
            raise CodeRefused(f"{kind} {name!r} is defined in {home!r}, which is not allowed on this host "
                              f"({ALLOW_CODE_ENV})")

    # ------------------------------------------------------------ sources

    def _path_allowed(self, path: Path) -> bool:
        if "*" in self.paths:
            return True
        real = path.expanduser().resolve()
        for root in self.paths:
            if "://" in root:
                continue
            r = Path(root).expanduser().resolve()
            if real == r or r in real.parents:
                return True
        return False

    def _uri_allowed(self, uri: str) -> bool:
        if "*" in self.paths:
            return True
        for root in self.paths:
            if "://" not in root:
                continue
            if root.startswith("file://") and uri.startswith("file://"):
                if self._under(uri[len("file://"):], root[len("file://"):]):
                    return True
            elif uri.rstrip("/") == root.rstrip("/") or uri.startswith(root.rstrip("/") + "/"):
                return True
        return False

    @staticmethod
    def _under(path: str, root: str) -> bool:
        real, r = Path(path).resolve(), Path(root).resolve()
        return real == r or r in real.parents

    def check_source(self, what: str, name: str) -> None:
        """A model, dataset or reward model source: `demo`, a bucket URI, a local path, a Hub id."""
        if not name or name == "demo" or name.startswith("demo:"):
            return
        if name.startswith(("s3://", "file://")):
            if not self._uri_allowed(name):
                raise CodeRefused(f"{what} {name!r}: not under this host's bucket; allow it with "
                                  f"{ALLOW_PATHS_ENV}=<uri prefix>")
            return
        if "://" in name:
            raise CodeRefused(f"{what} {name!r}: only s3:// and file:// bucket URIs, local paths and Hub ids")
        local = (name.startswith(("/", ".", "~")) or name.endswith(_DATA_SUFFIXES) or not _HUB_ID.fullmatch(name)
                 or os.path.lexists(name))
        if local and not self._path_allowed(Path(name)):
            raise CodeRefused(f"{what} {name!r}: outside the folders this host allows (the working directory, "
                              f"the brigade cache, {ALLOW_PATHS_ENV})")


def check_spec(spec, policy: CodePolicy | None = None, sources: bool = True) -> list[str]:
    """Why this host refuses the spec (one line each; empty = allowed). Imports and reads nothing.
    `sources=False` checks only the code (reward functions, trust_remote_code): what the proxy can
    judge at CreateRun, where the spec's paths name files on the workers' hosts, not its own."""
    policy = policy or current()
    out: list[str] = []

    def attempt(check, *args) -> None:
        try:
            check(*args)
        except CodeRefused as e:
            out.append(str(e))

    if sources:
        attempt(policy.check_source, "model", spec.model)
        attempt(policy.check_source, "dataset", spec.dataset)
        if spec.HasField("eval_dataset"):
            attempt(policy.check_source, "eval_dataset", spec.eval_dataset)
    for i, r in enumerate(spec.rewards):
        try:
            target = policy.check_function(r.function)
            if ":" not in target and sources:
                policy.check_source(f"rewards[{i}] reward model", target)
        except CodeRefused as e:
            out.append(f"rewards[{i}]: {e}" if not str(e).startswith("rewards[") else str(e))
    for path, target in environment_code(spec):
        if ":" not in target:
            out.append(f"{path}: {target!r} is not 'package.module:name'")
            continue
        try:
            policy.check_function(target, kind=path)
        except CodeRefused as e:
            out.append(str(e))
    if spec.trust_remote_code and not policy.remote_code:
        out.append(f"trust_remote_code: this host does not run a model repository's code; set "
                   f"{ALLOW_REMOTE_CODE_ENV}=1 on it to allow that")
    return out


def environment_code(spec) -> list[tuple[str, str]]:
    """(spec path, "module:attr") of every tool and environment class the spec names."""
    import json

    env = spec.environment
    out = [(f"environment.tools[{i}]", t) for i, t in enumerate(env.tools)]
    if env.factory:
        out.append(("environment.factory", env.factory))
    try:
        named = json.loads(env.factories) if env.factories else {}
    except ValueError:
        named = {}  # validate_spec says it is not a mapping
    out += [(f"environment.factories.{k}", str(v)) for k, v in (named.items() if isinstance(named, dict) else [])]
    return out


def refusal(spec, policy: CodePolicy | None = None) -> str:
    """check_spec's reasons as one line ("" = allowed)."""
    return "; ".join(check_spec(spec, policy))


_installed: CodePolicy | None = None


def install(policy: CodePolicy | None) -> None:
    """Make `policy` the one `current()` returns (a service, with its own --bucket); None: from the environment."""
    global _installed
    _installed = policy


def current() -> CodePolicy:
    return _installed if _installed is not None else CodePolicy.from_env()


def refuse_code(run: str, spec, bucket: str = "") -> CodePolicy:
    """A service's start: install this host's policy (with the service's own --bucket) and raise
    ConfigError (exit 2, one line) when the run's spec names anything it does not allow."""
    from brigade.config import ConfigError

    policy = CodePolicy.from_env(bucket=bucket)
    install(policy)
    if refused := refusal(spec, policy):
        raise ConfigError(f"run {run}: refused by this host's code policy: {refused}")
    return policy


def local_allowance(spec, environ: dict | None = None) -> dict[str, str]:
    """For `brigade up`, which runs a spec file that the person at the keyboard wrote on their own
    machine: the variables (BRIGADE_ALLOW_CODE / _PATHS / _REMOTE_CODE) that allow what that spec
    names, its reward modules, local paths and trust_remote_code, added to what `environ` allows."""
    env = os.environ if environ is None else environ
    code = list(_split(env.get(ALLOW_CODE_ENV, "")))
    paths = list(_split(env.get(ALLOW_PATHS_ENV, "")))
    for r in spec.rewards:
        target = BUILTINS.get(r.function) or r.function
        module, sep, _ = target.partition(":")
        if sep and module and module not in code:
            code.append(module)
    for name in (spec.model, spec.dataset, spec.eval_dataset):
        if name and name.startswith(("/", "~", "s3://", "file://")) and name not in paths:
            paths.append(name)
    out = {ALLOW_CODE_ENV: ",".join(code), ALLOW_PATHS_ENV: ",".join(paths)}
    if spec.trust_remote_code:
        out[ALLOW_REMOTE_CODE_ENV] = "1"
    return {k: v for k, v in out.items() if v}
