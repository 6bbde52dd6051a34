"""brigade.GRPOTrainer as a TRL user writes it: a script with its own reward function and a
`datasets.Dataset` built in memory, TRL's GRPOConfig names, `train()` then `save_model()`. The
script runs as `python train.py`; `train()` runs the whole system (`brigade up`) in a child
process, the services import the reward function from the script, the dataset reaches them
through the run's bucket, and the saved folder loads as a PEFT adapter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import yaml

SCRIPT = '''
from datasets import Dataset

from brigade import GRPOConfig, GRPOTrainer


def correct(completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


if __name__ == "__main__":
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    args = GRPOConfig(output_dir="run", run_name="trl-api", max_steps=3, num_generations=4, max_completion_length=4,
                      learning_rate=2e-3, per_device_train_batch_size=16, beta=0.0, logging_steps=1)
    trainer = GRPOTrainer(model="demo", reward_funcs=[correct], args=args, train_dataset=Dataset.from_list(rows))
    result = trainer.train()
    print("STEPS", result.global_step)
    print("SAVED", trainer.save_model())
'''


def test_a_trl_style_script_trains_and_saves(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    env = dict(os.environ, BRIGADE_REDIS_URL="redis://127.0.0.1:1/0")
    env.pop("BRIGADE_BUCKET", None)
    proc = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=420)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "STEPS 3" in proc.stdout
    run = tmp_path / "run"
    spec = yaml.safe_load((run / "spec.yaml").read_text())
    # TRL's names became brigade's: 16 completions / 4 generations = 4 prompts a step
    assert spec["sampling"] == {"group_size": 4, "max_new_tokens": 4} and spec["prompts_per_batch"] == 4
    assert spec["rewards"] == [{"function": "train:correct"}]
    assert spec["dataset"] == f"file://{run / 'bucket'}/runs/trl-api/data/train.jsonl"
    rows = (run / "bucket" / "runs" / "trl-api" / "data" / "train.jsonl").read_text().splitlines()
    assert len(rows) == 100 and json.loads(rows[0]) == {"prompt": "0+0=", "answer": "0"}
    # the services called the script's function: its reward is in the learner's metrics
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3 and all("rewards/correct/mean" in m for m in metrics), metrics[-1]
    saved = run / "final"
    assert f"SAVED {saved}" in proc.stdout
    config = json.loads((saved / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] != "demo" and (saved / "README.md").exists()


def test_the_trainer_sends_a_run_to_a_fleet_and_follows_it(tmp_path, capfd):
    """GRPOTrainer(proxy=...): a fleet already running (proxy, janitor; the learner and a worker
    started for the run once it exists, as an operator's would be) trains the run the trainer
    created; train() prints a line per step and returns at the end; save_model exports it."""
    import threading
    import time

    from brigade import GRPOConfig, GRPOTrainer
    from brigade_harness.system import LocalSystem

    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    with LocalSystem(tmp_path / "fleet", run="fleet-api") as system:
        system.start_servers()
        system.start_proxy()
        system.spawn("janitor", ["janitor"])
        trainer = GRPOTrainer("demo", "demo_sum", GRPOConfig(run_name="fleet-api", max_steps=2, num_generations=4,
                                                             per_device_train_batch_size=16, max_completion_length=4),
                              train_dataset=rows, proxy=system.proxy, bucket=system.bucket)
        done: dict = {}
        follower = threading.Thread(target=lambda: done.update(out=trainer.train()), daemon=True)
        follower.start()
        deadline = time.monotonic() + 60
        while system.get_run("fleet-api") is None:
            assert time.monotonic() < deadline and follower.is_alive(), "the trainer did not create the run"
            time.sleep(0.5)
        system.spawn("learner", ["learner"])
        system.spawn("rollout-0", ["rollout", "--exit-when-finished"])
        follower.join(240)
        assert done["out"].global_step == 2, done
        printed = capfd.readouterr().out
        assert "run fleet-api created on" in printed and "step 2/2" in printed, printed
        saved = trainer.save_model(str(tmp_path / "final"))
    assert json.loads((saved / "brigade_export.json").read_text())["version"] == 2
