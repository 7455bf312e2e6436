"""The Megatron backend as a GPU runs it, checked on CPU: placement, precision, weight decay, checkpoints.

- placement: a GRPO step (two updates), log-probs, logits and the weights gathered for the engines, with
  the trainer on `tests/sim_device.py`'s simulated accelerator, on one rank and with pipeline
  parallelism over two gloo ranks whose collectives refuse CPU tensors as NCCL does, give the CPU run's
  numbers exactly (a CPU tensor meeting the accelerator's raises there, as on CUDA);
- bf16 trains bf16 parameters, the norms too (megatron-core's `Float16Module`), on fp32 master weights;
- weight decay spares biases and 1-D parameters, as Megatron-LM's schedule applies megatron-core's groups;
- a checkpoint is what Megatron-LM, Transformer Engine and Megatron-Bridge read: no optimizer state entry
  beyond megatron-core's own in the loading template (TE's FusedAdam refuses others), the RNG tracker's
  named states (Megatron-LM forks them after loading), and `args` from which Megatron-Bridge builds the
  model's config.

The ranks run in `megatron_ranks.py` (one process per rank).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_fixtures import subprocess_env
from megatron_ranks import ranks

from relax_core.models import tiny

ALPHABET = "abcdefghijklmnop"
LAYOUTS = {"one-rank-fp32": (1, {}, "float32"), "pp2-bf16": (2, {"pp": 2}, "bfloat16")}


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    return tiny.materialize_tiny_model(tmp_path_factory.mktemp("dense") / "m", alphabet=ALPHABET)


@pytest.fixture(scope="module")
def placed(dense, tmp_path_factory):
    """layout -> device -> what `role_placed` saw (GRPO, two mini-batches: two updates, weight decay 0.1)."""
    cache: dict[str, dict[str, dict]] = {}

    def run(layout: str) -> dict[str, dict]:
        if layout not in cache:
            world, parallel, dtype = LAYOUTS[layout]
            tmp = tmp_path_factory.mktemp(layout)
            cache[layout] = {device: torch.load(ranks("placed", tmp, world, model=str(dense), parallel=parallel,
                                                      dtype=dtype, device=device, minis=2, weight_decay=0.1))
                             for device in ("meta", "cpu")}
        return cache[layout]

    return run


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_step_on_an_accelerator_keeps_every_tensor_there_and_gives_the_cpus_numbers(placed, dense, layout):
    runs = placed(layout)
    sim, cpu = runs["meta"], runs["cpu"]
    assert sim["metrics"]["optimizer_steps"] == 2
    assert sim["metrics"] == cpu["metrics"] and sim["logprobs"] == cpu["logprobs"]
    assert torch.equal(sim["logits"], cpu["logits"])
    for key in ("before", "after"):
        assert sim[key].keys() == cpu[key].keys()
        assert all(torch.equal(sim[key][name], cpu[key][name]) for name in cpu[key]), key
    # the weights the engines get before any step are the HF file's, in the compute dtype, bit for bit
    from safetensors.torch import load_file

    dtype = getattr(torch, LAYOUTS[layout][2])
    hf = load_file(dense / "model.safetensors")
    assert sim["before"].keys() == hf.keys()
    assert all(torch.equal(sim["before"][name], tensor.to(dtype)) for name, tensor in hf.items())


def test_bf16_trains_bf16_parameters_on_fp32_master_weights(placed):
    run = placed("pp2-bf16")["cpu"]
    assert run["dtypes"] == ["torch.bfloat16"]  # the norms too, as Megatron-LM's Float16Module makes them
    assert run["masters"] == ["torch.float32"]
    assert placed("one-rank-fp32")["cpu"]["dtypes"] == ["torch.float32"]


def test_weight_decay_spares_biases_and_norms(placed):
    groups = placed("one-rank-fp32")["cpu"]["groups"]
    assert {(wd, tuple(dims)) for wd, dims in groups} == {(0.0, (1,)), (0.1, (2,))}


# What Megatron-Bridge 0.3.1 reads of a Megatron-LM checkpoint's `args` besides the TransformerConfig fields
# it copies by name: training/mlm_compat/arguments.py (_transformer_config_from_args, lines 52-105, and
# _tokenizer_config_from_args) and mlm_compat/model.py (_get_transformer_layer_spec, _gpt_provider, _get_model).
BRIDGE_READS = (
    "multi_latent_attention", "heterogeneous_layers_config_path", "no_persist_layer_norm", "apply_layernorm_1p",
    "norm_epsilon", "params_dtype", "overlap_p2p_comm", "num_experts", "rotary_interleaved",
    "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "fp8_param_gather", "swiglu",
    "bias_swiglu_fusion", "squared_relu", "init_method_xavier_uniform", "group_query_attention",
    "num_query_groups", "config_logger_dir", "cp_comm_type", "is_hybrid_model", "transformer_impl",
    "moe_grouped_gemm", "qk_layernorm", "qk_l2_norm", "normalization", "mtp_num_layers", "padded_vocab_size",
    "max_position_embeddings", "fp16_lm_cross_entropy", "untie_embeddings_and_output_weights",
    "position_embedding_type", "rotary_percent", "rotary_base", "use_rope_scaling", "init_model_with_meta_device",
    "fp16", "bf16", "tokenizer_type", "tokenizer_model",
)


def test_a_checkpoint_holds_what_megatron_lm_transformer_engine_and_megatron_bridge_read(dense, tmp_path):
    ckpt = tmp_path / "ckpt"
    result = json.loads(ranks("contract", tmp_path, 1, model=str(dense), ckpt=str(ckpt)).read_text())
    # megatron-core's own template state (init_state_fn): TE's FusedAdam keeps its step in the param group
    assert result["template_state_keys"] == ["exp_avg", "exp_avg_sq"]
    assert result["tracker_states"] == ["data-parallel-rng", "expert-parallel-rng", "model-parallel-rng"]

    from megatron.core import dist_checkpointing
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = dist_checkpointing.load_common_state_dict(str(ckpt / "iter_0000001"))["args"]
    missing = [name for name in BRIDGE_READS if not hasattr(args, name)]
    assert not missing
    config = json.loads((dense / "config.json").read_text())
    assert args.norm_epsilon == args.layernorm_epsilon == config["rms_norm_eps"]
    assert (args.num_layers, args.hidden_size, args.kv_channels) == (
        config["num_hidden_layers"], config["hidden_size"], config["head_dim"])
    assert args.swiglu and args.qk_layernorm and args.normalization == "RMSNorm" and len(args.cp_comm_type) == 1
    # every field of the model's TransformerConfig that Megatron-LM's args carry by name is there
    assert {"num_attention_heads", "ffn_hidden_size", "add_bias_linear", "attention_dropout"} <= {
        f for f in TransformerConfig.__dataclass_fields__ if hasattr(args, f)}


VERIFY = """
import json, sys
from relax_core.checkpoint.hf_verify import VerificationError, verify_export
try:
    print(json.dumps(verify_export(sys.argv[1], sys.argv[2])))
