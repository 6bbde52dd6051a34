"""Learner checkpoints in the bucket: everything needed to continue exactly where a step ended.

    runs/{run}/checkpoints/step-{step:08d}/
        adapter.safetensors      LoRA weights, full precision (the published payload is derived from it)
        optimizer.safetensors    AdamW state tensors, keyed "{param name}:{state key}"
        rng.safetensors          torch (CPU and CUDA) and numpy generator states
        adapter_config.json      the exact PEFT config bytes published with this state
        state.json               step, version, consumed batch ids, the pending ack, scheduler,
                                 optimizer param groups, python RNG, metrics
        manifest.json            sha256 and size of every file above; written LAST

A checkpoint is complete when its manifest.json parses and every file it lists is there with the
sha256 it gives; `read` is that one definition, and resuming (`latest`), saving (`save`) and the
chaos audit all go by it. A crash in the middle of a save leaves a folder without a manifest, which
readers ignore and the next save of that step replaces. A folder with a manifest that is not complete
is damaged (a file cut or corrupted at rest): the learner resumes from the checkpoint before it and,
when it trains that step again, saves it as the next attempt beside the damaged folder
(`step-00000005.1/`, see `keys.checkpoint_prefix`), so a damaged checkpoint costs the steps since the
one before it and nothing is overwritten. The newest complete attempt of a step is that step's.
`prune` keeps the newest few: a checkpoint holds the adapter in float32 and twice that in AdamW
state, ~200 MiB for rank 16 on a 7B model's attention, which every step would otherwise add.
Tensors go to safetensors and everything else to JSON: nothing is pickled, so loading a checkpoint
can never run code.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from brigade import adapters, keys
from brigade.bucket import Bucket, BucketError, CorruptObject, ObjectExists, ObjectNotFound, sha256_hex
from brigade.retry import retry
from brigade_learner.ingest import READ_BACKOFF
from brigade_learner.trainer import Trainer

log = structlog.get_logger()

FORMAT = "brigade-checkpoint-1"
MANIFEST = "manifest.json"
ADAPTER = "adapter.safetensors"
OPTIMIZER = "optimizer.safetensors"
RNG = "rng.safetensors"
CONFIG = "adapter_config.json"
STATE = "state.json"
STEP_DIR = re.compile(r"step-(\d{8})(?:\.(\d+))?/")


class CheckpointError(ValueError):
    """A checkpoint that does not match this learner (another model, LoRA shape or run)."""


@dataclass
class PendingAck:
    """The AckRollouts of the steps since the last commit: sent after the commit's publish, and
    saved in its checkpoint, so a restart replays it (the proxy treats a repeated ack as a no-op)."""

    delivery_ids: list[str] = field(default_factory=list)
    consumed: list[str] = field(default_factory=list)   # batch ids trained on
    rejected: list[str] = field(default_factory=list)   # batch ids refused (empty: those are acked at once)

    def add_trained(self, delivery_ids: list[str], batch_ids: list[str]) -> None:
        self.delivery_ids += delivery_ids
        self.consumed += batch_ids

    def to_json(self) -> dict[str, list[str]]:
        return {"delivery_ids": self.delivery_ids, "consumed": self.consumed, "rejected": self.rejected}

    @classmethod
    def from_json(cls, doc: dict[str, list[str]]) -> PendingAck:
        return cls(list(doc["delivery_ids"]), list(doc["consumed"]), list(doc["rejected"]))


@dataclass
class LearnerState:
    """What the service loop knows beyond the trainer's tensors."""

    step: int = 0                 # optimizer steps taken
    version: int = 0              # adapter version of this state: the one published at `step`,
    #                               or the last one published before it when this step was not
    published: bool = False       # whether `step` publishes `version` (the tail to redo on resume)
    consumed: set[str] = field(default_factory=set)    # every batch id trained on so far
    ack: PendingAck = field(default_factory=PendingAck)
    metrics: list[dict[str, Any]] = field(default_factory=list)  # per step since the last checkpoint


# ---------------------------------------------------------------- encode / decode (no IO)

def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


