"""`brigade export RUN OUT`: a run's trained adapter as a folder that loads anywhere.

What a TRL user expects after `trainer.train()`: a PEFT folder that `AutoPeftModelForCausalLM` and
`PeftModel.from_pretrained` load in a fresh process, with no network and no brigade installed. So
the folder holds the adapter exactly as the evaluator scored it (the published version's tensors),
an `adapter_config.json` whose `base_model_name_or_path` is what the base really is (the Hub id and
revision, or the local folder of a converted GGUF, a mirrored bucket model or the demo model,
never brigade's alias), the tokenizer with its chat template, a model card (`README.md`, the
Hub's format) and the run's plots. `merge=True` writes the base with the adapter merged in instead,
for plain `AutoModelForCausalLM`. Everything is read from the run's bucket: a live run and a
finished one (proxy and Redis gone) export the same way.

The folder is written beside OUT under a temporary name and renamed into place: an export that
fails leaves nothing half-written, and an existing OUT is never touched.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import typer

from brigade.config import ConfigError

# written into every exported folder: where it came from (run, version, bucket, base, conversion)
EXPORT_INFO = "brigade_export.json"
# bucket GETs at once when reading a run's metrics and evaluations (one small object per step)
READ_CONCURRENCY = 16


@dataclass
class RunRecord:
    """What the bucket holds about a run: everything an export and its model card need."""
    run: str
    bucket: str
    spec: object                                  # pb.RunSpec, as the proxy stored it (run.pb)
    versions: list[int]                           # published adapter versions, ascending
    evals: dict[int, dict] = field(default_factory=dict)   # version -> the evaluator's result
    steps: dict[int, int] = field(default_factory=dict)    # version -> learner step (evaluated ones, the chosen)
    metrics: list[dict] = field(default_factory=list)      # the learner's per-step metrics, by step

    def heldout(self, version: int) -> float | None:
        return self.scores.get(version)

    @property
    def scores(self) -> dict[int, float]:
        """version -> held-out score, for the versions the evaluator scored, ascending."""
        from brigade_cli.plots import heldout_score

        return {v: s for v in sorted(self.evals) if (s := heldout_score(self.evals[v])) is not None}


@dataclass
class Base:
    """The base model as a loader outside brigade must name it."""
    name_or_path: str            # a Hub id, or an absolute local folder
    revision: str | None = None
    hub_id: str | None = None    # for the model card's `base_model`, when the base is a Hub model
    origin: str = ""             # one sentence: where it came from
    conversion: dict | None = None  # a GGUF's conversion record (brigade.gguf_models.MARKER)


@dataclass
class Exported:
    folder: Path
    run: str
    version: int
    step: int
    heldout: float | None
    base: Base
    merged: bool
    hub_url: str = ""


def default_bucket(run: str) -> str:
    """`--bucket`'s default: BRIGADE_BUCKET, else the bucket `brigade up` keeps in the run's folder
    (`./brigade-runs/<run>/bucket/`), else the services' default bucket."""
    from brigade.settings import BUCKET

    if os.environ.get("BRIGADE_BUCKET"):
        return os.environ["BRIGADE_BUCKET"]
    local = Path("brigade-runs") / run / "bucket"
    return f"file://{local.resolve()}" if local.is_dir() else BUCKET.default


def export_command(run: str, bucket: str, out: str = "OUT") -> str:
    """The shell command that exports `run`'s result: what `up` and `real` print at their end."""
    flag = "" if default_bucket(run) == bucket else f" --bucket {bucket}"
    return f"brigade export {run} {out}{flag}"


# ---------------------------------------------------------------- reading the bucket

async def read_run(bucket_url: str, run: str) -> RunRecord:
    from brigade import keys
    from brigade.bucket import ObjectNotFound, open_bucket
    from brigade.v1 import brigade_pb2 as pb

    async with open_bucket(bucket_url) as bucket:
        try:
            spec = pb.RunSpec.FromString(await bucket.get(keys.run_spec_key(run)))
        except ObjectNotFound:
            raise ConfigError(f"no run {run!r} in bucket {bucket_url} (no {keys.run_spec_key(run)}); "
                              "--bucket names the run's bucket") from None
        versions = sorted(_version_of(k) for k in await bucket.list(f"runs/{run}/adapters/")
                          if k.endswith("/manifest.pb"))
        limit = asyncio.Semaphore(READ_CONCURRENCY)

        async def json_of(key: str) -> dict:
            async with limit:
                return json.loads(await bucket.get(key))

        eval_keys = [k for k in await bucket.list(f"runs/{run}/evals/") if k.endswith(".json")]
        metric_keys = [k for k in await bucket.list(f"runs/{run}/metrics/") if k.endswith(".json")]
        evals = await asyncio.gather(*(json_of(k) for k in eval_keys))
        metrics = await asyncio.gather(*(json_of(k) for k in metric_keys))
        record = RunRecord(run, bucket_url, spec, [v for v in versions if v > 0],
                           {int(e["version"]): e for e in evals if isinstance(e.get("version"), int)},
                           metrics=sorted(metrics, key=lambda m: m.get("step", 0)))
        record.steps = await _steps_of(bucket, run, set(record.evals) | set(record.versions[-1:]))
    return record


