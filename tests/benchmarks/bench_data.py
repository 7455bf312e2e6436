"""Time per step of the prompt source (`RowSource.next_batch`) at 17k and 1M rows.

Writes a Parquet data set in the real schema (`prompt`, `label`, plus a
`data_source` column) of each size to a temporary folder, reads it with
`load_rows` (time and resident memory of the rows as Python dicts), then takes
a step's prompts (`--batch`, default 32) at a time:
  - the first step (it computes the epoch's shuffled order),
  - the mean of the next `--steps` steps,
  - the step that crosses into the second epoch;
and the same with the implementation of `--old-ref` (the commit before this
change, which rebuilt and reshuffled the whole index for every row), for
`--old-steps` steps. Times are CPU seconds of this process (`time.process_time`;
the code is single-threaded), so a busy shared machine does not inflate them.
Prints each figure and a JSON summary as the last line.

    python tests/benchmarks/bench_data.py [--sizes 17000 1000000] [--batch 32] [--old-ref acca1e9]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from relax_core.config.data import FileData
from relax_core.data.prompts import RowSource, load_rows

REPO = Path(__file__).resolve().parents[2]
QUESTION = "Let $x$ be a real number such that $x^2 - {a}x + {b} = 0$. Find the sum of all possible values of $x$."


def write_parquet(path: Path, rows: int) -> None:
    table = pa.table({
        "prompt": [QUESTION.format(a=i % 97, b=i % 89) for i in range(rows)],
        "label": [str(i % 97) for i in range(rows)],
        "data_source": ["math"] * rows,
    })
    pq.write_table(table, path)


def old_row_source(ref: str):
    """`RowSource` as it was at commit `ref` (None when git cannot show it)."""
    done = subprocess.run(["git", "show", f"{ref}:relax_core/data/prompts.py"], cwd=REPO,
                          capture_output=True, text=True)
    if done.returncode != 0:
        print(f"old implementation: not available ({done.stderr.strip()})")
        return None
    path = Path(tempfile.mkdtemp()) / "old_prompts.py"
    path.write_text(done.stdout)
    spec = importlib.util.spec_from_file_location("old_prompts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RowSource


def step_times(source, batch: int, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.process_time()
        source.next_batch(batch)
        times.append(time.process_time() - start)
    return times


def measure(rows: list[dict], data: FileData, batch: int, steps: int) -> dict[str, float]:
    source = RowSource(rows, data)
    first = step_times(source, batch, 1)[0]
    steady = step_times(source, batch, steps)
    source.load_state_dict({"cursor": len(rows) - batch // 2})  # the next step crosses into epoch 1
    crossing = step_times(source, batch, 1)[0]
    return {"first_step_s": first, "step_s": sum(steady) / len(steady), "epoch_crossing_step_s": crossing}


def bench_size(size: int, folder: Path, args, old_cls) -> dict[str, float]:
    path = folder / f"rows_{size}.parquet"
    write_parquet(path, size)
    data = FileData(path=str(path), seed=0)
    rss = psutil.Process().memory_info().rss
    start = time.process_time()
    rows = load_rows(data)
    load_s = time.process_time() - start
    mem_mb = (psutil.Process().memory_info().rss - rss) / 2**20
    result = {"rows": size, "load_s": load_s, "rows_mem_mb": mem_mb} | measure(rows, data, args.batch, args.steps)
    print(f"{size:>9,} rows: load {load_s:.2f} s, {mem_mb:,.0f} MB as dicts; step of {args.batch}: "
          f"first {result['first_step_s'] * 1e3:.1f} ms, then {result['step_s'] * 1e6:.0f} us, "
          f"epoch crossing {result['epoch_crossing_step_s'] * 1e3:.1f} ms")
    if old_cls is not None and args.old_steps:
        old = step_times(old_cls(rows, data), args.batch, args.old_steps)
        result["old_step_s"] = sum(old) / len(old)
        print(f"{size:>9,} rows: old implementation {result['old_step_s']:.3f} s per step "
              f"(mean of {args.old_steps} step(s)), {result['old_step_s'] / result['step_s']:,.0f}x the new")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[17_000, 1_000_000])
    parser.add_argument("--batch", type=int, default=32, help="prompts per step")
    parser.add_argument("--steps", type=int, default=200, help="steps timed after the first")
    parser.add_argument("--old-ref", default="acca1e9", help="commit with the implementation to compare against")
    parser.add_argument("--old-steps", type=int, default=1, help="steps timed with the old one (0: skip it)")
    args = parser.parse_args()
    old_cls = old_row_source(args.old_ref) if args.old_steps else None
    with tempfile.TemporaryDirectory() as folder:
        results = [bench_size(size, Path(folder), args, old_cls) for size in args.sizes]
    print(json.dumps({"batch": args.batch, "results": [{k: round(v, 6) for k, v in r.items()} for r in results]}))


if __name__ == "__main__":
    main()
