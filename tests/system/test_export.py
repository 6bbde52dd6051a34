"""Taking the result out, end to end. `brigade up` runs a short demo with the evaluator, a tracker
and `push_to_hub`; at its end the last version has its held-out score, the tracker's files are in
the run's folder, one line names the final adapter and the export command, and the final adapter
went to the Hub. `brigade export` then writes folders that load in a fresh process with no network
and no brigade (the adapter with AutoPeftModelForCausalLM and PeftModel, the merged model with
AutoModelForCausalLM), picks the best version, and refuses bad requests without writing anything.

The Hub is the one fake (brigade_testing.fake_hub: a local endpoint that records the upload); the
model, adapters, evaluator, tracker and bucket are real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from brigade.demo.task import DEMO_RUN
from brigade_testing.fake_hub import FakeHub

RUN = "exp"
STEPS = 5

# loads the exported folders with brigade unimportable and the Hub offline, and compares logits
LOAD_ELSEWHERE = r'''
import importlib.abc, json, sys

class NoBrigade(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0].startswith("brigade"):
            raise ImportError(f"brigade is not installed here ({name})")

sys.meta_path.insert(0, NoBrigade())
import torch
from peft import AutoPeftModelForCausalLM, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

adapter, merged = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(adapter)
enc = tokenizer(["3+4="], return_tensors="pt")
inputs = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
base_path = json.load(open(adapter + "/adapter_config.json"))["base_model_name_or_path"]
with torch.no_grad():
    auto = AutoPeftModelForCausalLM.from_pretrained(adapter).eval()(**inputs).logits
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), adapter).eval()(**inputs).logits
    base = AutoModelForCausalLM.from_pretrained(base_path).eval()(**inputs).logits
    merged_logits = AutoModelForCausalLM.from_pretrained(merged).eval()(**inputs).logits
print(json.dumps({"adapter_vs_base": (auto - base).abs().max().item(), "peft_vs_auto": (peft - auto).abs().max().item(),
                  "merged_vs_adapter": (merged_logits - auto).abs().max().item(),
                  "merged_tokenizer": AutoTokenizer.from_pretrained(merged).vocab_size == tokenizer.vocab_size,
                  "brigade_modules": sorted(m for m in sys.modules if m.startswith("brigade"))}))
'''


def brigade(args: list[str], cwd: Path, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "brigade_cli.main", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def hub():
    server = FakeHub()
    yield server
    server.close()


@pytest.fixture(scope="module")
def finished(tmp_path_factory, hub):
    """A finished demo run in `<folder>/brigade-runs/exp/` (up's default, from the folder)."""
    folder = tmp_path_factory.mktemp("export")
    spec = dict(DEMO_RUN, run_id=RUN, max_steps=STEPS, eval_every=2, report_to=["tensorboard"],
                push_to_hub=True, hub_model_id="someone/exp")
    (folder / "spec.yaml").write_text(yaml.safe_dump(spec))
    env = dict(os.environ, BRIGADE_REDIS_URL="redis://127.0.0.1:1/0", HF_ENDPOINT=hub.url, HF_TOKEN="hf_test",
               HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_OFFLINE="0")  # the fake Hub is reachable whatever CI sets
    env.pop("BRIGADE_BUCKET", None)
    env.pop("BRIGADE_TRACKER_DIR", None)
    proc = brigade(["up", "--spec", "spec.yaml", "-n", "1", "--max-wall", "300"], folder, env, timeout=420)
    return folder, env, proc


def test_up_ends_with_the_last_evaluation_its_trackers_the_export_line_and_the_push(finished, hub):
    folder, _, proc = finished
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = folder / "brigade-runs" / RUN
    # the evaluator finished before the stop: v2, v4 (eval_every 2) and v5, the last, all scored
    evals = sorted(p.name for p in (out / "bucket" / "runs" / RUN / "evals").iterdir())
    assert evals == ["v00000002.json", "v00000004.json", "v00000005.json"], evals
    summary = json.loads((out / "summary.json").read_text())
    last = json.loads((out / "bucket" / "runs" / RUN / "evals" / "v00000005.json").read_text())
    assert summary["heldout_last"] == last["reward_mean"]
    assert "evaluator: finishing the evaluations of the run (v5 last)" in proc.stdout
    # the tracker wrote in the run's folder, not in the folder `up` was started from
    assert list((out / "trackers" / "tensorboard" / RUN).glob("events.out.tfevents.*"))
    assert not (folder / "trackers").exists()
    # one line names the final adapter and the command that takes it out (no --bucket: it is found)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("final adapter:"))
    assert f"v{STEPS}, held-out {last['reward_mean']:.3f}" in line and f"brigade export {RUN} OUT" in line, line
    assert "--bucket" not in line, line
    assert f"runs/{RUN}/adapters/v{STEPS:08d}/" in line
    # push_to_hub: the final adapter's export went to the repository, byte for byte
    commits = [c for c in hub.commits if c.repo == "someone/exp"]
    assert len(commits) == 1 and commits[0].token == "hf_test", hub.commits
    exported = out / "export"
    for name in ("adapter_model.safetensors", "adapter_config.json", "README.md", "tokenizer_config.json"):
        assert commits[0].files[name] == (exported / name).read_bytes(), name
    assert json.loads((exported / "brigade_export.json").read_text())["version"] == STEPS


def test_an_export_loads_without_brigade_or_a_network(finished):
    folder, env, _ = finished
    adapter = brigade(["export", RUN, "adapter"], folder, env)
    assert adapter.returncode == 0, adapter.stderr
    assert "AutoPeftModelForCausalLM.from_pretrained" in adapter.stdout
    merged = brigade(["export", RUN, "merged", "--merge"], folder, env)
    assert merged.returncode == 0, merged.stderr
    config = json.loads((folder / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] != "demo" and Path(config["base_model_name_or_path"]).is_dir()
    assert (folder / "merged" / "model.safetensors").exists() and not (folder / "merged" / "adapter_config.json").exists()
    card = (folder / "adapter" / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["library_name"] == "peft" and "grpo" in meta["tags"]
    for text in ("## Held-out curve", "| v5 | 5 |", "## Training health", "rejection rate", "## Run spec",
                 "![curves_vs_step.png](curves_vs_step.png)"):
        assert text in card, text
    assert (folder / "adapter" / "curves_vs_step.png").read_bytes()[:4] == b"\x89PNG"
    clean = {k: v for k, v in env.items() if not k.startswith("BRIGADE")} | {"HF_HUB_OFFLINE": "1",
                                                                             "TRANSFORMERS_OFFLINE": "1"}
    loaded = subprocess.run([sys.executable, "-c", LOAD_ELSEWHERE, str(folder / "adapter"), str(folder / "merged")],
                            env=clean, capture_output=True, text=True, timeout=180)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    got = json.loads(loaded.stdout.splitlines()[-1])
    assert got["brigade_modules"] == []
    assert got["adapter_vs_base"] > 1e-4          # the adapter is the trained one, not a no-op
    assert got["peft_vs_auto"] < 1e-5             # both PEFT loaders agree
    assert got["merged_vs_adapter"] < 1e-3        # merging changes nothing but the layout
    assert got["merged_tokenizer"]


def test_best_picks_the_top_held_out_version_and_bad_requests_write_nothing(finished):
    folder, env, _ = finished
    evals_dir = folder / "brigade-runs" / RUN / "bucket" / "runs" / RUN / "evals"
    scores = {json.loads(p.read_text())["version"]: json.loads(p.read_text())["reward_mean"] for p in evals_dir.iterdir()}
    top = max(scores.items(), key=lambda vs: (vs[1], vs[0]))[0]
    best = brigade(["export", RUN, "best", "--best"], folder, env)
    assert best.returncode == 0, best.stderr
    assert json.loads((folder / "best" / "brigade_export.json").read_text())["version"] == top
    two = brigade(["export", RUN, "two", "--version", "2"], folder, env)
    assert two.returncode == 0 and json.loads((folder / "two" / "brigade_export.json").read_text())["step"] == 2

    (folder / "taken").mkdir()
    (folder / "taken" / "mine.txt").write_text("keep me")
    for args, words in ((["export", RUN, "nine", "--version", "99"], "has no adapter v99"),
                        (["export", RUN, "taken"], "exists and is not empty"),
                        (["export", RUN, "both", "--version", "2", "--best"], "give one"),
                        (["export", "nosuchrun", "none"], "no run 'nosuchrun'")):
        proc = brigade(args, folder, env, timeout=120)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (folder / "nine").exists() and not (folder / "both").exists()
    assert [p.name for p in (folder / "taken").iterdir()] == ["mine.txt"]
    assert not [p for p in folder.iterdir() if ".tmp-" in p.name]  # nothing half-written left behind
