"""The memory plan: what each trainer rank's GPU holds at its peak, from the recipe and the model's config,
and a refusal (exit 2, before anything is submitted) when it cannot fit.

    shape      `model_shape`      parameters and layer sizes, from the model's config.json (a local folder,
                                  the hub cache, or the tiny model's); None when not on this machine
    estimate   `trainer_plan`     bytes per item of one trainer rank's GPU, each with its arithmetic
    check      `memory_problems`  the plan against each node group's `gpu_memory_gib` (or its `gpu_type`'s)
    show       `memory_lines`     `relax validate` and `relax submit --dry-run` print it

The estimate is arithmetic, not a measurement (`tests/benchmarks/bench_train.py` measures): weights,
gradients and Adam's state as the backend keeps them (torch: float32 master weights, sharded by FSDP2
over the ranks; megatron: compute-dtype weights and float32 gradients per tensor/pipeline shard, float32
master weights and Adam's moments sharded over data-parallel ranks with the distributed optimizer),
activations of one micro-batch at the recipe's token budget (each decoder layer's saved tensors per token,
or only its input with recompute, plus one layer's whole), the loss head (the chunked head's float32
chunk, `train/loss_head.py`, in both backends inside the output layer; megatron's in bf16 also sums its
weight's gradient in float32), the critic's and the reference model's share, and a fixed
allowance for the CUDA context, NCCL and allocator slack. In colocate the engines release their memory
while the trainer trains (`enable_memory_saver`); what SGLang keeps then (its CUDA context and graphs)
is in the allowance.

Per-token activation bytes of one decoder layer, in the compute dtype's `c` bytes, are those of the
tensors autograd saves: c * (6h + 2q + 2kv + 4i) for hidden size h, query width q (heads x head_dim),
key/value width kv and MLP width i (a MoE layer: the routed experts' widths times top-k, plus the shared
expert's), with flash or per-sample attention in both backends (no T x T scores: `train/varlen.py`,
`train/megatron/attention.py`); Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models" (2022), count 34h for GPT's 4h MLP the same way. Estimates
err high: the plan is there to refuse what cannot fit, not to fill the last gigabyte.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from relax_core.config.engines import engine_kind
from relax_core.config.model import HFModel, TinyModel
from relax_core.config.schema import Recipe, rollout_group_name

GIB = 1024**3
RUNTIME_GIB = 3.0  # CUDA context, NCCL buffers, allocator slack; in colocate, what a sleeping engine keeps
HEAD_CHUNK_BYTES = 256 * 1024**2  # train/loss_head.CHUNK_BYTES (read here without importing torch)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Memory of the GPUs Slurm sites name by these gres types, when `gpu_memory_gib` is unset (the type names
# one memory size: `a100` is sold with 40 or 80 GB, so it is not here).
GPU_MEMORY_GIB = {"h100": 80, "h200": 141, "gh200": 96, "b200": 180, "l40s": 48, "l40": 48, "a10": 24}


@dataclass(frozen=True)
class Shape:
    """What the estimate needs of a model (its language model's config)."""

    params: int  # every parameter, encoders and all experts included
    hidden: int
    layers: int
    heads: int  # attention heads
    query: int  # attention heads x head_dim
    kv: int  # key/value heads x head_dim
    mlp: int  # MLP width a token goes through (MoE: top-k routed experts' widths + the shared expert's)
    vocab: int


@dataclass(frozen=True)
class Item:
    name: str
    bytes: float
    arithmetic: str


def model_shape(recipe: Recipe, folder: str | None = None) -> Shape | None:
    """The model's shape from its config.json, when this machine has it: in `folder` (where `relax submit`
    fetched it), a local `model.path`, the run's hub cache (`cluster.hub_cache`, or the one beside the runs:
    launch/hub.py), or the tiny model's; None otherwise."""
    config = _config(recipe, folder)
    return shape_of(config) if config else None


def _config(recipe: Recipe, folder: str | None) -> dict | None:
    model = recipe.model
    if isinstance(model, TinyModel):
        from relax_core.models.model_dir import known_config

        return known_config(recipe)
    assert isinstance(model, HFModel)
    for candidate in (folder, model.path):
        if candidate and (Path(candidate).expanduser() / "config.json").is_file():
            return json.loads((Path(candidate).expanduser() / "config.json").read_text())
    from huggingface_hub import try_to_load_from_cache

    from relax_core.models.hub_cache import hub_cache_dir

    cache = hub_cache_dir(recipe, Path(recipe.logging.run_root) / "run") / "hub"
    found = try_to_load_from_cache(model.path, "config.json", cache_dir=str(cache))
    return json.loads(Path(found).read_text()) if isinstance(found, str) else None


def shape_of(config: dict) -> Shape:
    """The shape of a transformers config (Qwen3, Qwen3-MoE; Qwen3-VL's and Qwen3-Omni's language model, their
    encoders counted by parameters)."""
    text = config.get("thinker_config", config)
    encoders = _encoder_params(text)
    text = text.get("text_config", text)
    h, layers, vocab = text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]
    head_dim = text.get("head_dim") or h // text["num_attention_heads"]
    heads = text["num_attention_heads"]
    q, kv = heads * head_dim, text.get("num_key_value_heads", heads) * head_dim
    experts = text.get("num_experts") or 0
    if experts:
        moe_i, top_k = text["moe_intermediate_size"], text["num_experts_per_tok"]
        shared = text.get("shared_expert_intermediate_size") or 0
        mlp_params = experts * 3 * h * moe_i + h * experts + 3 * h * shared
        mlp = top_k * moe_i + shared
    else:
        mlp = text["intermediate_size"]
        mlp_params = 3 * h * mlp
    attention = h * q + 2 * h * kv + q * h + 2 * head_dim  # q/k/v/o projections, q/k norms
    layer = attention + mlp_params + 2 * h  # two RMSNorms
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    params = layers * layer + vocab * h * (1 if tied else 2) + h + encoders
    return Shape(params, h, layers, heads, q, kv, mlp, vocab)


