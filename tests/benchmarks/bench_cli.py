"""How fast `relax --help` answers on a login node (goal: median under 0.5 s).

Runs the installed `relax` console script (not a pyenv/conda shim in front of
it) N times and prints each wall time, the median, and a JSON summary line.

    python tests/benchmarks/bench_cli.py [--runs 20]
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path


def relax_executable() -> list[str]:
    script = Path(sysconfig.get_path("scripts")) / "relax"
    if script.exists():
        return [str(script)]
    found = shutil.which("relax")
    return [found] if found else [sys.executable, "-m", "relax_cli.main"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    command = relax_executable() + ["--help"]
    subprocess.run(command, capture_output=True, check=True)  # warm the file cache
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        subprocess.run(command, capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    print("relax --help wall times (s):", " ".join(f"{t:.3f}" for t in times))
    summary = {"command": " ".join(command), "runs": args.runs, "median_s": round(statistics.median(times), 4),
               "min_s": round(min(times), 4), "max_s": round(max(times), 4), "goal_s": 0.5}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
