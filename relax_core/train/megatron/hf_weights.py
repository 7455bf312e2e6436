"""Hugging Face <-> Megatron weights for Qwen3 / Qwen3-MoE: the project's own mapping.

Three views of one set of weights, and the rules between them:

- HF: `model.layers.{l}.self_attn.q_proj.weight`, ... (what the engines load).
- Megatron *global* (a distributed checkpoint's keys, every shard put back):
  `decoder.layers.{l}.self_attention.linear_qkv.weight` holds, per key/value
  group, that group's query heads then its key head then its value head;
  `mlp.linear_fc1.weight` is `[gate; up]`; expert `e` of layer `l` is
  `decoder.layers.{l}.mlp.experts.local_experts.{e}.*`; the embedding and output
  layer are padded to a multiple of 128 x TP rows.
- Megatron *local* (a rank's parameters): TP ranks hold row (column-parallel) or
  column (row-parallel) slices of the global tensor, except `linear_fc1`, whose
  rank slice is `[gate_r; up_r]`; EP rank `k` holds experts `k*E/EP ...` under
  local numbers; pipeline stage `s` holds layers `s*L/PP ...` under local numbers.

`global_to_hf` is the one place global names become HF names (checkpoint
conversion registers it); `load_hf` slices HF tensors into a rank's
parameters; `gather_hf` rebuilds the HF tensors from every rank's
parameters, one at a time, every rank taking part (weight sync, export).
Where megatron-bridge is installed `tests/gpu/check.py` checks
that it gives the same tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from relax_core.train.megatron.model import num_experts, padded_vocab

# Megatron layer suffix -> (HF layer suffix(es), how the global tensor is sharded over TP)
_LAYER = {
    "input_layernorm.weight": ("input_layernorm.weight", "replicated"),
    "self_attention.linear_qkv.weight": (("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                          "self_attn.v_proj.weight"), "qkv"),
    "self_attention.linear_qkv.bias": (("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                        "self_attn.v_proj.bias"), "qkv"),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", "row"),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight", "replicated"),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight", "replicated"),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", "replicated"),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "fc1"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", "row"),
    "mlp.router.weight": ("mlp.gate.weight", "replicated"),
}
_EXPERT = {
    "linear_fc1.weight": (("gate_proj.weight", "up_proj.weight"), "fc1"),
    "linear_fc2.weight": ("down_proj.weight", "row"),
}
_TOP = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight", "vocab"),
    "decoder.final_layernorm.weight": ("model.norm.weight", "replicated"),
    "output_layer.weight": ("lm_head.weight", "vocab"),
}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Dims:
    """What the mapping needs of the HF config."""

    heads: int
    groups: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, config: dict[str, Any]) -> Dims:
        heads = config["num_attention_heads"]
        return cls(heads, config.get("num_key_value_heads") or heads,
                   config.get("head_dim") or config["hidden_size"] // heads, config["vocab_size"],
                   bool(config.get("tie_word_embeddings")))


@dataclass(frozen=True)
class Entry:
    """One Megatron tensor (global name) and the HF tensors it is made of."""

    hf: tuple[str, ...]
    kind: str  # replicated | row | qkv | fc1 | vocab
    expert: bool = False


def entry(name: str) -> Entry | None:
    """The HF side of a global Megatron name (None: not a weight of the model, e.g. `_extra_state`)."""
    if name in _TOP:
        hf, kind = _TOP[name]
        return Entry((hf,), kind)
    match = _LAYER_RE.match(name)
    if match is None:
        return None
    layer, rest = match.groups()
    prefix = f"model.layers.{layer}."
    expert = _EXPERT_RE.match(rest)
    if expert is not None:
        index, suffix = expert.groups()
        if suffix not in _EXPERT:
            return None
        hf, kind = _EXPERT[suffix]
        names = (hf,) if isinstance(hf, str) else hf
        return Entry(tuple(f"{prefix}mlp.experts.{index}.{n}" for n in names), kind, expert=True)
    if rest not in _LAYER:
        return None
    hf, kind = _LAYER[rest]
    names = (hf,) if isinstance(hf, str) else hf
    return Entry(tuple(prefix + n for n in names), kind)


# ------------------------------------------------------------- global <-> HF
def split_global(e: Entry, tensor: torch.Tensor, dims: Dims) -> list[torch.Tensor]:
    """HF tensors (in `e.hf` order) of one global Megatron tensor."""
    if e.kind == "qkv":
        per = dims.heads // dims.groups
        grouped = tensor.reshape(dims.groups, (per + 2) * dims.head_dim, *tensor.shape[1:])
        q, k, v = torch.split(grouped, [per * dims.head_dim, dims.head_dim, dims.head_dim], dim=1)
        return [t.reshape(-1, *tensor.shape[1:]).contiguous() for t in (q, k, v)]
    if e.kind == "fc1":
        return [t.contiguous() for t in torch.chunk(tensor, 2, dim=0)]
    if e.kind == "vocab":
        return [tensor[: dims.vocab].contiguous()]
    return [tensor]


def join_global(e: Entry, parts: list[torch.Tensor], dims: Dims, vocab_rows: int) -> torch.Tensor:
    """The global Megatron tensor made of its HF tensors (`split_global`'s inverse)."""
    if e.kind == "qkv":
        per = dims.heads // dims.groups
        q, k, v = (p.reshape(dims.groups, -1, *p.shape[1:]) for p in parts)
        assert q.shape[1] == per * dims.head_dim
        return torch.cat([q, k, v], dim=1).reshape(-1, *parts[0].shape[1:])
    if e.kind == "fc1":
        return torch.cat(parts, dim=0)
    if e.kind == "vocab":
        (t,) = parts
        pad = torch.zeros(vocab_rows - t.shape[0], *t.shape[1:], dtype=t.dtype, device=t.device)
        return torch.cat([t, pad], dim=0)
    return parts[0]


def global_to_hf(name: str, tensor: torch.Tensor, config: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint's global tensor as HF (name, tensor) pairs (checkpoint/hf_export's NameMapper)."""
    e = entry(name)
    if e is None:
        return []
    dims = Dims.of(config)
    if name == "output_layer.weight" and dims.tied:
        return []
    return list(zip(e.hf, split_global(e, tensor, dims)))


# ------------------------------------------------------------- global <-> rank
@dataclass(frozen=True)
class Rank:
    """Where this rank sits: TP (or expert TP for experts), EP and pipeline coordinates."""

    tp: int
    tp_size: int
    etp: int
    etp_size: int
    ep: int
    ep_size: int
    pp: int
    pp_size: int
    layers: int  # total layers
    experts: int  # total experts (0: dense)

    @classmethod
    def current(cls, config: dict[str, Any]) -> Rank:
        from megatron.core import parallel_state as ps

        return cls(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                   ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                   ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(),
                   ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(),
                   config["num_hidden_layers"], num_experts(config))

    @property
    def layers_per_stage(self) -> int:
        return self.layers // self.pp_size

    def global_name(self, local: str) -> str:
        """A parameter's local name (`named_parameters()` of this stage) as its global name."""
        match = _LAYER_RE.match(local)
        if match is None:
            return local
        layer, rest = int(match.group(1)) + self.pp * self.layers_per_stage, match.group(2)
        expert = _EXPERT_RE.match(rest)
        if expert is not None:
            rest = f"mlp.experts.local_experts.{int(expert.group(1)) + self.ep * self.experts // self.ep_size}." \
                   f"{expert.group(2)}"
        return f"decoder.layers.{layer}.{rest}"

    def coords(self, e: Entry) -> tuple[int, int]:
        return (self.etp, self.etp_size) if e.expert else (self.tp, self.tp_size)


def local_slice(e: Entry, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This TP rank's part of a global tensor."""
    if size == 1 or e.kind == "replicated":
        return full
    if e.kind == "row":
        return torch.chunk(full, size, dim=1)[rank]
    if e.kind == "fc1":
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, size, 0)[rank], torch.chunk(up, size, 0)[rank]], dim=0)
    return torch.chunk(full, size, dim=0)[rank]  # column-parallel, qkv (whole groups), vocab


