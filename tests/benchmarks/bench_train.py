"""One training step of each backend at long responses: peak memory and tokens per second.

For each response length (`--tokens`, 2k, 8k and 16k by default) a fresh process builds a narrow Qwen3
with a real vocabulary (151,936 tokens, Qwen3's; hidden 64 and 2 layers by default, so the output layer
and the loss head weigh as in a real model while the layers stay cheap on a CPU), loads it with
`TorchTrainer` (`--backend megatron`: `MegatronTrainer`, one rank, megatron-core's layers) and times one
`train_step` on one micro-batch of `--samples` samples whose responses add up to that length (random
tokens, advantages +-1), after one warm-up step at 64 tokens that makes the optimizer state. Measured
apart (torch backend), with the same hidden states, the loss head alone: the response tokens' log-probs
(and entropy) of the model's output layer, forward and backward.

Memory on the CPU is the process's peak resident set above what it held before the step (Linux's VmHWM,
reset through /proc/self/clear_refs): glibc gives blocks this large back to the system when torch frees
them, so the peak follows the allocator's. On CUDA (`--device cuda`) it is
`torch.cuda.max_memory_allocated` above the memory allocated before the step. `head` says which loss
head the model ran: "chunked" (`train/loss_head.py`) or "plain" (full logits, then a float32
log-softmax: the only one before it). Run against an older checkout to get its figures:

    PYTHONPATH=/path/to/old/checkout python3 tests/benchmarks/bench_train.py

`--compare` also runs the shortest length's samples packed through the chunked head and padded through the model's own
logits (the computation before it), and reports the largest differences of their response log-probs and
of every parameter's gradient. `--head-only` measures the loss head alone, for a checkout whose full
step at the longest length would not fit in memory.

The last line is one JSON object: per length, step_s, tokens_per_s, step_peak_mib, head_peak_mib, head_s
(and the differences with `--compare`), and the growth of the step's peak from the shortest length to
the longest. Minutes; not part of the tests.

    python3 tests/benchmarks/bench_train.py [--backend torch|megatron] [--tokens 2048,8192,16384] [--samples 4]
        [--packed] [--compare] [--head-only] [--vocab 151936] [--hidden 64] [--layers 2]
        [--device cpu] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 1024**2


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="2048,8192,16384", help="response tokens of the micro-batch, comma-separated")
    p.add_argument("--backend", choices=("torch", "megatron"), default="torch")
    p.add_argument("--samples", type=int, default=4, help="samples the response tokens are split over")
    p.add_argument("--packed", action="store_true", help="pack the micro-batch into one row (train.max_tokens_per_gpu)")
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens of each sample")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="the trainer's compute dtype")
    p.add_argument("--head-only", action="store_true",
                   help="measure the loss head alone (no train step): an old checkout's full step at 16k would not fit")
    p.add_argument("--compare", action="store_true",
                   help="at the shortest length, also: the packed, chunked step's log-probs and gradients against the "
                        "padded, unchunked one's (whose [tokens x vocabulary] logits would not fit at the longest)")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: this length only
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.backend == "megatron" and (args.head_only or args.compare):
        p.error("--head-only and --compare measure the torch backend's loss head; drop them with --backend megatron")
    return args


# ------------------------------------------------------------------ memory
class Peak:
    """Peak memory above the level at `reset()`."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def reset(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self.base = _status_kib("VmRSS") * 1024

    def mib(self) -> float:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - self.base) / MIB
        return (_status_kib("VmHWM") * 1024 - self.base) / MIB


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


# ------------------------------------------------------------------ one length, in a child process
def make_model(folder: Path, args) -> Path:
    import torch
    from transformers import Qwen3ForCausalLM

    from relax_core.models.tiny import tiny_qwen3_config

    torch.manual_seed(0)
    longest = args.prompt + max(int(t) for t in args.tokens.split(",")) + 16
    config = tiny_qwen3_config(args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                               num_kv_heads=args.heads, max_position_embeddings=longest, pad_token_id=0)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


