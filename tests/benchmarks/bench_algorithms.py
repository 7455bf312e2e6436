"""Which algorithms reach the quick-start goal: reward lift >= 0.6 over 150 steps.

Runs the quick-start loop in one process (the sampler of
tests/integration/test_learning.py stands in for the engine; the trainer is
configured from recipes/quickstart.yaml with `algorithm.name` switched, via
`train/settings.py: trainer_config`) and prints, per algorithm, the mean reward of the
first and last 5 steps (the task reward of each step's first generation round,
before DAPO's overlong shaping and filtering), the lift and the wall time. Not part of the test
suite (minutes per algorithm):

    HF_HUB_OFFLINE=1 python3 tests/benchmarks/bench_algorithms.py grpo rloo dapo
    # recipe overrides after a colon, comma-separated:
    HF_HUB_OFFLINE=1 python3 tests/benchmarks/bench_algorithms.py dapo:algorithm.overlong.enabled=false
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "integration")]

import torch  # noqa: E402
from test_algorithms_e2e import run_steps  # noqa: E402
from test_learning import ALPHABET  # noqa: E402

from relax_core.models.tiny import materialize_tiny_model  # noqa: E402

STEPS, GOAL = 150, 0.6


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = materialize_tiny_model(Path(tmp) / "model", seed=1, alphabet=ALPHABET)
        for spec in names:
            name, _, extra = spec.partition(":")
            start = time.monotonic()
            _, history = run_steps(model_dir, name, STEPS, tuple(filter(None, extra.split(","))))
            rewards = [m["task_reward_mean"] for m in history]  # before DAPO's shaping/filtering
            first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
            verdict = "reaches" if last - first >= GOAL else "misses"
            print(f"{spec:24s} first5={first:.3f} last5={last:.3f} lift={last - first:+.3f} "
                  f"({verdict} goal {GOAL}) {time.monotonic() - start:.0f}s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["grpo", "rloo"])