def encode(trainer: Trainer, state: LearnerState) -> dict[str, bytes]:
    """The files of a checkpoint of `trainer` + `state`."""
    model, opt = trainer.model, trainer.optimizer
    adapter = {k: v.detach().cpu().contiguous() for k, v in adapters.adapter_state(model).items()}

    # optimizer: tensors by parameter NAME (robust to parameter order), groups and scalars in JSON
    names = {id(p): n for n, p in model.named_parameters()}
    opt_state = opt.state_dict()
    index = [names[id(p)] for group in opt.param_groups for p in group["params"]]
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for i, entry in opt_state["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index[i]}:{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(index[i], {})[key] = _jsonable(value)
    groups = []
    for group in opt_state["param_groups"]:
        g = {k: _jsonable(v) for k, v in group.items() if k != "params"}
        g["params"] = [index[i] for i in group["params"]]
        groups.append(g)

    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for d, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"torch_cuda_{d}"] = s
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    rng["numpy_keys"] = torch.from_numpy(np.asarray(np_keys, dtype=np.int64))
    py_version, py_internal, py_gauss = random.getstate()

    # LambdaLR keeps lr_lambdas = [None] for plain functions: the schedule itself is rebuilt from the spec
    scheduler = {k: _jsonable(v) for k, v in trainer.scheduler.state_dict().items()}
    doc = {
        "format": FORMAT,
        "run_id": trainer.spec.run_id,
        "step": state.step,
        "version": state.version,
        "published": state.published,
        "consumed": sorted(state.consumed),
        "ack": state.ack.to_json(),
        "metrics": state.metrics,
        "scheduler": scheduler,
        "optimizer": {"param_groups": groups, "scalars": scalars, "state_params": sorted({index[i] for i in opt_state["state"]})},
        "rng": {"python": [py_version, list(py_internal), py_gauss],
                "numpy": [np_kind, int(np_pos), int(np_has_gauss), float(np_gauss)]},
        "created_ms": int(time.time() * 1000),
    }
    return {
        ADAPTER: st_save(adapter, metadata={"format": FORMAT}),
        OPTIMIZER: st_save(tensors, metadata={"format": FORMAT}),
        RNG: st_save(rng, metadata={"format": FORMAT}),
        CONFIG: trainer.adapter_config_json(),
        STATE: json.dumps(doc, indent=1, sort_keys=True).encode(),
    }


