"""Colocate against fully_async: the same workload, the same processes and cores, one run each.

Runs `relax submit recipes/quickstart.yaml` twice on this machine (local
executor), identical but for `mode`: same model, data, steps and seeds; the
training rank runs on the train group's core and the engine on the rollout
group's core in both modes (the local executor pins each group to its own
cores). The model is enlarged and the answers lengthened from the quick
start's so that a rollout and a training step take similar, measurable times.
Both runs use a KL loss against the reference model (`algorithm.kl.coef`):
colocate computes the reference log-probs inside the trainer, fully_async in
its reference service (beside the trainer, free to run on either group's core:
the OS puts it where nothing runs, mostly the engine's core once a step is
generated), which reads and writes them through TransferQueue.

The rollout may run two versions ahead (`rollout.max_staleness=2`): the rows of
step s+1 need generation and then the reference forward (about 0.55 + 0.35 s
here) after version s-1 is out, which is about one train step, so with a bound
of 1 they are late every other step and the trainer waits (measured: 14 % of
the step idle at 1, 0.1 % at 2). Give extra overrides to change it, e.g.
`bench_modes.py rollout.max_staleness=1`.

Per run the steady-state steps (the first WARMUP skipped) give:

    samples/s   = sum(samples) / sum(step wall time)
    T_rollout, T_train = mean rollout and train seconds per step (colocate run)
    ideal_ratio = (T_rollout + T_train) / max(T_rollout, T_train)

and the last line is one JSON object with both throughputs, their ratio, the
ideal ratio, fully_async's steady-state trainer idle time as a fraction of its
step time, and the engines' idle time during weight syncs (`sync_s`: the
weights arrive while the engines generate, each engine paused only while it
loads them) as a fraction of the step. Goals: ratio >= 0.90 * ideal_ratio;
trainer idle < 2 % and engine idle during syncs < 2 % of the step.

`--long-tail`: responses end where the model samples its end-of-sequence token,
up to 128 tokens, instead of all at 16: the lengths of a step spread like
reasoning models' (a geometric-like tail; the JSON gives the measured median
and longest per step, the longest about 8x the median). Minutes, not part of the test suite:

    HF_HUB_OFFLINE=1 python3 tests/benchmarks/bench_modes.py            # in a loopback namespace:
    unshare --net bash -c 'ip link set lo up; HF_HUB_OFFLINE=1 python3 tests/benchmarks/bench_modes.py'
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import fmean

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
STEPS, WARMUP = 30, 5
WORKLOAD = [
    f"train.steps={STEPS}", "model.hidden_size=128", "model.num_layers=4", "rollout.prompts_per_step=16",
    "rollout.n_samples_per_prompt=8", "rollout.max_new_tokens=16", "data.min_len=4", "data.max_len=12",
    "train.micro_batch_size=32", "rollout.max_staleness=2", "checkpoint.interval=1000",
    "logging.backends=[]", "algorithm.kl.coef=0.01",
]


LONG_TAIL = ["rollout.max_new_tokens=128"]  # the model's own end-of-sequence token ends most responses


def run_mode(mode: str, extra: list[str], workdir: Path) -> list[dict]:
    env = os.environ | {"HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "relax_cli.main", "submit", str(QUICKSTART), f"mode={mode}", *WORKLOAD, *extra,
           "--executor", "local", "--run-dir", f"runs/{mode}"]
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{mode} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    metrics = workdir / "runs" / mode / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def summary(rows: list[dict]) -> dict[str, float]:
    steady = rows[WARMUP:]
    return {
        "samples_per_s": sum(r["samples"] for r in steady) / sum(r["step_s"] for r in steady),
        "rollout_s": fmean(r["rollout_s"] for r in steady),
        "train_s": fmean(r["train_s"] for r in steady),
        "sync_s": fmean(r["sync_s"] for r in steady),
        "step_s": fmean(r["step_s"] for r in steady),
        "reward_last5": fmean(r["reward_mean"] for r in rows[-5:]),
    }


def main(extra: list[str]) -> None:
    long_tail = "--long-tail" in extra
    extra = [e for e in extra if e != "--long-tail"] + (LONG_TAIL if long_tail else [])
    with tempfile.TemporaryDirectory() as tmp:
        colocate = summary(run_mode("colocate", extra, Path(tmp)))
        fully_async_rows = run_mode("fully_async", extra, Path(tmp))
        fully_async = summary(fully_async_rows)
    t_rollout, t_train = colocate["rollout_s"], colocate["train_s"]
    ideal = (t_rollout + t_train) / max(t_rollout, t_train)
    ratio = fully_async["samples_per_s"] / colocate["samples_per_s"]
    staleness = fmean(r["staleness_mean"] for r in fully_async_rows[WARMUP:])
    steady = fully_async_rows[WARMUP:]
    idle = fmean(r["trainer_idle_s"] for r in steady) / fully_async["step_s"]
    engine_idle = sum(r["sync_s"] for r in steady) / sum(r["step_s"] for r in steady)
    medians = [r.get("response_len_median") for r in steady]  # absent before the metric existed
    lengths = {} if None in medians else {
        "response_len_median": round(fmean(medians), 2),
        "response_len_max": round(fmean(r["response_len_max"] for r in steady), 2),
        "max_over_median": round(fmean(r["response_len_max"] / max(r["response_len_median"], 1) for r in steady), 2)}
    for name, s in (("colocate", colocate), ("fully_async", fully_async)):
        print(f"{name:12s} {s['samples_per_s']:7.1f} samples/s | step {s['step_s']:.3f}s | rollout "
              f"{s['rollout_s']:.3f}s | train {s['train_s']:.3f}s | sync {s['sync_s']:.3f}s | "
              f"reward(last 5) {s['reward_last5']:.3f}")
    print(f"ratio {ratio:.3f} | ideal {ideal:.3f} | ratio/ideal {ratio / ideal:.1%} (goal >= 90%) | "
          f"fully_async mean staleness {staleness:.2f} | trainer idle {idle:.1%} of the step (goal < 2%) | "
          f"engines idle during syncs {engine_idle:.1%} (goal < 2%)")
    print(json.dumps({
        "colocate_samples_per_s": round(colocate["samples_per_s"], 3),
        "fully_async_samples_per_s": round(fully_async["samples_per_s"], 3),
        "ratio": round(ratio, 4), "ideal_ratio": round(ideal, 4), "ratio_of_ideal": round(ratio / ideal, 4),
        "t_rollout_s": round(t_rollout, 4), "t_train_s": round(t_train, 4), "steps": STEPS, "warmup": WARMUP,
        "trainer_idle_frac": round(idle, 4), "engine_sync_idle_frac": round(engine_idle, 4),
        "long_tail": long_tail, **lengths,
    }))


if __name__ == "__main__":
    main(sys.argv[1:])