except VerificationError as err:
    print(json.dumps({"error": str(err)}))
"""


def verify(ckpt: Path, out: Path) -> dict:
    """`convert-ckpt --verify`'s check, in a process of its own (it builds the Megatron model on one rank)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", VERIFY, str(ckpt), str(out)], capture_output=True, text=True,
                          env=subprocess_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.full(covered_by="tests/integration/test_megatron.py::test_its_checkpoint_loads_into_a_fresh_megatron_model_and_converts_verified")
def test_a_bf16_checkpoint_is_verified_in_bf16_weight_for_weight(dense, tmp_path):
    from safetensors.torch import load_file, save_file

    from relax_core.checkpoint.hf_export import export_hf

    ckpt = tmp_path / "ckpt"
    ranks("save", tmp_path, 1, model=str(dense), ckpt=str(ckpt), dtype="bfloat16")
    out = export_hf(ckpt, tmp_path / "hf")
    report = verify(ckpt, out)
    # one bf16 model at a time, as the run trained it (not an fp32 copy of each), and its weights exactly
    assert report["dtype"] == "bfloat16" and report["max_abs_diff"] <= report["atol"], report
    tensors = load_file(out / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][0, 0] = torch.nextafter(tensors[name][0, 0], torch.tensor(1.0, dtype=torch.bfloat16))  # one ulp
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert verify(ckpt, out) == {"error": f"{out}: {name} differs from the checkpoint's"}
