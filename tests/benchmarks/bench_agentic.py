"""The agentic quick start, as a user runs it: how fast its reward rises, and where a step's time goes.

Runs `relax submit recipes/quickstart_agent.yaml --executor local` (a fresh process in a temp dir, in a
network namespace with only loopback up, HF_HUB_OFFLINE=1) and prints from its metrics.jsonl:

    wall_s               the whole command, start-up and shutdown included
    reward first5/last5  mean reward of the first and the last 5 steps
    doubled_at           the first step whose 5-step mean reward is at least twice the first 5 steps'
                         mean, and the seconds from the command's start to it
    rollout_s/train_s    mean seconds per step of multi-turn rollout and of training
    turns/s              model turns generated per second of rollout

The last line is one JSON object with the same numbers. About a minute; not part of the test suite:

    python3 tests/benchmarks/bench_agentic.py [KEY=VALUE ...]     # recipe overrides, e.g. train.steps=200
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import fmean

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "quickstart_agent.yaml"
NETNS_ENV = "RELAX_BENCH_NETNS"


def main(overrides: list[str]) -> None:
    if os.environ.get(NETNS_ENV) != "1":  # again, inside a loopback-only network namespace
        unshare = ["unshare", "--net", *([] if os.getuid() == 0 else ["--map-root-user"])]
        env = os.environ | {NETNS_ENV: "1", "HF_HUB_OFFLINE": "1"}
        os.execvpe("unshare", [*unshare, "bash", "-c", 'ip link set lo up && exec "$@"', "bash", sys.executable,
                               __file__, *overrides], env)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.time()
        proc = subprocess.run([sys.executable, "-m", "relax_cli.main", "submit", str(RECIPE), *overrides,
                               "--executor", "local", "--run-dir", "runs/bench"], cwd=tmp, capture_output=True,
                              text=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
        wall = time.time() - start
        if proc.returncode != 0:
            sys.exit(f"the run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        rows = [json.loads(line) for line in (Path(tmp) / "runs/bench/metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in rows]
    first, last = fmean(rewards[:5]), fmean(rewards[-5:])
    doubled = next((i + 5 for i in range(len(rewards) - 4) if fmean(rewards[i:i + 5]) >= 2 * first), None)
    doubled_s = rows[doubled - 1]["time"] - start if doubled else None
    rollout_s, train_s = fmean(r["rollout_s"] for r in rows), fmean(r["train_s"] for r in rows)
    turns = sum(r["turns_mean"] * r["num_samples"] for r in rows if "num_samples" in r)
    turns_per_s = turns / sum(r["rollout_s"] for r in rows) if turns else None
    print(f"wall {wall:.1f}s | {len(rows)} steps | reward first5 {first:.3f} last5 {last:.3f} "
          f"({last / first:.1f}x) | doubled at step {doubled} ({doubled_s and round(doubled_s, 1)} s from start)")
    print(f"per step: rollout {rollout_s:.3f}s train {train_s:.3f}s | "
          f"{turns_per_s and round(turns_per_s)} model turns/s of rollout")
    print(json.dumps({"wall_s": round(wall, 1), "steps": len(rows), "reward_first5": round(first, 4),
                      "reward_last5": round(last, 4), "doubled_at_step": doubled,
                      "doubled_at_s": doubled_s and round(doubled_s, 1), "rollout_s": round(rollout_s, 4),
                      "train_s": round(train_s, 4), "turns_per_s": turns_per_s and round(turns_per_s, 1)}))


if __name__ == "__main__":
    main(sys.argv[1:])
