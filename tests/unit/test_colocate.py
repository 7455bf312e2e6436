"""What colocate decides before the GPU path runs: shared GPUs or not, who feeds which engine rank, in which order.

On a node of GPUs with the engines on the trainer ranks' GPUs, the engines
release their memory while the trainer trains and take the weights by
reference from the trainer rank on each of their GPUs (the GPU path itself
needs CUDA and SGLang; its CPU stand-in runs in
tests/integration/test_colocate_ipc.py). Elsewhere nothing changes: weights
are broadcast and the engines keep their memory. The request bodies of that
path carry SGLang's own field names (pinned here from SGLang 0.5.23's
io_struct.py; the CPU engine refuses any other field).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from relax_core.cluster.placement import engines_share_train_gpus, handover_sources
from relax_core.config import load_recipe
from relax_core.controller import colocate

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
FSDP = RECIPES / "math_dapo_qwen3_4b_fsdp.yaml"  # colocate, 1 node of 8 GPUs, engines of TP 2
QUICKSTART = RECIPES / "quickstart.yaml"


@pytest.mark.parametrize("path, overrides, shared", [
    (FSDP, [], True),
    (FSDP, ["cluster.train.nodes=2", "rollout.num_engines=8"], True),
    (FSDP, ["cluster.rollout.nodes=1"], False),  # colocate, but the engines have a node group of their own
    (FSDP, ["mode=fully_async", "cluster.rollout.nodes=1"], False),
    (QUICKSTART, [], False),  # CPU engines
    (QUICKSTART, ["cluster.rollout.nodes=0"], False),  # CPU engines on the train group: gloo broadcast as before
])
def test_engines_share_the_trainer_ranks_gpus_only_in_colocate_on_gpu_nodes(path, overrides, shared):
    assert engines_share_train_gpus(load_recipe(path, overrides)) is shared


def test_each_engine_rank_is_fed_by_the_trainer_rank_on_its_gpu():
    one_node = load_recipe(FSDP)
    assert [handover_sources(one_node, slot) for slot in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    two_nodes = load_recipe(FSDP, ["cluster.train.nodes=2", "rollout.num_engines=8"])
    assert handover_sources(two_nodes, 5) == [10, 11]  # node 1, GPUs 2 and 3
    tp1 = load_recipe(FSDP, ["rollout.gpus_per_engine=1", "rollout.num_engines=8"])
    assert [handover_sources(tp1, slot) for slot in range(8)] == [[r] for r in range(8)]


class _Recorder:
    """A job whose verbs only record the order they were called in."""

    def __init__(self, recipe):
        self.recipe, self.loop, self.calls = recipe, None, []
        self.engines = SimpleNamespace(release_memory=lambda loop, tags=None: self.calls.append(("release", tags)),
                                       resume_memory=lambda loop, tags=None: self.calls.append(("resume", tags)))

    def train(self, samples):
        self.calls.append("train")
        return {}

    def sync_weights(self, step):
        self.calls.append("sync")
        return {}

    def sleep_trainers(self, parts):
        self.calls.append(("offload", parts))

    def wake_trainers(self):
        self.calls.append("reload")


# The trainer ranks' state is on the GPU only between the engines' release and their resume: every byte the
# engines take back (weights, then the KV cache) was handed back by the trainer first.
SHARED_STEP = [("release", None), "reload", "train", ("offload", ["optimizer"]), ("resume", ["weights"]), "sync",
               ("offload", ["model"]), ("resume", ["kv_cache", "cuda_graph"])]


def test_on_shared_gpus_engines_and_trainer_ranks_take_turns_with_the_memory():
    job = _Recorder(load_recipe(FSDP))
    colocate.train_step(job, [])
    colocate.sync_weights(job, 1)
    assert job.calls == SHARED_STEP


def test_a_resumed_run_on_shared_gpus_hands_the_loaded_weights_over_in_the_same_turns():
    job = _Recorder(load_recipe(FSDP))
    colocate.resync(job, 4)
    assert job.calls == [("release", None), "reload", *SHARED_STEP[3:]]


def test_elsewhere_the_engines_keep_their_memory():
    job = _Recorder(load_recipe(QUICKSTART))
    colocate.train_step(job, [])
    colocate.sync_weights(job, 1)
    assert job.calls == ["train", "sync"]


SGLANG_FIELDS = {  # sglang/srt/managers/io_struct.py (0.5.23): field -> default
    "ReleaseMemoryOccupationReqInput": {"tags": None},
    "ResumeMemoryOccupationReqInput": {"tags": None},
    "UpdateWeightsFromTensorReqInput": {"serialized_named_tensors": ..., "load_format": None, "flush_cache": True,
                                        "abort_all_requests": False, "weight_version": None, "selector": "all",
                                        "torch_empty_cache": False},
    "BeginWeightUpdateReqInput": {"selector": "all"},
}


@pytest.mark.parametrize("name", SGLANG_FIELDS)
def test_colocate_request_bodies_have_sglangs_field_names_and_defaults(name):
    from pydantic_core import PydanticUndefined

    from relax_core.rollout.cpu_engine import protocol

    fields = getattr(protocol, name).model_fields
    defaults = {k: ... if f.default is PydanticUndefined else f.default for k, f in fields.items()}
    assert defaults == SGLANG_FIELDS[name]
