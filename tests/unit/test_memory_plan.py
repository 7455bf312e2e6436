"""The memory plan (relax_core/launch/memory.py): the model's size counted from its config as transformers
builds it, the plan each recipe knob moves, and a recipe that cannot fit refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from relax_runs import relax

from relax_core.config import load_recipe
from relax_core.launch.memory import GIB, memory_lines, memory_problems, shape_of, tokens_per_micro_batch, trainer_plan

REPO = Path(__file__).resolve().parents[2]
MEGATRON = REPO / "recipes" / "math_dapo_qwen3_4b.yaml"
FSDP = REPO / "recipes" / "math_dapo_qwen3_4b_fsdp.yaml"
# Qwen3-4B's config.json (the sizes the estimate reads)
QWEN3_4B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560,
            "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 40960}


@pytest.fixture
def qwen3_4b(tmp_path) -> Path:
    folder = tmp_path / "qwen3-4b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_4B))
    return folder


def plan(recipe_file: Path, folder: Path, *overrides: str) -> dict[str, float]:
    recipe = load_recipe(recipe_file, [f"model.path={folder}", *overrides])
    return {item.name: item.bytes / GIB for item in trainer_plan(recipe, shape_of(QWEN3_4B))}


@pytest.mark.parametrize("tied", [True, False])
def test_the_parameter_count_is_that_of_the_model_transformers_builds(tied):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = {"hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 97, "tie_word_embeddings": tied}
    model = Qwen3ForCausalLM(Qwen3Config(**config))
    assert shape_of(config).params == sum(p.numel() for p in model.parameters())


def test_a_moe_models_count_has_every_expert_and_its_activations_the_routed_ones():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = {"hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 24, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 61, "num_experts": 6,
              "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": []}
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config))
    shape = shape_of(config)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.mlp == 2 * 24


def test_each_training_knob_moves_the_plan(qwen3_4b):
    base = plan(FSDP, qwen3_4b, "train.recompute_activations=false")
    recompute = plan(FSDP, qwen3_4b, "train.recompute_activations=true")
    assert recompute["activations"] < base["activations"] / 5
    unsharded = plan(FSDP, qwen3_4b, "train.fsdp=false")
    assert unsharded["optimizer"] == pytest.approx(8 * base["optimizer"])  # 8 ranks shard it
    budget = plan(FSDP, qwen3_4b, "train.max_tokens_per_gpu=20480", "train.recompute_activations=false")
    assert budget["activations"] == pytest.approx(2 * base["activations"], rel=0.01)
    tp4 = plan(MEGATRON, qwen3_4b, "train.tensor_parallel=4")
    tp2 = plan(MEGATRON, qwen3_4b)
    assert tp4["weights"] == pytest.approx(tp2["weights"] / 2)
    no_dist = plan(MEGATRON, qwen3_4b, "train.distributed_optimizer=false")
    assert no_dist["optimizer"] == pytest.approx(4 * tp2["optimizer"])  # 4 data-parallel ranks
    one = plan(MEGATRON, qwen3_4b, "train.micro_batch_size=1")
    four = plan(MEGATRON, qwen3_4b, "train.micro_batch_size=4")
    assert "logits" not in four  # made a chunk at a time inside the output layer, never [tokens x V/TP]
    assert one["loss head"] == four["loss head"] > tp4["loss head"]  # chunks of tokens; the weight's share / TP
    assert tp4["loss head"] < tp2["loss head"] < 1.5  # GiB
    assert "attention" not in tp2  # SDPA, sample by sample: no [L x L] scores (train/megatron/attention.py)
    padded_tokens = tokens_per_micro_batch(load_recipe(MEGATRON, [f"model.path={qwen3_4b}"]))
    packed = plan(MEGATRON, qwen3_4b, f"train.max_tokens_per_gpu={2 * padded_tokens}")
    assert packed["activations"] == pytest.approx(2 * tp2["activations"], rel=0.01)  # the budget reaches megatron


@pytest.mark.parametrize("recipe_file", [MEGATRON, FSDP])
def test_the_shipped_qwen3_4b_recipes_fit_an_80_gb_gpu(qwen3_4b, recipe_file):
    recipe = load_recipe(recipe_file, [f"model.path={qwen3_4b}", "cluster.train.gpu_memory_gib=80"])
    assert memory_problems(recipe) == [], memory_lines(recipe)


def test_the_chunked_heads_plan_stays_flat_as_responses_grow(qwen3_4b):
    short = plan(FSDP, qwen3_4b, "rollout.max_new_tokens=2048", "train.max_tokens_per_gpu=4096")
    long = plan(FSDP, qwen3_4b, "rollout.max_new_tokens=16384", "train.max_tokens_per_gpu=18432")
    assert long["loss head"] < 1.2 * short["loss head"] < 1.0  # GiB: the float32 chunk, not tokens x vocab


def test_the_gpus_memory_comes_from_the_field_or_the_gpu_type(qwen3_4b):
    fits = load_recipe(FSDP, [f"model.path={qwen3_4b}", "cluster.train.gpu_type=h100"])
    assert memory_problems(fits) == [] and "of 80 GiB: fits" in memory_lines(fits)[0]
    small = load_recipe(FSDP, [f"model.path={qwen3_4b}", "cluster.train.gpu_type=h100",
                               "cluster.train.gpu_memory_gib=16"])
    assert "of 16 GiB: DOES NOT FIT" in memory_lines(small)[0]
    assert memory_problems(small)[0].startswith("cluster.train: one trainer rank needs about")
    unknown = load_recipe(FSDP, [f"model.path={qwen3_4b}"])
    assert memory_problems(unknown) == [] and "set cluster.train.gpu_memory_gib" in memory_lines(unknown)[0]


def test_an_engine_whose_weights_leave_no_kv_cache_is_refused(qwen3_4b):
    recipe = load_recipe(FSDP, [f"model.path={qwen3_4b}", "cluster.train.gpu_memory_gib=12",
                                "rollout.gpus_per_engine=1", "rollout.num_engines=8",
                                "rollout.engine_args.mem_fraction_static=0.5", "train.max_tokens_per_gpu=2048",
                                "rollout.max_new_tokens=1024", "rollout.max_prompt_len=512"])
    problems = memory_problems(recipe)
    assert any(p.startswith("rollout.gpus_per_engine: each engine GPU would hold 7.5 GiB") for p in problems)


def test_validate_and_a_dry_run_refuse_a_recipe_that_cannot_fit_and_write_nothing(qwen3_4b, tmp_path):
    args = [f"model.path={qwen3_4b}", "cluster.train.gpu_memory_gib=40", "train.recompute_activations=false",
            f"logging.run_root={tmp_path / 'runs'}"]
    proc = relax("validate", str(FSDP), *args)
    assert proc.returncode == 2, proc.stderr
    assert "one trainer rank needs about" in proc.stderr and "of 40 GiB: DOES NOT FIT" in proc.stderr
    assert "set train.recompute_activations: true, or a smaller train.max_tokens_per_gpu" in proc.stderr
    assert "activations" in proc.stderr and "36 layers x 10.2k tokens" in proc.stderr  # the arithmetic
    proc = relax("submit", str(FSDP), *args, "--dry-run", "--executor", "slurm")
    assert proc.returncode == 2 and "DOES NOT FIT" in proc.stderr
    assert not (tmp_path / "runs").exists()
    proc = relax("validate", str(FSDP), *args[:-2], "cluster.train.gpu_memory_gib=80")
    assert proc.returncode == 0 and "of 80 GiB: fits" in proc.stderr


def test_a_cpu_run_has_no_memory_plan():
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", [])
    assert memory_lines(recipe) == [] and memory_problems(recipe) == []


def test_rank_0_sends_from_host_memory_a_bucket_at_a_time_to_engines_on_gpus_of_their_own(qwen3_4b):
    shared = plan(FSDP, qwen3_4b)  # colocate: the engines take the weights by reference, shard by shard
    apart = plan(FSDP, qwen3_4b, "mode=fully_async", "cluster.rollout.nodes=1", "cluster.rollout.gpus_per_node=8")
    small = plan(FSDP, qwen3_4b, "mode=fully_async", "cluster.rollout.nodes=1", "cluster.rollout.gpus_per_node=8",
                 "train.weight_sync_bucket_mb=128")
    assert "sync bucket" not in shared
    assert apart["sync bucket"] == pytest.approx(2 * 512 / 1024)  # GiB: the bucket and its flattened copy
    assert small["sync bucket"] == pytest.approx(2 * 128 / 1024)