def _version_of(key: str) -> int:
    folder = key.rsplit("/", 2)[-2]  # runs/<run>/adapters/v00000012/manifest.pb
    return int(folder[1:])


async def _steps_of(bucket, run: str, versions: set[int]) -> dict[int, int]:
    from brigade import adapters

    manifests = await asyncio.gather(*(adapters.read_manifest(bucket, run, v) for v in sorted(versions)))
    return {m.version: m.step for m in manifests}


def choose_version(record: RunRecord, version: int | None, best: bool) -> int:
    """The version to export: `version` when given, the best held-out score with `best` (the later
    version on a tie: it trained longer for the same score), else the newest."""
    if not record.versions:
        raise ConfigError(f"run {record.run} has published no adapter yet in {record.bucket}")
    if version is not None and best:
        raise ConfigError("--version and --best choose the version two ways: give one")
    if version is not None:
        if version not in record.versions:
            raise ConfigError(f"run {record.run} has no adapter v{version} (published: v{record.versions[0]}.."
                              f"v{record.versions[-1]})")
        return version
    if best:
        from brigade_cli.plots import best_version

        top = best_version({v: s for v, s in record.scores.items() if v in record.versions})
        if top is None:
            raise ConfigError(f"run {record.run}: the evaluator recorded no held-out score (eval_every "
                              f"{record.spec.eval_every}), so there is no best; --version N or the newest")
        return top[0]
    return record.versions[-1]


# ---------------------------------------------------------------- the base model

def resolve_base(spec) -> Base:
    """What `spec.model` really is, for a loader that knows nothing of brigade's aliases."""
    from brigade.gguf_models import MARKER, ensure_converted, gguf_general, gguf_source
    from brigade.mirror import is_bucket_uri
    from brigade.model import resolve_model

    model = spec.model
    if model == "demo":
        return Base(resolve_model("demo"), origin="brigade's demo model (a character-level Llama built locally)")
    if is_bucket_uri(model):
        return Base(resolve_model(model), origin=f"mirrored from {model}")
    if (source := gguf_source(model)) is not None:
        folder = ensure_converted(model, log=lambda line: None)
        conversion = json.loads((Path(folder) / MARKER).read_text()) | {"gguf_metadata": gguf_general(source)}
        return Base(folder, origin=f"converted by brigade from the GGUF file {conversion['source']} "
                                   f"(sha256 {conversion.get('sha256', '?')[:16]}..., dequantized to float32)",
                    conversion=conversion)
    if Path(model).expanduser().exists():
        return Base(str(Path(model).expanduser().resolve()), origin="a local folder")
    return Base(model, revision=spec.revision or None, hub_id=model,
                origin=f"the Hugging Face Hub{f' at revision {spec.revision}' if spec.revision else ''}")


# ---------------------------------------------------------------- writing the folder

def export_run(run: str, out: str | os.PathLike, *, bucket: str = "", version: int | None = None,
               best: bool = False, merge: bool = False, push_to_hub: str = "", private: bool = False,
               log=lambda line: None) -> Exported:
    """Export `run`'s adapter (the newest version, `version`, or the best held-out one) to `out`.
    `merge`: the merged model instead of the adapter. `push_to_hub`: then upload the folder to that
    Hub repository. Bad input is a ConfigError with one line, before anything is written."""
    out = Path(out).expanduser().resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not empty; give a new folder (nothing was written)")
    bucket = bucket or default_bucket(run)
    log(f"reading run {run} from {bucket}")
    record = asyncio.run(read_run(bucket, run))
    chosen = choose_version(record, version, best)
    score = record.heldout(chosen)
    log(f"adapter v{chosen} (step {record.steps.get(chosen, '?')}"
        f"{f', held-out {score:.3f}' if score is not None else ''}) of {len(record.versions)} published")
    base = resolve_base(record.spec)
    log(f"base model: {base.name_or_path}: {base.origin}")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write(record, chosen, base, tmp, merge)
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    done = Exported(out, run, chosen, record.steps.get(chosen, 0), score, base, merge)
    if push_to_hub:
        log(f"pushing {out} to the Hub repository {push_to_hub}")
        done.hub_url = push_folder(out, push_to_hub, private=private,
                                   message=f"brigade run {run}: adapter v{chosen}{' (merged)' if merge else ''}")
    return done


