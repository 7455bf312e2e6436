"""CPU engine throughput and weight-sync speed, each next to a plain-torch baseline.

1. Generation: N concurrent `/generate` requests x T new tokens against the
   CPU engine (a real server subprocess), vs `model.generate` on the same
   model, prompts and batch in this process.
2. Weight sync: `WeightBroadcaster.broadcast` of the model's state dict into
   the engine (bucketed, HTTP-announced, loaded into the model), vs a raw
   `torch.distributed.broadcast` of the same tensors over gloo to a bare
   receiver process.

Run it in a loopback-only namespace (about a minute on two cores):

    unshare --net bash -c 'ip link set lo up; python3 tests/benchmarks/bench_engine.py'

The last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from engine_fixtures import HOST, EngineServer, free_port, subprocess_env  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--bucket-mib", type=float, default=4.0)
    p.add_argument("--sync-repeats", type=int, default=3)
    p.add_argument("--raw-receiver", nargs=2, type=int, metavar=("PORT", "REPEATS"), help=argparse.SUPPRESS)
    p.add_argument("--shapes", help=argparse.SUPPRESS)
    return p.parse_args()


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(length // 2, length + 1, (n,), generator=gen)
    return [torch.randint(3, vocab, (int(k),), generator=gen).tolist() for k in lengths]


async def engine_generation(url: str, batch: list[list[int]], new_tokens: int) -> dict:
    from relax_core.rollout.client import EngineClient

    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    async with EngineClient(url) as client:
        await client.generate(batch[0], sampling_params={**params, "max_new_tokens": 4})  # warm-up
        before = (await client.get_model_info())["engine_stats"]["forward_passes"]
        start = time.perf_counter()
        results = await asyncio.gather(*(client.generate(p, sampling_params=params) for p in batch))
        seconds = time.perf_counter() - start
        after = (await client.get_model_info())["engine_stats"]["forward_passes"]
    tokens = sum(len(r["output_ids"]) for r in results)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "forward_passes": after - before}


def hf_generation(model, tokenizer, batch: list[list[int]], new_tokens: int) -> dict:
    import torch

    width = max(len(p) for p in batch)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in batch]).unsqueeze(-1)).long()
    kwargs = dict(attention_mask=mask, do_sample=True, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  pad_token_id=pad, top_k=0, top_p=1.0, temperature=1.0)  # fmt: skip
    with torch.no_grad():
        model.generate(ids[:1], **{**kwargs, "attention_mask": mask[:1], "max_new_tokens": 4, "min_new_tokens": 4})
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        seconds = time.perf_counter() - start
    tokens = (out.shape[1] - width) * len(batch)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


async def engine_sync(url: str, model, bucket_bytes: int, repeats: int) -> dict:
    from relax_core.rollout.client import EngineClient
    from relax_core.weights.sync import WeightBroadcaster

    async with EngineClient(url) as client:
        broadcaster = WeightBroadcaster([client], HOST, free_port(), backend="gloo", bucket_bytes=bucket_bytes)
        await broadcaster.init()
        runs = [await broadcaster.broadcast(model.state_dict().items(), version=v) for v in range(1, repeats + 1)]
        await broadcaster.close()
    return {
        "bytes": runs[0].total_bytes,
        "buckets": runs[0].num_buckets,
        "seconds_median": statistics.median(r.seconds for r in runs),
        "version_reported": str(repeats),
    }


def raw_sync(model, repeats: int) -> dict:
    """Rank 0 here, rank 1 a bare receiver process; same tensors, no HTTP, no buckets."""
    import torch.distributed as dist

    from relax_core.weights.process_group import destroy_weight_update_group, init_weight_update_group

    tensors = [t.detach().contiguous() for t in model.state_dict().values()]
    shapes = json.dumps([[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in tensors])
    port = free_port()
    receiver = subprocess.Popen(
        [sys.executable, __file__, "--raw-receiver", str(port), str(repeats), "--shapes", shapes], env=subprocess_env()
    )
    group = init_weight_update_group(HOST, port, 0, 2, "raw_bench", "gloo")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for handle in [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]:
            handle.wait()
        times.append(time.perf_counter() - start)
    destroy_weight_update_group(group)
    receiver.wait(timeout=60)
    return {"bytes": sum(t.numel() * t.element_size() for t in tensors), "seconds_median": statistics.median(times)}


def raw_receiver(port: int, repeats: int, shapes_json: str) -> None:
    import torch
    import torch.distributed as dist

    from relax_core.weights.process_group import destroy_weight_update_group, init_weight_update_group

    buffers = [torch.empty(shape, dtype=getattr(torch, dtype)) for shape, dtype in json.loads(shapes_json)]
    group = init_weight_update_group(HOST, port, 1, 2, "raw_bench", "gloo")
    for _ in range(repeats):
        for handle in [dist.broadcast(b, src=0, group=group, async_op=True) for b in buffers]:
            handle.wait()
    destroy_weight_update_group(group)


def main() -> None:
    args = parse_args()
    if args.raw_receiver:
        return raw_receiver(args.raw_receiver[0], args.raw_receiver[1], args.shapes)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax_core.models.tiny import materialize_tiny_model

    workdir = Path(tempfile.mkdtemp(prefix="bench_engine_"))
    model_dir = materialize_tiny_model(workdir / "model", hidden_size=args.hidden, num_layers=args.layers)
    engine = EngineServer(model_dir, workdir / "engine.log").start()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = prompts(args.requests, args.prompt_len, model.config.vocab_size)
    try:
        engine.wait_healthy()
        gen_engine = asyncio.run(engine_generation(engine.base_url, batch, args.new_tokens))
        gen_hf = hf_generation(model, tokenizer, batch, args.new_tokens)
        bucket = int(args.bucket_mib * (1 << 20))
        sync_engine = asyncio.run(engine_sync(engine.base_url, model, bucket, args.sync_repeats))
    finally:
        engine.stop()
    sync_raw = raw_sync(model, args.sync_repeats)
    report(args, gen_engine, gen_hf, sync_engine, sync_raw)


def report(args, gen_engine: dict, gen_hf: dict, sync_engine: dict, sync_raw: dict) -> None:
    print(f"generation, {args.requests} requests x {args.new_tokens} tokens, {args.hidden}x{args.layers} model")
    forwards = gen_engine["forward_passes"]
    print(f"  cpu engine       : {gen_engine['tokens_per_s']:8.1f} tok/s ({forwards} forward passes)")
    print(f"  model.generate   : {gen_hf['tokens_per_s']:8.1f} tok/s")
    mib = sync_engine["bytes"] / (1 << 20)
    print(f"weight sync of {mib:.1f} MiB (median of {args.sync_repeats})")
    print(f"  WeightBroadcaster: {sync_engine['seconds_median'] * 1e3:8.1f} ms in {sync_engine['buckets']} buckets")
    print(f"  raw broadcast    : {sync_raw['seconds_median'] * 1e3:8.1f} ms")
    summary = {
        "requests": args.requests,
        "new_tokens": args.new_tokens,
        "hidden": args.hidden,
        "layers": args.layers,
        "engine_tokens_per_s": round(gen_engine["tokens_per_s"], 1),
        "hf_generate_tokens_per_s": round(gen_hf["tokens_per_s"], 1),
        "engine_vs_hf": round(gen_engine["tokens_per_s"] / gen_hf["tokens_per_s"], 3),
        "engine_forward_passes": gen_engine["forward_passes"],
        "sync_bytes": sync_engine["bytes"],
        "sync_buckets": sync_engine["buckets"],
        "sync_seconds": round(sync_engine["seconds_median"], 4),
        "raw_broadcast_seconds": round(sync_raw["seconds_median"], 4),
        "sync_vs_raw": round(sync_engine["seconds_median"] / sync_raw["seconds_median"], 3),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
