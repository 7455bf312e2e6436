"""Where the quick start's wall time goes: start-up phases, per-step time, shutdown, per mode.

Runs `relax submit recipes/quickstart.yaml --executor local` as a user would
(a fresh process in a temp dir, HF_HUB_OFFLINE=1) in each mode, and reads the
phases from what the run records anyway: the timestamped lines of
`<run>/logs/driver.log`, the per-step times of `metrics.jsonl` and the
checkpoint tracker file. Each phase ends at:

    ray_start     "starting a local Ray cluster"  (CLI imports, recipe checks, run directory recorded)
    ray_up        "Ray cluster up"
    model_dir     "model directory ready"
    ready         "engines ready"                 (engines and trainers loaded)
    first_step    step 1's log line minus its step_s (reward hub, rollout manager, weight group, bus)
    steps         the last step's log line
    checkpoint    latest_checkpointed_iteration.txt written (the final checkpoint)
    job_closed    "job closed; stopping Ray"      (engines, trainers, metrics writers stopped)
    ray_stopped   "Ray stopped"
    exit          the process ended (wall time)

The per-step time `step_s` is the mean of metrics.jsonl's `step_s` over the
steady steps (the first WARMUP skipped), and `fixed_s = wall_s - steps * step_s`:
what a run costs besides its steps. With `--repeat N` every number is the
median of N runs (modes interleaved, the machine is noisy). The last line is
one JSON object, per mode: wall_s, fixed_s, step_s, steps, the phases (when
each ended, seconds since the process started) and the load average before a
run (how quiet the machine was). Minutes, not part of the test suite:

    python3 tests/benchmarks/bench_startup.py [--modes colocate,fully_async,hybrid] [--repeat 3] [KEY=VALUE ...]

It re-runs itself in a network namespace with only loopback up (as tests/run
does), so the runs reach no network.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from statistics import fmean, median

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
MODES = ("colocate", "fully_async", "hybrid")
WARMUP = 5
NETNS_ENV = "RELAX_BENCH_NETNS"
# phase -> the driver.log message that ends it (the other phases come from metrics and files)
LOG_MARKS = {
    "ray_start": "starting a local Ray cluster",
    "ray_up": "Ray cluster up",
    "model_dir": "model directory ready",
    "ready": "engines ready",
}
CLOSE_MARKS = {"job_closed": "job closed; stopping Ray", "ray_stopped": "Ray stopped"}
PHASES = (*LOG_MARKS, "first_step", "steps", "checkpoint", *CLOSE_MARKS, "exit")


def enter_loopback_namespace() -> None:
    """Re-exec this script in a new network namespace whose only interface is loopback, up."""
    if os.environ.get(NETNS_ENV) == "1":
        return
    unshare = ["unshare", "--net", *([] if os.getuid() == 0 else ["--map-root-user"])]
    script = 'ip link set lo up && exec "$@"'
    env = os.environ | {NETNS_ENV: "1", "HF_HUB_OFFLINE": "1"}
    os.execvpe("unshare", [*unshare, "bash", "-c", script, "bash", sys.executable, __file__, *sys.argv[1:]], env)


def run_once(mode: str, overrides: list[str], workdir: Path) -> dict:
    """One quick start in `mode`; returns the times (seconds since the process started) its phases ended."""
    run_dir = workdir / "runs" / mode
    cmd = [sys.executable, "-m", "relax_cli.main", "submit", str(QUICKSTART), f"mode={mode}", *overrides,
           "--executor", "local", "--run-dir", str(run_dir)]
    load = os.getloadavg()[0]  # how busy the machine was: the numbers are only as quiet as it
    start = time.time()
    proc = subprocess.run(cmd, cwd=workdir, env=os.environ | {"HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    wall = time.time() - start
    if proc.returncode != 0:
        sys.exit(f"{mode} run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return phase_ends(run_dir, start, wall) | {"load": load}


def phase_ends(run_dir: Path, start: float, wall: float) -> dict:
    lines = [_parse(line) for line in (run_dir / "logs" / "driver.log").read_text().splitlines()]
    stamps = [(t - start, msg) for t, msg in lines if t is not None]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [t for t, msg in stamps if msg.startswith("step ")]
    ends = {name: _first(stamps, mark) for name, mark in LOG_MARKS.items()}
    ends["first_step"] = steps[0] - rows[0]["step_s"]
    ends["steps"] = steps[-1]
    ends["checkpoint"] = (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").stat().st_mtime - start
    ends |= {name: _first(stamps, mark) for name, mark in CLOSE_MARKS.items()}
    ends["exit"] = wall
    steady = rows[WARMUP:] or rows
    return {"ends": ends, "step_s": fmean(r["step_s"] for r in steady), "n_steps": len(rows)}


def _parse(line: str) -> tuple[float | None, str]:
    """(epoch seconds, message) of a driver.log line: `2026-01-01 12:00:00,123 INFO logger: message`."""
    try:
        stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:  # a continuation line (a traceback)
        return None, line
    return stamp, line.split(": ", 1)[-1]


def _first(stamps: list[tuple[float, str]], mark: str) -> float | None:
    return next((t for t, msg in stamps if msg.startswith(mark)), None)


def summary(runs: list[dict]) -> dict:
    """Medians over the runs of one mode: wall, fixed and per-step seconds, and when each phase ended."""
    wall = median(r["ends"]["exit"] for r in runs)
    step_s = median(r["step_s"] for r in runs)
    n_steps = runs[0]["n_steps"]
    recorded = [p for p in PHASES if all(r["ends"].get(p) is not None for r in runs)]
    phases = {p: round(median(r["ends"][p] for r in runs), 3) for p in recorded}
    return {"wall_s": round(wall, 3), "fixed_s": round(wall - n_steps * step_s, 3), "step_s": round(step_s, 4),
            "steps": n_steps, "phases": dict(sorted(phases.items(), key=lambda item: item[1])), "runs": len(runs),
            "load": round(median(r["load"] for r in runs), 2)}


def print_table(mode: str, s: dict) -> None:
    """One line per phase, in the order they ended: when (seconds since the process started) and how
    long after the phase before it."""
    print(f"\n{mode}: wall {s['wall_s']:.2f}s = fixed {s['fixed_s']:.2f}s + {s['steps']} steps x "
          f"{s['step_s']:.4f}s (medians of {s['runs']}; load average {s['load']:.2f} before a run)")
    previous = 0.0
    for phase, at in s["phases"].items():
        note = f"  ({s['steps']} steps)" if phase == "steps" else ""
        print(f"  {phase:12s} at {at:7.3f}s  +{at - previous:6.3f}s{note}")
        previous = at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes to run")
    parser.add_argument("--repeat", type=int, default=1, help="runs per mode; medians are reported")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every run, e.g. train.steps=50")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    enter_loopback_namespace()
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(args.repeat):
        for mode in modes:
            with tempfile.TemporaryDirectory() as tmp:
                runs[mode].append(run_once(mode, args.overrides, Path(tmp)))
    result = {mode: summary(r) for mode, r in runs.items()}
    for mode, s in result.items():
        print_table(mode, s)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