def _encoder_params(config: dict) -> int:
    """Parameters of a vision or audio encoder, roughly: 12 h^2 per block (attention 4h^2, MLP 8h^2)."""
    total = 0
    for key in ("vision_config", "audio_config"):
        sub = config.get(key)
        if sub:
            h = sub.get("hidden_size") or sub.get("d_model") or 0
            depth = sub.get("depth") or sub.get("num_hidden_layers") or sub.get("encoder_layers") or 0
            width = sub.get("intermediate_size") or sub.get("encoder_ffn_dim") or 4 * h
            total += depth * (4 * h * h + 2 * h * width)
    return total


def tokens_per_micro_batch(recipe: Recipe) -> int:
    """Prompt and response tokens one micro-batch holds at most: the token budget, or micro_batch_size
    samples of the longest prompt and response."""
    train, ro = recipe.train, recipe.rollout
    longest = ro.max_prompt_len + ro.max_new_tokens
    budget = train.max_tokens_per_gpu
    return max(budget, longest) if budget else train.micro_batch_size * longest


def trainer_plan(recipe: Recipe, shape: Shape) -> list[Item]:
    """One trainer rank's GPU at its peak, item by item."""
    train = recipe.train
    c = DTYPE_BYTES[recipe.model.dtype]
    ranks = recipe.train_ranks
    tokens = tokens_per_micro_batch(recipe)
    packed = train.max_tokens_per_gpu
    responses = tokens if packed else train.micro_batch_size * recipe.rollout.max_new_tokens
    p = shape.params
    items: list[Item] = []
    if train.backend == "megatron":
        model_shards = train.tensor_parallel * train.pipeline_parallel
        dp = max(1, ranks // model_shards)
        opt_shards = model_shards * (dp if train.distributed_optimizer else 1)
        items += [Item("weights", c * p / model_shards, f"{c} B x {_n(p)} params / {model_shards} (TP x PP)"),
                  Item("gradients", 4 * p / model_shards, f"4 B (float32) x {_n(p)} / {model_shards}"),
                  Item("optimizer", 12 * p / opt_shards,
                       f"12 B (float32 master + 2 Adam moments) x {_n(p)} / {opt_shards}"
                       f"{' (distributed optimizer: x DP)' if train.distributed_optimizer else ''}")]
        layers, tp = -(-shape.layers // train.pipeline_parallel), train.tensor_parallel
        per_token_layer = c * (6 * shape.hidden + (2 * shape.query + 2 * shape.kv + 4 * shape.mlp) / tp)
        items.append(_activations(recipe, per_token_layer, layers, tokens, c, shape.hidden,
                                  f"{c} B x (6h + (2q + 2kv + 4i) / TP {tp})"))
        accumulator = 4 * shape.vocab * shape.hidden / tp if c < 4 else 0
        items.append(Item("loss head", 3 * HEAD_CHUNK_BYTES + accumulator,
                          f"3 x {HEAD_CHUNK_BYTES // 1024**2} MiB float32 chunk (vocabulary-parallel inside the "
                          f"output layer, train/loss_head.py)" + (f" + the output layer's float32 gradient 4 B x "
                          f"{_n(shape.vocab)} x {shape.hidden} / TP {tp}" if accumulator else "")))
    else:
        fsdp = train.fsdp if train.fsdp is not None else recipe.cluster.train.gpus_per_node > 0
        shards = ranks if fsdp else 1
        how = f" / {shards} ranks (FSDP2)" if fsdp else ""
        items += [Item("weights", 4 * p / shards, f"4 B (float32 master) x {_n(p)} params{how}"),
                  Item("gradients", 4 * p / shards, f"4 B x {_n(p)}{how}"),
                  Item("optimizer", 8 * p / shards, f"8 B (2 Adam moments) x {_n(p)}{how}")]
        if c < 4:
            root = 2 * shape.vocab * shape.hidden
            gathered = c * (root + 2 * (p - root) / shape.layers) if fsdp else c * p
            items.append(Item("compute copy", gathered, f"{c} B x (embeddings and head + 2 layers gathered)"
                              if fsdp else f"{c} B x {_n(p)} (autocast's copies of the weights)"))
        per_token_layer = c * (6 * shape.hidden + 2 * shape.query + 2 * shape.kv + 4 * shape.mlp)
        items.append(_activations(recipe, per_token_layer, shape.layers, tokens, c, shape.hidden,
                                  f"{c} B x (6h + 2q + 2kv + 4i)"))
        items.append(Item("loss head", 3 * HEAD_CHUNK_BYTES + 4 * responses * shape.hidden,
                          f"3 x {HEAD_CHUNK_BYTES // 1024**2} MiB float32 chunk + 4 B x {_n(responses)} response "
                          f"tokens x hidden"))
    items += _companions(recipe, shape, c, ranks)
    items += _kept_for_sync(recipe, shape, c)
    items.append(Item("runtime", RUNTIME_GIB * GIB, "CUDA context, NCCL, allocator slack (and a sleeping engine's)"))
    return items


def _kept_for_sync(recipe: Recipe, shape: Shape, c: int) -> list[Item]:
    """Engines on GPUs of their own get the weights from rank 0, which keeps them whole in host memory
    (controller/workers.set_aside) and moves them to its GPU a bucket at a time as it sends them: the
    bucket's tensors and, over NCCL, the bucket flattened into one (weights/sync.py). Engines on the
    trainer's GPUs take the weights by reference, shard by shard."""
    from relax_core.cluster.placement import engines_share_train_gpus

    if engines_share_train_gpus(recipe):
        return []
    bucket = recipe.train.weight_sync_bucket_mb * 1024**2
    whole = c * shape.params
    return [Item("sync bucket", 2 * min(bucket, whole),
                 f"rank 0: a weight-sync bucket on the GPU and its flattened copy, 2 x "
                 f"{_n(min(bucket, whole) / 1024**2)} MiB (the whole weights wait in host memory)")]


def _activations(recipe: Recipe, per_token_layer: float, layers: int, tokens: int, c: int, hidden: int,
                 formula: str) -> Item:
    if recipe.train.recompute_activations:
        total = layers * c * hidden * tokens + per_token_layer * tokens
        return Item("activations", total, f"recompute: {layers} layers x {c} B x h {hidden} x {_n(tokens)} tokens + "
                    f"one layer's {formula}")
    return Item("activations", layers * per_token_layer * tokens,
                f"{layers} layers x {_n(tokens)} tokens x {formula} ({per_token_layer / 1024:.1f} KiB)")


def _companions(recipe: Recipe, shape: Shape, c: int, ranks: int) -> list[Item]:
    """The critic's state (PPO: a second model of the same size, trained) and the reference model's
    weights when they live in the trainer ranks."""
    from relax_core.config.modes import reference_service

    algo, items = recipe.algorithm, []
    if getattr(algo, "critic", None) is not None:
        if recipe.train.backend == "megatron":
            train = recipe.train
            shards = train.tensor_parallel * train.pipeline_parallel
            opt = shards * (max(1, ranks // shards) if train.distributed_optimizer else 1)
            items.append(Item("critic", (c + 4) * shape.params / shards + 12 * shape.params / opt,
                              f"({c} + 4) B x {_n(shape.params)} / {shards} + 12 B x {_n(shape.params)} / {opt} "
                              "(weights, gradients, optimizer, sharded as the policy's)"))
        else:
            fsdp = recipe.train.fsdp if recipe.train.fsdp is not None else recipe.cluster.train.gpus_per_node > 0
            shards = ranks if fsdp else 1
            items.append(Item("critic", 16 * shape.params / shards,
                              f"16 B x {_n(shape.params)} / {shards} (weights, gradients, optimizer)"))
    if (algo.kl_loss_coef > 0 or algo.uses_reference) and not reference_service(recipe):
        items.append(Item("reference", c * shape.params, f"{c} B x {_n(shape.params)} (its own copy, on each rank)"))
    return items


def gpu_memory_gib(recipe: Recipe, group: str) -> float | None:
    """A node group's GPU memory: its `gpu_memory_gib`, or the memory of its `gpu_type`."""
    node_group = getattr(recipe.cluster, group)
    if node_group.gpu_memory_gib:
        return node_group.gpu_memory_gib
    return GPU_MEMORY_GIB.get((node_group.gpu_type or "").lower())


def engine_item(recipe: Recipe, shape: Shape) -> Item | None:
    """What an SGLang engine's weights take of each of its GPUs, against SGLang's static share (weights
    and KV cache: `mem_fraction_static`, at most 0.9 when the recipe leaves it to SGLang)."""
    ro = recipe.rollout
    if not engine_kind(ro.engine).on_gpus or not ro.gpus_per_engine:
        return None
    c = DTYPE_BYTES[recipe.model.dtype]
    return Item("engine weights", c * shape.params / ro.gpus_per_engine,
                f"{c} B x {_n(shape.params)} params / {ro.gpus_per_engine} GPUs per engine (TP)")


def static_fraction(recipe: Recipe) -> float:
    return float(recipe.rollout.engine_args.get("mem_fraction_static", 0.9))


def memory_lines(recipe: Recipe, folder: str | None = None) -> list[str]:
    """The plan as `relax validate` and `relax submit --dry-run` print it (nothing for a CPU run)."""
    if not recipe.cluster.train.gpus_per_node:
        return []
    shape = model_shape(recipe, folder)
    if shape is None:
        return ["memory plan: not made: the model's config.json is not on this machine (a local model.path, "
                "or the hub cache after `relax submit` has fetched it, gives it)"]
    items = trainer_plan(recipe, shape)
    total = sum(i.bytes for i in items)
    lines = [f"memory plan, one trainer rank's GPU ({_n(shape.params)} params, "
             f"{_n(tokens_per_micro_batch(recipe))} tokens per micro-batch): {total / GIB:.1f} GiB "
             + _verdict(total, gpu_memory_gib(recipe, "train"), "train")]
    lines += [f"  {i.name:<14} {i.bytes / GIB:7.2f} GiB  {i.arithmetic}" for i in items]
    engine = engine_item(recipe, shape)
    if engine is not None:
        group = rollout_group_name(recipe)
        capacity, fraction = gpu_memory_gib(recipe, group), static_fraction(recipe)
        share = f"{fraction:g} x {capacity:g} GiB = {fraction * capacity:.1f} GiB" if capacity else f"{fraction:g} x ?"
        lines.append(f"memory plan, one engine GPU ({group} group): weights {engine.bytes / GIB:.1f} GiB "
                     f"({engine.arithmetic}) of SGLang's static share {share}, the rest its KV cache")
    return lines


def _verdict(total: float, capacity: float | None, group: str) -> str:
    if not capacity:
        return f"(set cluster.{group}.gpu_memory_gib to check it against the GPUs)"
    return f"of {capacity:g} GiB: {'fits' if total <= capacity * GIB else 'DOES NOT FIT'}"


def memory_problems(recipe: Recipe, folder: str | None = None) -> list[str]:
    """Trainer ranks, engines or reference workers that cannot fit their GPUs: the plan, and what to change
    (`folder`: where the model's hub snapshot was fetched)."""
    groups = [g for g in ("train", rollout_group_name(recipe), "reference") if getattr(recipe.cluster, g).gpus_per_node]
    if not any(gpu_memory_gib(recipe, g) for g in groups):
        return []
    shape = model_shape(recipe, folder)
    if shape is None:
        return []
    problems = []
    capacity = gpu_memory_gib(recipe, "train")
    items = trainer_plan(recipe, shape)
    total = sum(i.bytes for i in items)
    if capacity and recipe.cluster.train.gpus_per_node and total > capacity * GIB:
        largest = sorted(items, key=lambda i: -i.bytes)[:3]
        problems.append(
            f"cluster.train: one trainer rank needs about {total / GIB:.1f} GiB of GPU memory and its GPUs have "
            f"{capacity:g} GiB (largest: " + ", ".join(f"{i.name} {i.bytes / GIB:.1f} GiB" for i in largest)
            + "); " + _advice(recipe) + "\n    " + "\n    ".join(memory_lines(recipe, folder)))
    engine, group = engine_item(recipe, shape), rollout_group_name(recipe)
    capacity = gpu_memory_gib(recipe, group)
    if engine is not None and capacity and engine.bytes >= static_fraction(recipe) * capacity * GIB:
        problems.append(
            f"rollout.gpus_per_engine: each engine GPU would hold {engine.bytes / GIB:.1f} GiB of weights "
            f"({engine.arithmetic}), and SGLang's static share is {static_fraction(recipe):g} x {capacity:g} GiB: "
            "no room for the KV cache; set a larger rollout.gpus_per_engine or rollout.engine_args.mem_fraction_static")
    capacity = gpu_memory_gib(recipe, "reference")
    if recipe.cluster.reference.gpus_per_node and capacity:
        c = DTYPE_BYTES[recipe.model.dtype]
        need = c * shape.params + RUNTIME_GIB * GIB
        if need > capacity * GIB:
            problems.append(f"cluster.reference: a reference worker holds {c} B x {_n(shape.params)} params + "
                            f"{RUNTIME_GIB:g} GiB runtime = {need / GIB:.1f} GiB, its GPUs {capacity:g} GiB; "
                            "put the reference model on larger GPUs")
    return problems


def _advice(recipe: Recipe) -> str:
    train, tips = recipe.train, []
    if not train.recompute_activations:
        tips.append("train.recompute_activations: true")
    if train.max_tokens_per_gpu:
        tips.append("a smaller train.max_tokens_per_gpu")
    elif train.micro_batch_size > 1:
        tips.append("a smaller train.micro_batch_size")
    if not train.max_tokens_per_gpu:
        tips.append("train.max_tokens_per_gpu (pack micro-batches to a token budget)")
    if train.backend == "megatron":
        tips.append("a larger train.tensor_parallel or train.distributed_optimizer: true")
    elif train.fsdp is False:
        tips.append("train.fsdp: true")
    tips.append("more training GPUs")
    return "set " + ", or ".join(tips)


def _n(count: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= size:
            return f"{count / size:.3g}{unit}"
    return f"{count:g}"
