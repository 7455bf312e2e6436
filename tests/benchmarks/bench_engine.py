"""CPU engine throughput and weight-sync speed, each next to a plain-torch baseline.

1. Generation: N prompts sent to the CPU engine (a real server subprocess,
   answering with log-probs as RL rollouts ask) through `EngineClient`, in
   both forms Relax sends them: N concurrent `/generate` requests (one per
   sample, as behind a router) and one batched `/generate` of N items (the
   rollout manager's request to an engine without a router); vs one static
   `model.generate` batch of the same model, prompts and sampling
   (temperature 1, no truncation) in this process, with the same number of
   torch threads. Two cases:
   - equal lengths: every request T new tokens (`ignore_eos` for the engine,
     `min_new_tokens` for `model.generate`);
   - mixed lengths: request i asks for L_i new tokens, L_i drawn from
     [--mixed-min, --mixed-max]; the static batch must run until its longest,
     while the engine drops each row when it is done. Both are credited with
     the sum of L_i, the tokens the caller asked for.
   Each case runs one warm-up round, then --repeats rounds that each run the
   engine and the static batch in turn (so both see the same background
   load); the figures are medians.
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

WARMUP_TOKENS = 8
FORMS = ("single", "batched")  # how the engine's requests are sent, see `engine_round`


def parse_args() -> argparse.Namespace:
    import torch

    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens per request, equal-lengths case")
    p.add_argument("--mixed-min", type=int, default=8, help="fewest new tokens of a request, mixed case")
    p.add_argument("--mixed-max", type=int, default=128, help="most new tokens of a request, mixed case")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per case and side")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads, both sides")
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


def mixed_lengths(n: int, low: int, high: int) -> list[int]:
    import torch

    return torch.randint(low, high + 1, (n,), generator=torch.Generator().manual_seed(1)).tolist()


async def engine_round(client, batch: list[list[int]], lengths: list[int], form: str) -> dict:
    """`form` "single": one concurrent `/generate` per prompt (as behind a router); "batched":
    one `/generate` with every prompt, each with its own parameters (the rollout manager's
    request without a router)."""
    params = [{"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True} for n in lengths]
    before = (await client.get_model_info())["engine_stats"]["forward_passes"]
    start = time.perf_counter()
    if form == "single":
        results = await asyncio.gather(*(client.generate(p, sampling_params=sp) for p, sp in zip(batch, params)))
    else:
        results = await client.generate(batch, sampling_params=params)
    seconds = time.perf_counter() - start
    after = (await client.get_model_info())["engine_stats"]["forward_passes"]
    tokens = sum(len(r["output_ids"]) for r in results)
    assert tokens == sum(lengths), (tokens, sum(lengths))
    return {"tokens_per_s": tokens / seconds, "forward_passes": after - before}


def hf_round(model, tokenizer, batch: list[list[int]], lengths: list[int]) -> dict:
    """One static batch, run until its longest request; credited with the tokens asked for."""
    import torch

    width = max(len(p) for p in batch)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in batch]).unsqueeze(-1)).long()
    longest = max(lengths)
    kwargs = dict(attention_mask=mask, do_sample=True, max_new_tokens=longest, min_new_tokens=longest,
                  pad_token_id=pad, top_k=0, top_p=1.0, temperature=1.0)  # fmt: skip
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        seconds = time.perf_counter() - start
    assert out.shape[1] - width == longest
    return {"tokens_per_s": sum(lengths) / seconds}


async def generation(url: str, model, tokenizer, batch: list[list[int]], cases: dict, repeats: int) -> dict:
    """Per case: a warm-up round, then `repeats` rounds; a round runs the engine (both
    request forms), then the static batch. Medians per side."""
    from relax_core.rollout.client import EngineClient

    async with EngineClient(url) as client:

        async def one_round(lengths: list[int]) -> dict:
            runs = {form: await engine_round(client, batch, lengths, form) for form in FORMS}
            return {**runs, "hf": hf_round(model, tokenizer, batch, lengths)}

        figures = {}
        for name, lengths in cases.items():
            await one_round([WARMUP_TOKENS] * len(batch))
            rounds = [await one_round(lengths) for _ in range(repeats)]
            figures[name] = {side: _medians([r[side] for r in rounds]) for side in rounds[0]}
    return figures


def _medians(runs: list[dict]) -> dict:
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "forward_passes": statistics.median(r.get("forward_passes", 0) for r in runs),
        "runs": [round(r["tokens_per_s"]) for r in runs],
    }


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

    from relax_core.rollout.weight_group import destroy_weight_update_group, init_weight_update_group

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

    from relax_core.rollout.weight_group import destroy_weight_update_group, init_weight_update_group

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

    torch.set_num_threads(args.threads)
    workdir = Path(tempfile.mkdtemp(prefix="bench_engine_"))
    model_dir = materialize_tiny_model(workdir / "model", hidden_size=args.hidden, num_layers=args.layers)
    engine = EngineServer(model_dir, workdir / "engine.log", None, "--num-threads", str(args.threads)).start()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = prompts(args.requests, args.prompt_len, model.config.vocab_size)
    cases = {
        "equal": [args.new_tokens] * args.requests,
        "mixed": mixed_lengths(args.requests, args.mixed_min, args.mixed_max),
    }
    try:
        engine.wait_healthy()
        gen = asyncio.run(generation(engine.base_url, model, tokenizer, batch, cases, args.repeats))
        bucket = int(args.bucket_mib * (1 << 20))
        sync_engine = asyncio.run(engine_sync(engine.base_url, model, bucket, args.sync_repeats))
    finally:
        engine.stop()
    sync_raw = raw_sync(model, args.sync_repeats)
    report(args, cases, gen, sync_engine, sync_raw)


def report(args, cases: dict, gen: dict, sync_engine: dict, sync_raw: dict) -> None:
    print(f"generation, {args.requests} requests, {args.hidden}x{args.layers} model, {args.threads} threads, "
          f"median of {args.repeats} rounds, each side in turn")  # fmt: skip
    mixed = cases["mixed"]
    titles = {
        "equal": f"equal lengths, {args.new_tokens} new tokens each",
        "mixed": f"mixed lengths, {min(mixed)}..{max(mixed)} new tokens (the static batch runs to {max(mixed)})",
    }
    labels = {"single": "engine, 1 request each", "batched": "engine, 1 batched req", "hf": "model.generate"}
    for name, fig in gen.items():
        hf = fig["hf"]["tokens_per_s"]
        print(f"  {titles[name]}")
        for form, label in labels.items():
            f = fig[form]
            extra = f" = {f['tokens_per_s'] / hf:.3f}x static ({f['forward_passes']:.0f} forward passes)"
            print(f"    {label:22s}: {f['tokens_per_s']:8.1f} tok/s{'' if form == 'hf' else extra}  runs {f['runs']}")
    mib = sync_engine["bytes"] / (1 << 20)
    print(f"weight sync of {mib:.1f} MiB (median of {args.sync_repeats})")
    print(f"  WeightBroadcaster: {sync_engine['seconds_median'] * 1e3:8.1f} ms in {sync_engine['buckets']} buckets")
    print(f"  raw broadcast    : {sync_raw['seconds_median'] * 1e3:8.1f} ms")
    summary = {
        "requests": args.requests,
        "new_tokens": args.new_tokens,
        "mixed_new_tokens": [args.mixed_min, args.mixed_max],
        "hidden": args.hidden,
        "layers": args.layers,
        "threads": args.threads,
        "repeats": args.repeats,
    }
    for name, prefix in (("equal", ""), ("mixed", "mixed_")):
        fig = gen[name]
        hf = fig["hf"]["tokens_per_s"]
        for form, key in (("single", "engine"), ("batched", "engine_batched")):
            summary[f"{prefix}{key}_tokens_per_s"] = round(fig[form]["tokens_per_s"], 1)
            summary[f"{prefix}{key}_vs_hf"] = round(fig[form]["tokens_per_s"] / hf, 3)
            summary[f"{prefix}{key}_forward_passes"] = fig[form]["forward_passes"]
        summary[f"{prefix}hf_generate_tokens_per_s"] = round(hf, 1)
    summary.update(
        sync_bytes=sync_engine["bytes"],
        sync_buckets=sync_engine["buckets"],
        sync_seconds=round(sync_engine["seconds_median"], 4),
        raw_broadcast_seconds=round(sync_raw["seconds_median"], 4),
        sync_vs_raw=round(sync_engine["seconds_median"] / sync_raw["seconds_median"], 3),
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
