"""Weight sync against a raw broadcast of the same bytes, at a large and a small bucket size.

Sync: `WeightBroadcaster` (relax_core/weights/sync.py) pushes a model's weights
into a real CPU engine server (a subprocess) over a gloo group, with SGLang's
protocol: `/begin_weight_update`, per bucket `/update_weights_from_distributed`
(names, dtypes, shapes) and the bucket's broadcasts, then `/end_weight_update`.
Over gloo the broadcaster sends each tensor as it is, straight into the engine's
parameters (`sync_s`); `flattened_s` forces what it does over NCCL, one byte
tensor per bucket (`load_format: "flattened_bucket"`), packed here and taken
apart in the engine: two copies at about the speed of the loopback transfer
itself, which on GPUs run at the memory's speed instead. Raw: the same tensors,
in the same order, broadcast to a plain receiver process over a gloo group of
its own (no HTTP, no engine). All on this machine over loopback.

    ratio_of_raw = raw_s / sync_s        (goal >= 0.90)
    flattened_ratio = raw_s / flattened_s

The model is a tiny Qwen3 widened to about `--model-mb` MiB of float32 weights
(256 by default: the HTTP round trips are a fixed few ms per sync, which a
model of a few MiB would weigh far more than a real one of several GiB does).
Bucket sizes: the recipes' default (`train.weight_sync_bucket_mb`, 512 MiB: one
bucket here) and a small one (`--small-mb`, several buckets). Each figure is the
median of `--repeat` syncs after one warm-up. The last line is one JSON object
per bucket size with at least bucket_mb, sync_s, raw_s and ratio_of_raw.
Seconds to a minute; not part of the test suite:

    python3 tests/benchmarks/bench_weight_sync.py [--model-mb 256] [--small-mb 4] [--repeat 7] [--ipc]

`--ipc` also times colocate's hand-over by reference (relax_core/weights/ipc.py,
`/update_weights_from_tensor` through shared memory) of the same tensors into
a fresh engine: `ipc_s`, and `ipc_speedup` = sync_s / ipc_s. `--num-layers 2
--model-mb 0.1` is the quick start's model (hidden 64, 2 layers).

It re-runs itself in a network namespace with only loopback up (as tests/run does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "integration")]
HOST = "127.0.0.1"
RECEIVER = """
import sys, torch
from relax_core.rollout.weight_group import init_weight_update_group
port, shapes = int(sys.argv[1]), eval(sys.argv[2])
group = init_weight_update_group("127.0.0.1", port, 1, 2, "raw", "gloo")
buffers = [torch.empty(s) for s in shapes]
for _ in range(int(sys.argv[3])):
    for b in buffers:
        torch.distributed.broadcast(b, src=0, group=group)
    torch.distributed.all_reduce(torch.zeros(1), group=group)  # all received: the sender's clock stops
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-mb", type=float, default=256)
    parser.add_argument("--small-mb", type=float, default=4)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--ipc", action="store_true", help="also time the hand-over by reference (colocate)")
    args = parser.parse_args()
    if os.environ.get("RELAX_BENCH_NETNS") != "1":
        env = os.environ | {"RELAX_BENCH_NETNS": "1", "HF_HUB_OFFLINE": "1"}
        inner = f"ip link set lo up; exec {sys.executable} {' '.join(map(str, sys.argv))}"
        sys.exit(subprocess.run(["unshare", "--net", "bash", "-c", inner], env=env).returncode)

    import torch
    from transformers import AutoModelForCausalLM

    from relax_core.models.tiny import materialize_tiny_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        hidden = _hidden_for(args.model_mb, args.num_layers)
        model_dir = materialize_tiny_model(Path(tmp) / "model", hidden_size=hidden, num_layers=args.num_layers,
                                           alphabet="abcd")
        named = [(n, p.detach().contiguous()) for n, p in
                 AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()]
        total = sum(t.numel() * t.element_size() for _, t in named)
        print(f"model: {len(named)} tensors, {total / 2**20:.1f} MiB float32 (hidden {hidden})")
        results = []
        for bucket_mb in (512.0, args.small_mb):
            sync = _sync_times(model_dir, named, bucket_mb, args.repeat, Path(tmp), flatten=False)
            flat = _sync_times(model_dir, named, bucket_mb, args.repeat, Path(tmp), flatten=True)
            raw = _raw_times(named, args.repeat)
            sync_s, flat_s, raw_s = statistics.median(sync), statistics.median(flat), statistics.median(raw)
            buckets = -(-total // int(bucket_mb * 2**20)) if bucket_mb * 2**20 < total else 1
            row = {"bucket_mb": bucket_mb, "buckets": int(buckets), "mib": round(total / 2**20, 2),
                   "sync_s": round(sync_s, 5), "raw_s": round(raw_s, 5), "ratio_of_raw": round(raw_s / sync_s, 3),
                   "sync_gb_per_s": round(total / sync_s / 1e9, 3), "flattened_s": round(flat_s, 5),
                   "flattened_ratio": round(raw_s / flat_s, 3)}
            print(f"bucket {bucket_mb:g} MiB ({row['buckets']} buckets): sync {sync_s * 1e3:.1f} ms, raw "
                  f"{raw_s * 1e3:.1f} ms, ratio of raw {row['ratio_of_raw']:.2f} (goal >= 0.90); flattened "
                  f"{flat_s * 1e3:.1f} ms, ratio {row['flattened_ratio']:.2f}")
            if args.ipc:
                ipc_s = statistics.median(_ipc_times(model_dir, named, bucket_mb, args.repeat, Path(tmp)))
                row |= {"ipc_s": round(ipc_s, 5), "ipc_speedup": round(sync_s / ipc_s, 3)}
                print(f"  hand-over by reference: {ipc_s * 1e3:.1f} ms, {row['ipc_speedup']:.2f}x the sync")
            results.append(row)
    print(json.dumps(results))


def _hidden_for(mb: float, layers: int) -> int:
    """Hidden size whose tiny Qwen3 of `layers` layers has about `mb` MiB of float32 weights (~12 h^2 per layer)."""
    return max(64, int((mb * 2**20 / 4 / (layers * 12)) ** 0.5) // 64 * 64)


def _sync_times(model_dir: Path, named: list, bucket_mb: float, repeat: int, tmp: Path,
                flatten: bool) -> list[float]:
    from engine_fixtures import EngineServer

    from relax_core.rollout.client import EngineClient
    from relax_core.weights.sync import WeightBroadcaster

    async def run() -> list[float]:
        async with EngineClient(server.base_url, api_key="bench-key", timeout=600) as client:
            broadcaster = WeightBroadcaster([client], HOST, bucket_bytes=int(bucket_mb * 2**20), flatten=flatten)
            await broadcaster.init()
            try:
                times = []
                for version in range(repeat + 1):
                    start = time.perf_counter()
                    await broadcaster.broadcast(named, version + 1)
                    times.append(time.perf_counter() - start)
                return times[1:]
            finally:
                await broadcaster.close()

    with EngineServer(model_dir, tmp / f"engine-{bucket_mb:g}-{int(flatten)}.log", "bench-key") as server:
        return asyncio.run(run())


def _ipc_times(model_dir: Path, named: list, bucket_mb: float, repeat: int, tmp: Path) -> list[float]:
    from engine_fixtures import EngineServer

    from relax_core.rollout.client import EngineClient
    from relax_core.weights.ipc import TensorHandover

    async def run() -> list[float]:
        async with EngineClient(server.base_url, api_key="bench-key", timeout=600) as client:
            handover = TensorHandover([client], HOST, bucket_bytes=int(bucket_mb * 2**20))
            await handover.init()
            times = []
            for version in range(repeat + 1):
                start = time.perf_counter()
                await handover.broadcast(named, version + 1)
                times.append(time.perf_counter() - start)
            await handover.close()
            return times[1:]

    with EngineServer(model_dir, tmp / f"engine-ipc-{bucket_mb:g}.log", "bench-key") as server:
        return asyncio.run(run())


def _raw_times(named: list, repeat: int) -> list[float]:
    import torch
    import torch.distributed as dist

    from relax_core.cluster.ports import listening_socket
    from relax_core.rollout.weight_group import destroy_weight_update_group, init_weight_update_group

    sock = listening_socket(HOST, 0)
    port = sock.getsockname()[1]
    shapes = [list(t.shape) for _, t in named]
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port), repr(shapes), str(repeat + 1)],
                                env=os.environ | {"PYTHONPATH": str(ROOT)})
    group = init_weight_update_group(HOST, port, 0, 2, "raw", "gloo", listen_sock=sock)
    try:
        times = []
        for _ in range(repeat + 1):
            start = time.perf_counter()
            handles = [dist.broadcast(t, src=0, group=group, async_op=True) for _, t in named]
            for handle in handles:
                handle.wait()
            dist.all_reduce(torch.zeros(1), group=group)
            times.append(time.perf_counter() - start)
        return times[1:]
    finally:
        receiver.wait(timeout=120)
        destroy_weight_update_group(group)


if __name__ == "__main__":
    main()