def join_slices(e: Entry, parts: list[torch.Tensor]) -> torch.Tensor:
    """The global tensor of every TP rank's part (`local_slice`'s inverse)."""
    if len(parts) == 1 or e.kind == "replicated":
        return parts[0]
    if e.kind == "row":
        return torch.cat(parts, dim=1)
    if e.kind == "fc1":
        halves = [torch.chunk(p, 2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=0)


# ----------------------------------------------------------------- model ops
def load_hf(model: torch.nn.Module, config: dict[str, Any], read: Callable[[str], torch.Tensor]) -> None:
    """Copy HF tensors (`read(name)`) into this rank's parameters; every parameter must be covered."""
    rank, dims = Rank.current(config), Dims.of(config)
    vocab = padded_vocab(dims.vocab, rank.tp_size)
    with torch.no_grad():
        for local, param in model.named_parameters():
            name = rank.global_name(local)
            e = entry(name)
            if e is None:
                raise KeyError(f"megatron parameter {local} ({name}) has no Hugging Face counterpart")
            hf = ("model.embed_tokens.weight",) if name == "output_layer.weight" and dims.tied else e.hf
            full = join_global(e, [read(n) for n in hf], dims, vocab)
            part = local_slice(e, full, *rank.coords(e))
            if part.shape != param.shape:
                raise ValueError(f"{local}: HF gives {tuple(part.shape)}, the model has {tuple(param.shape)}")
            param.copy_(part.to(param.dtype))


def _tp_group(e: Entry):
    from megatron.core import parallel_state as ps

    return ps.get_expert_tensor_parallel_group() if e.expert else ps.get_tensor_model_parallel_group()


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if size == 1:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def global_names(config: dict[str, Any]) -> list[str]:
    """Every global Megatron parameter name of the model, in HF order (the order weights are sent)."""
    dims, names = Dims.of(config), ["embedding.word_embeddings.weight"]
    experts = num_experts(config)
    for layer in range(config["num_hidden_layers"]):
        p = f"decoder.layers.{layer}."
        names += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight"]
        if config.get("attention_bias"):
            names.append(p + "self_attention.linear_qkv.bias")
        names += [p + "self_attention.linear_proj.weight", p + "self_attention.q_layernorm.weight",
                  p + "self_attention.k_layernorm.weight", p + "pre_mlp_layernorm.weight"]
        if experts:
            names.append(p + "mlp.router.weight")
            names += [f"{p}mlp.experts.local_experts.{x}.{s}" for x in range(experts) for s in _EXPERT]
        else:
            names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    names.append("decoder.final_layernorm.weight")
    if not dims.tied:
        names.append("output_layer.weight")
    return names


def _owner(name: str, rank: Rank) -> tuple[int, int]:
    """(pipeline stage, EP rank) holding a global parameter."""
    match = _LAYER_RE.match(name)
    if match is None:
        return (0 if name.startswith("embedding.") else rank.pp_size - 1), rank.ep
    stage = int(match.group(1)) // rank.layers_per_stage
    expert = _EXPERT_RE.match(match.group(2))
    ep = int(expert.group(1)) // (rank.experts // rank.ep_size) if expert else rank.ep
    return stage, ep


def _local_name(name: str, rank: Rank) -> str:
    match = _LAYER_RE.match(name)
    if match is None:
        return name
    rest = match.group(2)
    expert = _EXPERT_RE.match(rest)
    if expert is not None:
        rest = f"mlp.experts.local_experts.{int(expert.group(1)) % (rank.experts // rank.ep_size)}.{expert.group(2)}"
    return f"decoder.layers.{int(match.group(1)) % rank.layers_per_stage}.{rest}"


def gather_hf(model: torch.nn.Module, config: dict[str, Any], dtype: torch.dtype | None = None
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, whole tensor) of every weight, rebuilt from the TP/EP/PP shards one global tensor at a
    time. Every rank of the trainer world must iterate it in step; every rank gets every tensor."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    rank, dims = Rank.current(config), Dims.of(config)
    params = dict(model.named_parameters())
    # A stage receives what another one holds: it allocates the tensor in the dtype it is sent in (the
    # one asked for, else the model's), never in the dtype of one of its own parameters.
    sent = dtype or model.config.params_dtype
    device = next(iter(params.values())).device
    ep_group, pp_group = ps.get_expert_model_parallel_group(), ps.get_pipeline_model_parallel_group()
    per_rank = rank.experts // rank.ep_size if rank.ep_size > 1 else 0  # experts each EP rank holds
    for name in global_names(config):
        e = entry(name)
        stage, _ = _owner(name, rank)
        group = [name]
        if e.expert and per_rank:
            # Experts go as groups: local expert l is global expert k * E/EP + l on EP rank k, so one
            # all-gather of local l over the EP group brings EP of them (the engines take names in any
            # order); expert x with x >= E/EP has come with the group of x % (E/EP).
            index = int(_EXPERT_RE.match(_LAYER_RE.match(name).group(2)).group(1))
            if index >= per_rank:
                continue
            group = [_expert_named(name, k * per_rank + index) for k in range(rank.ep_size)]
        if rank.pp == stage:
            full = join_slices(e, _all_gather(params[_local_name(name, rank)].detach(), _tp_group(e)))
            fulls = _all_gather(full, ep_group) if len(group) > 1 else [full]
            fulls = [f.to(sent) for f in fulls] if rank.pp_size > 1 else fulls
        else:
            fulls = [torch.empty(_global_shape(name, config, rank), dtype=sent, device=device) for _ in group]
        for full in fulls:
            if rank.pp_size > 1:
                dist.broadcast(full, group=pp_group, src=dist.get_global_rank(pp_group, stage))
        for global_name, full in zip(group, fulls):
            for hf_name, tensor in zip(entry(global_name).hf, split_global(entry(global_name), full, dims)):
                yield hf_name, tensor if dtype is None else tensor.to(dtype)


def _expert_named(name: str, index: int) -> str:
    """A global expert parameter's name with another expert's index."""
    layer, rest = _LAYER_RE.match(name).groups()
    return f"decoder.layers.{layer}.mlp.experts.local_experts.{index}.{_EXPERT_RE.match(rest).group(2)}"


def _global_shape(name: str, config: dict[str, Any], rank: Rank) -> tuple[int, ...]:
    """Shape of a global tensor (for a pipeline stage that receives it)."""
    dims, h = Dims.of(config), config["hidden_size"]
    e = entry(name)
    suffix = name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1]
    if e.kind == "vocab":
        return (padded_vocab(dims.vocab, rank.tp_size), h)
    if "layernorm" in name:
        return (dims.head_dim,) if ("q_layernorm" in name or "k_layernorm" in name) else (h,)
    if suffix == "linear_qkv.weight":
        return ((dims.heads + 2 * dims.groups) * dims.head_dim, h)
    if suffix == "linear_qkv.bias":
        return ((dims.heads + 2 * dims.groups) * dims.head_dim,)
    if suffix == "linear_proj.weight":
        return (h, dims.heads * dims.head_dim)
    if suffix == "router.weight":
        return (num_experts(config), h)
    ffn = config["moe_intermediate_size"] if e.expert else config["intermediate_size"]
    if suffix == "linear_fc1.weight":
        return (2 * ffn, h)
    if suffix == "linear_fc2.weight":
        return (h, ffn)
    raise KeyError(name)


