"""`brigade up` against a real three-master Redis Cluster (the session's): every service as a process
on `redis+cluster://`, rq's queues on a single redis-server `up` starts for them, a few demo steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import redis
from test_up import processes_using

from brigade import keys
from brigade.redis_clients import redis_py_url


def test_brigade_up_runs_on_a_redis_cluster(tmp_path, redis_cluster, redis_cluster_url):
    out, steps = tmp_path / "run", 6
    env = {k: v for k, v in os.environ.items() if k != "BRIGADE_RQ_REDIS_URL"}
    env["BRIGADE_REDIS_URL"] = redis_cluster_url
    proc = subprocess.run(
        [sys.executable, "-m", "brigade_cli.main", "up", "--demo", "--run", "on-cluster", "--max-steps", str(steps),
         "--workers", "1", "--out", str(out), "--max-wall", "300"],
        capture_output=True, text=True, env=env, timeout=420,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "started redis-server for rq's queues" in proc.stdout and "started redis-server at" not in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps and summary["adapter_versions"] == steps
    # the run's state is in the cluster, every key of it in the slot of its hash tag
    r = redis.RedisCluster.from_url(redis_py_url(redis_cluster_url))
    k = keys.RunKeys("on-cluster")
    assert r.zscore(keys.RUN_INDEX, "on-cluster") == 0 and int(r.get(k.learner_step)) == steps
    slot = r.keyslot(k.spec)
    owner = r.get_node_from_key(k.spec)
    node_keys = {x.decode() if isinstance(x, bytes) else x
                 for x in r.execute_command("CLUSTER GETKEYSINSLOT", slot, 1000, target_nodes=owner)}
    assert {k.work, k.rollouts, k.consumed, k.events, k.spec, k.prompts} <= node_keys
    assert all(r.keyslot(key) == slot for key in node_keys)
    r.close()
    assert processes_using(str(out)) == {}