def _write(record: RunRecord, version: int, base: Base, folder: Path, merge: bool) -> None:
    from brigade import adapters
    from brigade.bucket import open_bucket
    from brigade.model import load_tokenizer

    async def read():
        async with open_bucket(record.bucket) as bucket:
            return await adapters.read_version(bucket, record.run, version)

    manifest, files = asyncio.run(read())
    config = json.loads(bytes(files[adapters.CONFIG]))
    config.update(base_model_name_or_path=base.name_or_path, revision=base.revision, inference_mode=True)
    state = {k: v.clone() for k, v in adapters.decode(files, float32=False).items()}  # bf16 as published
    adapter_dir = folder / ".adapter" if merge else folder
    _write_adapter(adapter_dir, state, config)
    tokenizer = load_tokenizer(record.spec, base.name_or_path)
    if merge:
        _merge(record.spec, base, adapter_dir, folder)
        shutil.rmtree(adapter_dir)
    tokenizer.save_pretrained(folder)
    plots = _plots(record, folder)
    (folder / EXPORT_INFO).write_text(json.dumps({
        "run": record.run, "version": version, "step": manifest.step, "bucket": record.bucket,
        "adapter_sha256": {f.name: f.sha256 for f in manifest.files}, "heldout": record.heldout(version),
        "merged": merge, "base_model_name_or_path": base.name_or_path, "revision": base.revision,
        "base_origin": base.origin, "gguf_conversion": base.conversion, "exported_unix": time.time(),
    }, indent=2) + "\n")
    from brigade_cli.model_card import model_card

    (folder / "README.md").write_text(model_card(record, version, base, merge, [p.name for p in plots]))


def _write_adapter(folder: Path, state: dict, config: dict) -> None:
    from safetensors.torch import save_file

    from brigade.adapters import WEIGHTS

    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / WEIGHTS), metadata={"format": "pt"})
    os.chmod(folder / WEIGHTS, 0o644)  # safetensors creates it owner-only; the folder is meant to be shared
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _merge(spec, base: Base, adapter_dir: Path, folder: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from brigade.model import pinned, torch_dtype
    from brigade.pretrained import from_pretrained

    model = from_pretrained(AutoModelForCausalLM, base.name_or_path, dtype=torch_dtype(spec, torch.device("cpu")),
                            use_safetensors=True, **pinned(spec))
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(folder, safe_serialization=True)


def _plots(record: RunRecord, folder: Path) -> list[Path]:
    """The run's curves (brigade_cli.plots), when matplotlib is installed: the card shows them."""
    if not record.metrics:
        return []
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return []
    from brigade_cli.plots import plot_run

    evals = [(record.steps[v], e) for v, e in sorted(record.evals.items()) if v in record.steps]
    return plot_run(record.metrics, folder, title=f"run {record.run}", evals=evals)


# ---------------------------------------------------------------- the Hub

def push_folder(folder: Path, repo_id: str, *, private: bool = False, message: str = "") -> str:
    """Upload `folder` to the Hub model repository `repo_id` (created if missing) with
    huggingface_hub, which reads the token (HF_TOKEN or `hf auth login`) and the endpoint
    (HF_ENDPOINT) itself. The folder stays on disk whatever happens. Returns the repository's URL."""
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise ConfigError("pushing to the Hub needs huggingface_hub (pip install huggingface_hub); the "
                          f"export is in {folder}") from None
    api = HfApi()
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message=message or "brigade export")
    except Exception as e:  # noqa: BLE001 - HTTP, auth and network errors come in many types: one line
        raise ConfigError(f"pushing {folder} to {repo_id} failed ({type(e).__name__}: {str(e).splitlines()[0]}); "
                          f"the export is in {folder}") from None
    return str(url)


# ---------------------------------------------------------------- the command

def export(
    run: str = typer.Argument(..., help="The run id."),
    out: str = typer.Argument(..., help="The folder to write (new or empty)."),
    version: int = typer.Option(None, "--version", help="Export this adapter version (default: the newest)."),
    best: bool = typer.Option(False, "--best", help="Export the version with the best held-out score."),
    merge: bool = typer.Option(False, "--merge", help="Write the base model with the adapter merged in "
                                                     "(safetensors, for plain AutoModelForCausalLM)."),
    bucket: str = typer.Option("", "--bucket", help="The run's bucket (default: BRIGADE_BUCKET, else "
                                                    "./brigade-runs/RUN/bucket when it exists)."),
    push_to_hub: str = typer.Option("", "--push-to-hub", metavar="REPO",
                                    help="Then upload the folder to this Hub model repository."),
    private: bool = typer.Option(False, "--private", help="Create the Hub repository private."),
) -> None:
    """Write a run's adapter (or merged model) as a folder that loads without brigade, with a model card."""
    started = time.monotonic()
    try:
        done = export_run(run, out, bucket=bucket, version=version, best=best, merge=merge,
                          push_to_hub=push_to_hub, private=private, log=typer.echo)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    size = sum(p.stat().st_size for p in done.folder.rglob("*") if p.is_file())
    typer.echo(f"wrote {done.folder} ({size / 1e6:.1f} MB) in {time.monotonic() - started:.1f} s")
    if done.hub_url:
        typer.echo(f"pushed to {done.hub_url}")
    loader = "AutoModelForCausalLM" if merge else "AutoPeftModelForCausalLM"
    typer.echo(f"load it with: {loader}.from_pretrained({str(done.folder)!r})")
