"""Throughput of the `math` reward: worker pool vs in-process, and what hanging samples cost.

Scores the same N model-like responses (boxed fractions, equations, answer
lines, wrong and truncated answers) three ways in one run:
  1. in-process (one process, no time limit),
  2. the worker pool (one worker per CPU, time limit per call),
  3. the worker pool with a few extra samples whose check hangs (a plugin that
     sleeps), to show they cost about one time limit, not one per sample.
Prints each throughput and a JSON summary as the last line.

    python tests/benchmarks/bench_rewards.py [--samples 2000] [--hanging 4] [--timeout 2]
"""

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from relax_core.rewards.hub import RewardHub, RewardItem

HANG_PLUGIN = '''
import time
from relax_core.rewards.registry import reward

@reward("bench_hang")
def bench_hang(response, label, metadata):
    """Never returns in time (stands in for sympy stuck on an adversarial expression)."""
    time.sleep(3600)
'''


def make_samples(n: int, seed: int = 0) -> list[RewardItem]:
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        a, b = rng.randint(1, 50), rng.randint(2, 60)
        label = f"\\frac{{{a}}}{{{b}}}"
        right = rng.random() < 0.5
        value = f"\\frac{{{a * 2}}}{{{b * 2}}}" if right else f"\\frac{{{a + 1}}}{{{b}}}"
        shape = rng.choice([
            f"Let us compute. First, ... so $x = {value}$. Therefore the answer is $\\boxed{{{value}}}$.",
            f"<think>We need the ratio {a}:{b}.</think>The final answer is \\boxed{{x = {value}}}",
            f"Working through the steps gives {a}/{b} after cancelling.\nFinal Answer: ${value}$",
            f"The probability is \\boxed{{{a / b:.6f}}}",
            f"The answer is \\boxed{{{value}",  # truncated
        ])
        items.append(RewardItem(shape, label, {}))
    return items


def with_hanging(items: list[RewardItem], count: int) -> list[RewardItem]:
    """`items` with `count` hanging samples spread evenly through them (as in a real data set)."""
    out = list(items)
    for k in range(count):
        out.insert((k + 1) * len(out) // (count + 1), RewardItem("x", None, {}, reward="bench_hang"))
    return out


def timed(hub: RewardHub, items: list[RewardItem]):
    start = time.perf_counter()
    results = hub.score_sync(items)
    return results, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--hanging", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    items = make_samples(args.samples)

    with RewardHub("math", in_process=True) as hub:
        local, local_s = timed(hub, items)
    print(f"in-process : {len(items)} samples in {local_s:.2f} s = {len(items) / local_s:.0f} samples/s")

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "bench_hang.py").write_text(HANG_PLUGIN)
        with RewardHub("math", plugin_dirs=[folder], timeout_s=args.timeout, num_workers=args.workers or None) as hub:
            start = time.perf_counter()
            hub.warm_up()
            warm_s = time.perf_counter() - start
            pooled, pool_s = timed(hub, items)
            print(f"pool       : {len(items)} samples in {pool_s:.2f} s = {len(items) / pool_s:.0f} samples/s "
                  f"({hub.num_workers} workers, started in {warm_s:.2f} s)")
            mixed, mixed_s = timed(hub, with_hanging(items, args.hanging))
            stats = dict(hub.last_stats)
    print(f"pool + {args.hanging} hanging (limit {args.timeout:g} s): {mixed_s:.2f} s, "
          f"{stats['reward_timeouts']} timeouts; extra {mixed_s - pool_s:.2f} s "
          f"(the limits alone take {args.hanging * args.timeout / hub.num_workers:.2f} s of the workers' time)")
    assert [r.score for r in local] == [r.score for r in pooled], "pool and in-process disagree"
    kept = [r.score for r in mixed if r.reward != "bench_hang"]
    assert kept == [r.score for r in local], "hanging samples changed other samples' scores"
    budget = args.hanging * args.timeout / hub.num_workers  # worker time the limits take, spread over workers
    print(json.dumps({
        "samples": len(items), "accuracy": sum(r.score for r in local) / len(items),
        "in_process_s": round(local_s, 3), "in_process_per_s": round(len(items) / local_s, 1),
        "pool_workers": hub.num_workers, "pool_start_s": round(warm_s, 3), "pool_s": round(pool_s, 3),
        "pool_per_s": round(len(items) / pool_s, 1), "hanging": args.hanging, "timeout_s": args.timeout,
        "pool_with_hanging_s": round(mixed_s, 3), "timeouts": stats["reward_timeouts"],
        "hanging_extra_s": round(mixed_s - pool_s, 3), "hanging_budget_s": round(budget, 3),
    }))


if __name__ == "__main__":
    main()