def samples_of(total: int, args, seed: int):
    import random

    from relax_core.data.sample import Sample

    rng = random.Random(seed)
    each = [total // args.samples + (i < total % args.samples) for i in range(args.samples)]
    return [Sample(prompt_ids=[rng.randrange(1, args.vocab) for _ in range(args.prompt)],
                   response_ids=[rng.randrange(1, args.vocab) for _ in range(n)],
                   rollout_logprobs=[-12.0] * n, loss_mask=[1] * n, group_id=i // 2, reward=float(i % 2))
            for i, n in enumerate(each) if n]


def one_length(args) -> dict:
    import torch

    from relax_core.train.config import TorchTrainerConfig
    from relax_core.train.torch_backend import TorchTrainer

    tokens = args.one
    config = TorchTrainerConfig(
        lr=1e-6, micro_batch_size=args.samples, device=args.device, dtype=args.dtype, grad_clip=1.0,
        max_tokens_per_micro_batch=(tokens + args.samples * args.prompt) if args.packed else None)
    if args.backend == "megatron":
        from relax_core.train.megatron.model import Parallel
        from relax_core.train.megatron.trainer import MegatronTrainer

        trainer = MegatronTrainer(args.model_dir, config, Parallel())
    else:
        trainer = TorchTrainer(args.model_dir, config)
    advantages = lambda batch: [1.0 if i % 2 else -1.0 for i in range(len(batch))]  # noqa: E731
    warm = samples_of(64, args, seed=1)
    trainer.train_step(warm, advantages(warm))
    batch = samples_of(tokens, args, seed=2)
    peak = Peak(args.device)
    if args.head_only:
        head, head_s, head_peak = _head_alone(trainer, batch, peak)
        return {"tokens": tokens, "head": head, "head_s": round(head_s, 3), "head_peak_mib": round(head_peak, 1)}

    peak.reset()
    start = time.perf_counter()
    trainer.train_step(batch, advantages(batch))
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    step_s = time.perf_counter() - start
    step_peak = peak.mib()

    row = {"tokens": tokens, "step_s": round(step_s, 3), "tokens_per_s": round(tokens / step_s, 1),
           "step_peak_mib": round(step_peak, 1)}
    if args.backend == "megatron":
        return row
    head, head_s, head_peak = _head_alone(trainer, batch, peak)
    row.update({"head": head, "head_s": round(head_s, 3), "head_peak_mib": round(head_peak, 1)})
    if args.compare and tokens == min(int(t) for t in args.tokens.split(",")):
        row.update(_compare(trainer.model, batch, args.device))
    return row


def _compare(model, batch, device: str) -> dict:
    """The largest differences between the packed micro-batch through `forward_logprobs` (the chunked head)
    and the same samples padded, through the model's own logits and `response_logprobs` (the computation
    before the chunked head): the response log-probs, and the gradients of every parameter of the loss
    `sum(advantage x logp) / tokens`."""
    import torch

    from relax_core.train.batching import forward_logprobs, pack, response_logprobs

    def run(packed: bool):
        model.zero_grad(set_to_none=True)
        mb = pack(batch, 0, device, packed=packed)
        if packed:
            logp, _ = forward_logprobs(model, mb)
        else:
            inputs = {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask, "position_ids": mb.position_ids}
            logp, _ = response_logprobs(model(**inputs, use_cache=False).logits, mb)
        sign = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(batch))], device=logp.device).unsqueeze(-1)
        (logp * sign * mb.valid).sum().div(mb.valid.sum()).backward()
        values = torch.cat([logp[i, :s.response_len].detach() for i, s in enumerate(batch)])
        return values, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    (plain, plain_grads), (chunked, chunked_grads) = run(packed=False), run(packed=True)
    model.zero_grad(set_to_none=True)
    assert plain_grads.keys() == chunked_grads.keys()
    return {"logp_max_diff": float((plain - chunked).abs().max()),
            "grad_max_diff": max(float((plain_grads[n] - chunked_grads[n]).abs().max()) for n in plain_grads),
            "grad_max_abs": max(float(g.abs().max()) for g in plain_grads.values())}


def _head_alone(trainer, batch, peak: Peak) -> tuple[str, float, float]:
    """The loss head by itself, as this checkout's `forward_logprobs` runs it: the model's body run once (not
    measured), then the head's forward and backward on those hidden states."""
    import torch

    from relax_core.train.batching import response_logprobs

    model = trainer.model
    mb = trainer._pack(batch)
    inputs = {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask, "position_ids": mb.position_ids}
    with torch.no_grad():
        hidden = model.model(**inputs).last_hidden_state
    hidden.requires_grad_(True)
    try:
        from relax_core.train.loss_head import ResponseRows, chunked_logprobs
    except ImportError:  # a checkout from before the chunked head
        chunked_logprobs = None
    peak.reset()
    start = time.perf_counter()
    if chunked_logprobs is not None:
        rows = ResponseRows(mb.logit_index, mb.valid, mb.packed)
        logp, _ = chunked_logprobs(rows(hidden), model.lm_head, mb.response_ids[mb.valid], with_entropy=True)
        logp.sum().backward()
    else:
        logp, _ = response_logprobs(model.lm_head(hidden), mb, with_entropy=True)
        (logp * mb.valid).sum().backward()
    seconds = time.perf_counter() - start
    return ("plain" if chunked_logprobs is None else "chunked"), seconds, peak.mib()


# ------------------------------------------------------------------ the parent
def main(argv=None) -> None:
    args = parse(argv)
    if args.one is not None:
        print(json.dumps(one_length(args)))
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "model", args)
        for tokens in (int(t) for t in args.tokens.split(",")):
            child = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--one", str(tokens),
                     "--model-dir", str(model_dir)]
            out = subprocess.run(child, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            if out.returncode:
                sys.exit(f"{tokens} tokens failed:\n{out.stderr[-3000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            results.append(row)
            if args.head_only:
                print(f"{tokens:>6} tokens  head ({row['head']}) {row['head_peak_mib']:8.1f} MiB {row['head_s']:.3f} s",
                      flush=True)
                continue
            head = (f"  head ({row['head']}) {row['head_peak_mib']:8.1f} MiB {row['head_s']:.3f} s"
                    if "head" in row else "")
            print(f"{tokens:>6} tokens  step {row['step_s']:7.3f} s  {row['tokens_per_s']:8.1f} tok/s  "
                  f"step peak {row['step_peak_mib']:8.1f} MiB{head}", flush=True)
    steps = [r["step_peak_mib"] for r in results if "step_peak_mib" in r]
    growth = steps[-1] / max(steps[0], 1e-9) if steps else None
    print(json.dumps({"backend": args.backend, "device": args.device, "vocab": args.vocab, "hidden": args.hidden,
                      "layers": args.layers, "samples": args.samples, "packed": args.packed, "dtype": args.dtype,
                      "lengths": results, "step_peak_growth": growth and round(growth, 2)}))


if __name__ == "__main__":
    main()
