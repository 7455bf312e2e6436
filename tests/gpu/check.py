"""What of the GPU path runs on a machine with one CUDA GPU, and its figures (at most 8 minutes).

The GPU test machine has torch with CUDA and transformers, but no Ray, no
SGLang and no network, so this runs the parts that need only torch, in
plain processes:

    trainer   one training step of the torch backend on CUDA: FSDP2 over one
              rank, bf16 compute on float32 master weights, activation
              recomputation, token-budget micro-batches; step time, peak
              memory, and the loss against the same step unsharded in float32
    nccl      the weight-sync transport: a bucketed broadcast of the model's
              tensors between two processes on the one GPU over NCCL (NCCL
              refuses two ranks on one device on some versions: then gloo
              between a GPU and a CPU process, and the line says so); GB/s
    ipc       colocate's hand-over: the trainer's CUDA tensors serialized as
              CUDA IPC handles (torch's multiprocessing reductions, the
              format SGLang's `update_weights_from_tensor` takes) and opened
              in a second process that checks every byte; seconds and GB/s
    engine    the CPU engine's batcher (relax_core/rollout/cpu_engine) run on
              the GPU: tokens/s of 64 requests x 64 new tokens
    megatron  the Megatron backend (relax_core/train/megatron, megatron-core's
              local layer spec, no Transformer Engine) in a process of its own
              on a one-rank world (the trainer's own `ensure_world`: NCCL over a
              HashStore): a tiny Qwen3's log-probs and one GRPO step (two
              epochs: two updates) on a fixed batch against the torch
              backend, both float32 (loss within 1e-5,
              every updated HF tensor within 1e-4 at lr 1e-3, log-probs within
              1e-4, the HF round trip of the loaded weights exact); a bfloat16
              step that gives a finite loss; where megatron-bridge imports, its
              HF export against `hf_weights.gather_hf` (else a reported skip)

    python3 tests/gpu/check.py [--only trainer,nccl,ipc,engine,megatron] [--out DIR]

Each part prints its figures as it ends and the last line is one JSON object
of all of them (a part that failed carries its error, the others still run).
A part with checks to pass (megatron) lists what did not under "failed": then
the check says so on stderr and exits 1. Without a GPU it says so and exits 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
PARTS = ("trainer", "nccl", "ipc", "engine", "megatron")
STRICT = ("megatron",)  # parts whose error fails the check (the others report it and go on)
# A model large enough that the GPU, not Python, sets the pace, small enough to build in seconds.
MODEL = {"hidden_size": 1024, "num_layers": 8, "num_heads": 16, "num_kv_heads": 8}
LENGTHS = {"prompt": (32, 256), "response": (16, 512)}  # token ranges of the training samples
DEVICE = "cuda"  # --device cpu: a smoke run of the code paths on a machine without a GPU (no figures worth keeping)


def sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def tiny_model(folder: Path) -> Path:
    from relax_core.models.tiny import materialize_tiny_model

    if not (folder / "config.json").exists():
        materialize_tiny_model(folder, seed=0, alphabet="abcdefghijklmnop", **MODEL)
    return folder


def samples(n: int, seed: int = 0):
    import torch

    from relax_core.rollout.types import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(*LENGTHS["prompt"], (1,), generator=g))
        r = int(torch.randint(*LENGTHS["response"], (1,), generator=g))
        ids = torch.randint(3, 20, (p + r,), generator=g).tolist()
        out.append(Sample(ids[:p], ids[p:], [-1.0] * r, reward=float(torch.rand(1, generator=g)), group_id=i // 8))
    return out


# ------------------------------------------------------------------ trainer
def part_trainer(model_dir: Path) -> dict:
    import torch

    from relax_core.train.config import TorchTrainerConfig
    from relax_core.train.torch_backend import TorchTrainer

    batch = samples(64)
    common = {"lr": 1e-5, "micro_batch_size": 16, "num_epochs": 2}
    result = {}
    for name, extra in (("fsdp_bf16_recompute", {"fsdp": True, "dtype": "bfloat16", "recompute_activations": True,
                                                 "max_tokens_per_micro_batch": 8192}),
                        ("plain_fp32", {})):
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trainer = TorchTrainer(model_dir, TorchTrainerConfig(device=DEVICE, **common, **extra))
        trainer.train_step(batch)  # warm-up (kernels, allocator)
        sync()
        start = time.perf_counter()
        metrics = trainer.train_step(batch)
        sync()
        seconds = time.perf_counter() - start
        tokens = sum(len(s.prompt_ids) + s.response_len for s in batch) * common["num_epochs"]
        result[name] = {"step_s": round(seconds, 4), "tokens_per_s": round(tokens / seconds),
                        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if DEVICE == "cuda" else None,
                        "loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}
        del trainer
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    result["loss_diff"] = abs(result["fsdp_bf16_recompute"]["loss"] - result["plain_fp32"]["loss"])
    return result


# ------------------------------------------------------------------ nccl
def _broadcast_rank(rank: int, port: int, backend: str, device: str, sizes: list[int], out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        tensors = [torch.full((n,), float(rank == 0), dtype=torch.bfloat16, device=device) for n in sizes]
        for t in tensors[:2]:  # warm-up
            dist.broadcast(t, 0)
        if device == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for t in tensors:
            dist.broadcast(t, 0)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        ok = all(bool((t == 1).all()) for t in tensors)
        if rank == 1:
            Path(out).write_text(json.dumps({"seconds": seconds, "ok": ok}))
    finally:
        dist.destroy_process_group()


def part_nccl(model_dir: Path) -> dict:
    import torch.multiprocessing as mp
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        sizes = [f.get_slice(k).get_shape() for k in f.keys()]
    numels = [math.prod(s) for s in sizes]
    total_bytes = 2 * sum(numels)
    result = {}
    for backend, devices in ((("nccl", ("cuda", "cuda")),) if DEVICE == "cuda" else ()) + (("gloo", ("cpu", "cpu")),):
        out = tempfile.mktemp()
        try:
            ctx = mp.get_context("spawn")
            port = _free_port()
            procs = [ctx.Process(target=_broadcast_rank, args=(r, port, backend, devices[r], numels, out))
                     for r in range(2)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(120)
            measured = json.loads(Path(out).read_text())
            result[backend] = {"seconds": round(measured["seconds"], 5), "ok": measured["ok"],
                               "gbytes_per_s": round(total_bytes / measured["seconds"] / 1e9, 4)}
        except Exception as exc:  # NCCL may refuse two ranks on one GPU
            result[backend] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    result["bytes"] = total_bytes
    return result


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ ipc
def _ipc_receiver(payload: bytes, expected: list[float], out: str, device: str) -> None:
    import pickle

    import torch

    start = time.perf_counter()
    named = pickle.loads(payload)
    sums = [float(t.float().sum()) for _, t in named]
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ok = all(abs(a - b) <= 1e-3 * max(1.0, abs(b)) for a, b in zip(sums, expected))
    Path(out).write_text(json.dumps({"seconds": seconds, "ok": ok, "tensors": len(named)}))


def part_ipc(model_dir: Path) -> dict:
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing as mp  # registers torch's reductions (CUDA tensors -> IPC handles) with it
    from safetensors.torch import load_file

    named = [(k, v.to(DEVICE, torch.bfloat16)) for k, v in load_file(model_dir / "model.safetensors").items()]
    expected = [float(t.float().sum()) for _, t in named]
    start = time.perf_counter()
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    serialize_s = time.perf_counter() - start
    out = tempfile.mktemp()
    proc = mp.get_context("spawn").Process(target=_ipc_receiver, args=(buf.getvalue(), expected, out, DEVICE))
    proc.start()
    proc.join(120)
    measured = json.loads(Path(out).read_text())
    total = sum(t.numel() * t.element_size() for _, t in named)
    return {"serialize_s": round(serialize_s, 5), "open_and_check_s": round(measured["seconds"], 4),
            "ok": measured["ok"], "tensors": measured["tensors"], "payload_bytes": len(buf.getvalue()),
            "weights_bytes": total}


# ------------------------------------------------------------------ engine
def part_engine(model_dir: Path) -> dict:
    import threading

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax_core.rollout.cpu_engine.batcher import Batcher, Sequence
    from relax_core.rollout.cpu_engine.sampling import RowSampling

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(DEVICE).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batcher = Batcher(model, tokenizer, max_running=64, seed=0, original_logprob=False)
    batcher.start()
    try:
        def run(n: int, new: int) -> float:
            done = threading.Semaphore(0)
            seqs = [Sequence(f"r{i}", [3 + j % 16 for j in range(64)], new, RowSampling(1.0, -1, 1.0, 0.0, False, None),
                             frozenset(), [], True, on_done=lambda s: done.release()) for i in range(n)]
            start = time.perf_counter()
            batcher.submit(seqs)
            for _ in seqs:
                done.acquire(timeout=300)
            return sum(len(s.output_ids) for s in seqs) / (time.perf_counter() - start)

        run(8, 8)  # warm-up
        return {"tokens_per_s": round(run(64, 64)), "requests": 64, "new_tokens": 64}
    finally:
        batcher.stop()


# ------------------------------------------------------------------ megatron
# The parity model and batch: small enough that float32 rounding stays far below the tolerances.
MEGATRON_MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
MEGATRON_LR = 1e-3
TOLERANCE = {"loss": 1e-5, "weights": 1e-4, "logprobs": 1e-4, "roundtrip": 0.0, "bridge": 1e-6}


def megatron_samples():
    """A fixed GRPO batch: 8 rows in 2 groups of 4, a reward in each group (so the advantages are not 0)."""
    import random

    from relax_core.rollout.types import Sample

    rng = random.Random(0)
    out = []
    for i in range(8):
        p = [rng.randrange(3, 19) for _ in range(rng.randrange(2, 5))]
        r = [rng.randrange(3, 19) for _ in range(rng.randrange(1, 6))]
        out.append(Sample(prompt_ids=p, response_ids=r, rollout_logprobs=[-1.0] * len(r), loss_mask=[1] * len(r),
                          reward=float(i % 3 == 0), group_id=i // 4))
    return out


def _max_diff(a: dict, b: dict) -> float:
    return max((float((a[k].float() - b[k].float()).abs().max()) for k in a.keys() & b.keys()), default=math.inf)


def _megatron_config(dtype: str):
    from relax_core.train.config import TorchTrainerConfig

    # Two epochs: the first update's ratio is 1 (its loss hardly depends on the model), the second's is not.
    return TorchTrainerConfig(device=DEVICE, dtype=dtype, lr=MEGATRON_LR, micro_batch_size=3, num_epochs=2,
                              algorithm="grpo", seed=0)


def _timed_step(trainer, batch) -> tuple[dict, float]:
    sync()
    start = time.perf_counter()
    metrics = trainer.train_step(batch)
    sync()
    return metrics, round(time.perf_counter() - start, 4)


def _hf_cpu(named) -> dict:
    """Float32 CPU copies (on CPU `.float().cpu()` alone would keep views of the live parameters)."""
    return {name: t.detach().float().cpu().clone() for name, t in named}


def _bridge_compare(trainer, model_dir: Path, ours: dict) -> tuple[dict, bool]:
    """megatron-bridge's HF export of the trained model against ours; (figures, ok). Skipped (ok) where
    megatron-bridge does not import."""
    try:
        from megatron.bridge import AutoBridge
    except Exception as exc:  # not installed (the GPU test machine): a skip, said so
        return {"skipped": f"megatron-bridge not importable ({type(exc).__name__}: {exc})"[:200]}, True
    try:  # installed, it must work: an error fails the check (the rest of the part still runs)
        bridge = AutoBridge.from_hf_pretrained(str(model_dir))
        theirs = _hf_cpu(bridge.export_hf_weights([trainer.module], cpu=True))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300], "trace": traceback.format_exc()[-1000:]}, False
    missing, extra = sorted(ours.keys() - theirs.keys()), sorted(theirs.keys() - ours.keys())
    diff = _max_diff(ours, theirs)
    ok = not missing and not extra and diff <= TOLERANCE["bridge"]
    return {"tensors": len(theirs), "max_abs_diff": diff, "missing": missing[:8], "extra": extra[:8]}, ok


def _megatron_compare() -> dict:
    import gc

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from relax_core.models.tiny import materialize_tiny_model
    from relax_core.train.torch_backend import TorchTrainer

    torch.set_float32_matmul_precision("highest")  # no TF32 on either side (torch's default; set, not assumed)
    model_dir = materialize_tiny_model(Path(tempfile.mkdtemp()) / "qwen3", seed=0, **MEGATRON_MODEL)
    batch = megatron_samples()
    initial = load_file(model_dir / "model.safetensors")
    result: dict = {"model": MEGATRON_MODEL, "params": sum(t.numel() for t in initial.values()),
                    "samples": len(batch), "tokens": sum(len(s.prompt_ids) + s.response_len for s in batch),
                    "lr": MEGATRON_LR, "tolerance": TOLERANCE}
    failed: list[str] = []

    def check(name: str, value: float, limit: float) -> None:
        if not value <= limit:  # NaN fails too
            failed.append(f"{name}: {value:.3g} > {limit:g}")

    # The torch backend, float32: the reference.
    ref = TorchTrainer(model_dir, _megatron_config("float32"))
    ref_logps = ref.compute_logprobs(batch)
    ref_metrics, ref_s = _timed_step(ref, batch)
    ref_weights = _hf_cpu(ref.named_parameters_for_sync())
    del ref
    gc.collect()

    start = time.perf_counter()
    import importlib.metadata

    import megatron.core  # noqa: F401  (timed: the import is most of the part's start-up)

    from relax_core.train.megatron import hf_weights
    from relax_core.train.megatron.model import Parallel
    from relax_core.train.megatron.trainer import MegatronTrainer, ensure_world

    result["megatron_core"] = importlib.metadata.version("megatron-core")
    result["import_s"] = round(time.perf_counter() - start, 2)
    try:  # the trainer's own one-rank world (MegatronTrainer would make it the same way)
        ensure_world(DEVICE)
        result["world"] = {"backend": dist.get_backend(), "store": "HashStore", "size": dist.get_world_size(),
                           "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}
    except Exception as exc:  # said, then a file store, so that the comparisons still run
        failed.append(f"ensure_world: {type(exc).__name__}: {exc}"[:300])
        backend = "nccl" if DEVICE == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
        result["world"] = {"backend": backend, "store": "FileStore (fallback)", "size": 1}

    # Megatron, float32, TP=1.
    mg = MegatronTrainer(model_dir, _megatron_config("float32"), Parallel(tp=1), distributed_optimizer=False)
    loaded = _hf_cpu(hf_weights.gather_hf(mg.module, mg.hf_config))
    mg_logps = mg.compute_logprobs(batch)
    mg_metrics, mg_s = _timed_step(mg, batch)
    mg_weights = _hf_cpu(mg.named_parameters_for_sync())
    logp_diff = max(abs(a - b) for ra, rb in zip(ref_logps, mg_logps) for a, b in zip(ra, rb))
    names_ok = set(mg_weights) == set(ref_weights) == set(initial) and set(loaded) == set(initial)
    if not names_ok:
        failed.append(f"HF names differ: megatron lacks {sorted(set(initial) - set(mg_weights))[:4]}, "
                      f"has extra {sorted(set(mg_weights) - set(initial))[:4]}")
    update = _max_diff(ref_weights, initial)
    fp32 = {
        "torch": {"loss": ref_metrics["loss"], "grad_norm": ref_metrics["grad_norm"], "step_s": ref_s},
        "megatron": {"loss": mg_metrics["loss"], "grad_norm": mg_metrics["grad_norm"], "step_s": mg_s},
        "loss_diff": abs(ref_metrics["loss"] - mg_metrics["loss"]),
        "grad_norm_diff": abs(ref_metrics["grad_norm"] - mg_metrics["grad_norm"]),
        "logprob_max_diff": logp_diff,
        "roundtrip_max_diff": _max_diff(loaded, initial),
        "weights_max_diff": _max_diff(mg_weights, ref_weights),
        "update_max": update,  # how far the step moved the weights (the scale weights_max_diff is read on)
        "tensors": len(mg_weights),
    }
    result["fp32"] = fp32
    check("fp32 loss diff", fp32["loss_diff"], TOLERANCE["loss"])
    check("fp32 updated weights max diff", fp32["weights_max_diff"], TOLERANCE["weights"])
    check("fp32 log-prob max diff", logp_diff, TOLERANCE["logprobs"])
    check("HF round trip of the loaded weights", fp32["roundtrip_max_diff"], TOLERANCE["roundtrip"])
    if not update > 0:
        failed.append("the torch step did not move the weights: the comparison shows nothing")

    bridge, bridge_ok = _bridge_compare(mg, model_dir, mg_weights)
    result["bridge"] = bridge
    if not bridge_ok:
        failed.append(f"megatron-bridge export differs: {bridge}"[:300])
    del mg
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    # Megatron, bfloat16 (float32 master weights in its optimizer): runs, finite.
    mg16 = MegatronTrainer(model_dir, _megatron_config("bfloat16"), Parallel(tp=1), distributed_optimizer=False)
    bf16_metrics, bf16_s = _timed_step(mg16, batch)
    bf16_weights = dict(mg16.named_parameters_for_sync())
    dtypes = sorted({str(t.dtype) for t in bf16_weights.values()})
    finite = all(bool(torch.isfinite(t).all()) for t in bf16_weights.values())
    result["bf16"] = {"loss": bf16_metrics["loss"], "grad_norm": bf16_metrics["grad_norm"], "step_s": bf16_s,
                      "loss_diff_vs_fp32": abs(bf16_metrics["loss"] - mg_metrics["loss"]),
                      "weights_max_diff_vs_fp32": _max_diff(_hf_cpu(bf16_weights.items()), mg_weights),
                      "sync_dtypes": dtypes, "weights_finite": finite,
                      "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if DEVICE == "cuda" else None}
    if not math.isfinite(bf16_metrics["loss"]) or not math.isfinite(bf16_metrics["grad_norm"]):
        failed.append(f"bf16 step: loss {bf16_metrics['loss']}, grad norm {bf16_metrics['grad_norm']}")
    if not finite:
        failed.append("bf16 step: non-finite weights")
    if dtypes != ["torch.bfloat16"]:
        failed.append(f"bf16 sync tensors are {dtypes}")
    del mg16
    dist.destroy_process_group()
    result["failed"] = failed
    return result


def _megatron_child(device: str, out: str) -> None:
    global DEVICE
    DEVICE = device
    # megatron-core also makes gloo groups beside the NCCL ones; one rank on one machine: over the loopback
    # (a machine without a network may have a host name that resolves to no interface).
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        result = _megatron_compare()
    except BaseException as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-2500:],
                  "failed": [f"error: {type(exc).__name__}"]}
    Path(out).write_text(json.dumps(result))


def part_megatron(model_dir: Path) -> dict:
    """In a process of its own: megatron-core's parallel state and the one-rank world are process-wide."""
    import torch.multiprocessing as mp

    out = tempfile.mktemp()
    proc = mp.get_context("spawn").Process(target=_megatron_child, args=(DEVICE, out))
    proc.start()
    proc.join(300)
    if proc.is_alive():
        proc.terminate()
        proc.join(10)
        return {"error": "timed out after 300 s", "failed": ["timed out"]}
    if not Path(out).exists():
        return {"error": f"the process ended with exit code {proc.exitcode} and no result",
                "failed": [f"exit code {proc.exitcode}"]}
    return json.loads(Path(out).read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(PARTS))
    parser.add_argument("--out", default=None, help="folder for the JSON result (check.json)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    global DEVICE
    DEVICE = args.device
    if DEVICE == "cpu":  # a smoke run: a model and batch the CPU gets through in seconds
        MODEL.update(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
        LENGTHS.update(prompt=(4, 16), response=(2, 16))
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU visible to torch: nothing to check here")
        return 1
    info = {"gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else None, "torch": torch.__version__,
            "python": sys.version.split()[0]}
    print(json.dumps(info))
    model_dir = tiny_model(Path(tempfile.mkdtemp()) / "model")
    results: dict = {"info": info}
    for part in args.only.split(","):
        start = time.perf_counter()
        try:
            results[part] = globals()[f"part_{part}"](model_dir)
        except Exception as exc:
            results[part] = {"error": f"{type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-1500:]}
            if part in STRICT:
                results[part]["failed"] = [f"error: {type(exc).__name__}"]
        results[part]["wall_s"] = round(time.perf_counter() - start, 2)
        print(part, json.dumps(results[part]), flush=True)
    line = json.dumps(results)
    if args.out:
        Path(args.out, "check.json").write_text(line)
    print(line)
    failed = {part: r["failed"] for part, r in results.items() if isinstance(r, dict) and r.get("failed")}
    for part, reasons in failed.items():
        print(f"FAILED {part}: " + "; ".join(reasons), file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