# --------------------------------------------------- checkpoint keys -> HF
# A distributed checkpoint stacks every layer's tensor under one key (leading axis: the layer; experts:
# then the expert) and names the norms as Transformer Engine's fused layers hold them.
_CKPT_LAYER = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_CKPT_EXPERTS = "mlp.experts.experts."


def checkpoint_to_hf(name: str, tensor: torch.Tensor, config: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """One tensor of a Megatron distributed checkpoint (a global, layer-stacked key) as HF (name, tensor)
    pairs: checkpoint conversion's NameMapper for `model_naming` "megatron"."""
    if not name.startswith("decoder.layers."):
        return global_to_hf(name, tensor, config)
    suffix = name.removeprefix("decoder.layers.")
    out: list[tuple[str, torch.Tensor]] = []
    for layer in range(tensor.shape[0]):
        if suffix.startswith(_CKPT_EXPERTS):
            rest = suffix.removeprefix(_CKPT_EXPERTS)
            for expert in range(tensor.shape[1]):
                out += global_to_hf(f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{rest}",
                                    tensor[layer, expert], config)
        else:
            local = _CKPT_LAYER.get(suffix, suffix)
            out += global_to_hf(f"decoder.layers.{layer}.{local}", tensor[layer], config)
    return out


# ------------------------------------------- HF files -> transformers' parameters
_EXPERT_HF_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def transformers_named(config: dict[str, Any]):
    """For a Qwen3-MoE under transformers 5, whose model fuses each layer's experts into `experts.gate_up_proj`
    `[E, 2F, H]` and `experts.down_proj` `[E, H, F]` (its files keep them per expert): a function turning a
    stream of file-named tensors into the model's parameter names (what the CPU engine and the
    actor-forward worker load). None where the names already agree (dense models, transformers 4)."""
    import transformers

    experts = num_experts(config)
    if not experts or int(transformers.__version__.split(".")[0]) < 5:
        return None

    def fuse(named):
        pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
        for name, tensor in named:
            match = _EXPERT_HF_RE.match(name)
            if match is None:
                yield name, tensor
                continue
            prefix, index, kind = match.group(1), int(match.group(2)), match.group(3)
            parts = pending.setdefault(prefix, {})
            parts[(index, kind)] = tensor
            if len(parts) == 3 * experts:  # the layer's experts are complete
                del pending[prefix]
                yield f"{prefix}.gate_up_proj", torch.stack(
                    [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]], dim=0) for e in range(experts)])
                yield f"{prefix}.down_proj", torch.stack([parts[(e, "down_proj")] for e in range(experts)])
        if pending:
            raise ValueError(f"experts of {sorted(pending)} came incomplete")

    return fuse