def decode(trainer: Trainer, files: dict[str, bytes]) -> LearnerState:
    """Restore `trainer` in place from checkpoint files and return the loop state."""
    doc = json.loads(files[STATE])
    if doc.get("format") != FORMAT:
        raise CheckpointError(f"not a brigade checkpoint (format {doc.get('format')!r})")
    if doc.get("run_id") != trainer.spec.run_id:
        raise CheckpointError(f"checkpoint of run {doc.get('run_id')!r}, this learner trains {trainer.spec.run_id!r}")
    model, opt = trainer.model, trainer.optimizer
    try:
        adapters.apply(model, st_load(files[ADAPTER]))
    except adapters.InvalidAdapter as e:
        raise CheckpointError(f"checkpoint adapter does not fit this model: {e}") from e

    params = dict(model.named_parameters())
    index = [n for n, p in model.named_parameters() if p.requires_grad]
    position = {n: i for i, n in enumerate(index)}
    saved = doc["optimizer"]
    tensors = st_load(files[OPTIMIZER])
    state: dict[int, dict[str, Any]] = {}
    for name in saved["state_params"]:
        if name not in position:
            raise CheckpointError(f"optimizer state for {name!r}, which is not a trainable parameter here")
        entry = {key: value for key, value in saved["scalars"].get(name, {}).items()}
        prefix = name + ":"
        for key, value in tensors.items():
            if key.startswith(prefix):
                entry[key[len(prefix):]] = value.to(params[name].device)
        state[position[name]] = entry
    groups = []
    for group in saved["param_groups"]:
        g = dict(group)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        missing = [n for n in g["params"] if n not in position]
        if missing:
            raise CheckpointError(f"optimizer groups name parameters this model lacks: {missing[:3]}")
        g["params"] = [position[n] for n in g["params"]]
        groups.append(g)
    if sorted(i for g in groups for i in g["params"]) != list(range(len(index))):
        raise CheckpointError("optimizer groups do not cover this model's trainable parameters")
    opt.load_state_dict({"state": state, "param_groups": groups})
    trainer.scheduler.load_state_dict(doc["scheduler"])

    rng = st_load(files[RNG])
    torch.set_rng_state(rng["torch_cpu"])
    if torch.cuda.is_available():
        states = [rng[k] for k in sorted(rng) if k.startswith("torch_cuda_")]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    kind, pos, has_gauss, gauss = doc["rng"]["numpy"]
    np.random.set_state((kind, rng["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, gauss))
    py_version, py_internal, py_gauss = doc["rng"]["python"]
    random.setstate((py_version, tuple(py_internal), py_gauss))

    return LearnerState(
        step=doc["step"], version=doc["version"], published=doc["published"], consumed=set(doc["consumed"]),
        ack=PendingAck.from_json(doc["ack"]), metrics=doc["metrics"],
    )


# ---------------------------------------------------------------- bucket

def prefix(run: str) -> str:
    return keys.run_prefix(run) + "checkpoints/"


async def save(bucket: Bucket, run: str, step: int, files: dict[str, bytes],
               before_manifest: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Write the files, then the manifest, in the step's first folder that is not damaged. Files of
    an earlier, incomplete attempt there are replaced (plain puts: without a manifest they are not a
    checkpoint); a complete checkpoint is never touched: saving identical files again (a replayed
    step) is a no-op, different ones fail. A damaged folder (a retrain after resuming from the
    checkpoint before it) is left as it is and the save goes to the next attempt's folder.
    `before_manifest` runs between the two (the crash tests' "mid_checkpoint")."""
    listing = {name: {"sha256": sha256_hex(data), "size": len(data)} for name, data in files.items()}
    manifest = {"format": FORMAT, "run_id": run, "step": step, "files": listing}
    attempt = 0
    while (found := await _existing(bucket, run, step, attempt, listing)) == "damaged":
        log.warning("checkpoint_set_aside", step=step, attempt=attempt,
                    note=f"damaged: this step's checkpoint is saved as attempt {attempt + 1} beside it")
        attempt += 1
    if found == "same":
        return manifest
    folder = keys.checkpoint_prefix(run, step, attempt)
    for name in sorted(files):
        await bucket.put(folder + name, files[name])
    before_manifest()
    try:
        await bucket.put_new(folder + MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    except ObjectExists:
        if await _existing(bucket, run, step, attempt, listing) != "same":
            raise CheckpointError(f"another learner saved step {step} at {folder} meanwhile; "
                                  "checkpoints are never overwritten") from None
    return manifest


async def _existing(bucket: Bucket, run: str, step: int, attempt: int, listing: dict[str, Any]) -> str:
    """What is at this attempt's folder: "free" (no manifest), "same" (a manifest of exactly these
    files), "damaged" (a manifest, but not a complete checkpoint); a different complete checkpoint
    is an error: two learners, or a bug, never a retrain."""
    folder = keys.checkpoint_prefix(run, step, attempt)
    try:
        existing = json.loads(await bucket.get(folder + MANIFEST))
    except ObjectNotFound:
        return "free"
    except ValueError:
        return "damaged"
    if isinstance(existing, dict) and existing.get("files") == listing:
        return "same"
    if await load_files(bucket, run, step, attempt) is None:
        return "damaged"
    raise CheckpointError(f"a different complete checkpoint already exists at {folder}; "
                          "checkpoints are never overwritten")


async def _folders(bucket: Bucket, run: str) -> dict[int, dict[int, list[str]]]:
    """step -> attempt -> the keys under that attempt's folder."""
    root = prefix(run)
    folders: dict[int, dict[int, list[str]]] = {}
    for key in await bucket.list(root):
        m = STEP_DIR.match(key[len(root):])
        if m:
            folders.setdefault(int(m.group(1)), {}).setdefault(int(m.group(2) or 0), []).append(key)
    return folders


async def steps(bucket: Bucket, run: str) -> list[int]:
    """Every step with any checkpoint file (complete or not), ascending."""
    return sorted(await _folders(bucket, run))


async def step_attempts(bucket: Bucket, run: str) -> dict[int, list[int]]:
    """step -> its attempts with any file, ascending (0 unless a damaged checkpoint was retrained):
    one listing, for a caller that reads many steps."""
    return {step: sorted(by_attempt) for step, by_attempt in (await _folders(bucket, run)).items()}


async def attempts(bucket: Bucket, run: str, step: int) -> list[int]:
    """The attempts of `step` with any file, ascending."""
    return (await step_attempts(bucket, run)).get(step, [])


# a prune keeps at least this many: the one before the newest is what a damaged newest one costs
MIN_KEPT = 2


async def prune(bucket: Bucket, run: str, keep: int) -> list[int]:
    """Delete every checkpoint folder older than the newest `keep` (at least MIN_KEPT) steps with a
    manifest (keep <= 0: keep all); returns the steps removed. Folders newer than the newest manifest
    are left alone (a save in progress, or one the next save replaces). Each manifest goes first: a
    folder without one is never resumed from, so a prune cut short leaves files the next prune removes.
    A manifest is taken for a complete checkpoint here without reading the files (a prune reads no
    tensors); MIN_KEPT is what keeps a good one when the newest turns out damaged."""
    if keep <= 0:
        return []
    folders = await _folders(bucket, run)
    complete = sorted(step for step, by_attempt in folders.items()
                      if any(n.endswith("/" + MANIFEST) for names in by_attempt.values() for n in names))
    if not complete:
        return []
    kept = set(complete[-max(keep, MIN_KEPT):])
    doomed = [step for step in sorted(folders) if step < complete[-1] and step not in kept]
    for step in doomed:
        names = [n for by_attempt in folders[step].values() for n in by_attempt]
        for key in sorted(names, key=lambda k: not k.endswith("/" + MANIFEST)):
            await bucket.delete(key)
    return doomed


READ_ATTEMPTS = 4  # a torn or corrupted read is read again before a checkpoint is judged damaged


async def load_files(bucket: Bucket, run: str, step: int, attempt: int = 0,
                     attempts: int = READ_ATTEMPTS) -> dict[str, bytes] | None:
    """The files of the checkpoint at `step` (`attempt`), each verified against the manifest, if it
    is complete; None when the manifest is missing (a save that never finished) or the folder is
    damaged. A read that fails (torn body, sha256 mismatch in flight, an outage) is retried first; an
    outage that outlasts the retries raises: resuming from an older checkpoint instead would collide
    with this one."""
    def log_retry(n: int, delay: float, e: BaseException) -> None:
        log.warning("checkpoint_read_retry", step=step, attempt=attempt, read=n, error=str(e)[:300])

    folder = keys.checkpoint_prefix(run, step, attempt)
    try:
        return await retry(lambda: _read_checkpoint(bucket, folder, step),
                           retryable=lambda e: isinstance(e, BucketError), backoff=READ_BACKOFF, attempts=attempts,
                           on_retry=log_retry)
    except CorruptObject as e:  # corrupted on every read
        log.warning("checkpoint_damaged", step=step, attempt=attempt, error=str(e)[:300])
        return None


async def read(bucket: Bucket, run: str, step: int, listed: list[int] | None = None
               ) -> tuple[int, dict[str, bytes]] | None:
    """The step's checkpoint: its newest complete attempt and that attempt's files, or None.
    `listed`: the step's attempts, when the caller has listed them already (step_attempts)."""
    for attempt in reversed(listed if listed is not None else await attempts(bucket, run, step)):
        files = await load_files(bucket, run, step, attempt)
        if files is not None:
            return attempt, files
    return None


async def _read_checkpoint(bucket: Bucket, folder: str, step: int) -> dict[str, bytes] | None:
    """One read of the folder. A BucketError (CorruptObject included) may be the read's fault, not
    the checkpoint's, so it is raised to be read again; what is damaged for good returns None."""
    try:
        raw = await bucket.get(folder + MANIFEST)
    except ObjectNotFound:
        return None
    try:
        manifest = json.loads(raw)
    except ValueError as e:
        raise CorruptObject(f"manifest is not JSON: {e}", key=folder + MANIFEST) from None
    try:
        if manifest.get("format") != FORMAT or manifest.get("step") != step:
            raise ValueError(f"manifest says format {manifest.get('format')!r} step {manifest.get('step')!r}")
        files = {}
        for name, info in manifest["files"].items():
            if "/" in name or name.startswith("."):
                raise ValueError(f"manifest names a file outside its folder: {name!r}")
            files[name] = await bucket.get(folder + name, sha256=info["sha256"])
        missing = {ADAPTER, OPTIMIZER, RNG, CONFIG, STATE} - set(files)
        if missing:
            raise ValueError(f"manifest lacks {sorted(missing)}")
        return files
    except (ObjectNotFound, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("checkpoint_damaged", step=step, error=str(e)[:300])
        return None


async def read_ack(bucket: Bucket, run: str, step: int) -> PendingAck | None:
    """The ack the commit at `step` sent, from its newest attempt's state.json alone (a few KB, not
    the tensors); None when that checkpoint is pruned, incomplete or its state.json is damaged."""
    for attempt in reversed(await attempts(bucket, run, step)):
        folder = keys.checkpoint_prefix(run, step, attempt)
        try:
            manifest = json.loads(await bucket.get(folder + MANIFEST))
            doc = json.loads(await bucket.get(folder + STATE, sha256=manifest["files"][STATE]["sha256"]))
            return PendingAck.from_json(doc["ack"])
        except ObjectNotFound:
            continue
        except (CorruptObject, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("checkpoint_ack_unreadable", step=step, attempt=attempt, error=str(e)[:300])
    return None


async def latest(bucket: Bucket, run: str) -> tuple[int, dict[str, bytes]] | None:
    """The newest complete checkpoint; incomplete or damaged ones are skipped."""
    by_step = await step_attempts(bucket, run)
    for step in sorted(by_step, reverse=True):
        found = await read(bucket, run, step, by_step[step])
        if found is not None:
            return step, found[1]
        log.info("checkpoint_skipped", step=step, reason="incomplete or damaged")
    return None
