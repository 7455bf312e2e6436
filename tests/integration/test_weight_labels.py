"""An engine's weight version label means it holds every weight of that version.

Trainer rank 0 (`TrainerWorker`, here in this process: one rank, the torch backend on the tiny model)
and real CPU engines over gloo, in many buckets. Two ways the label could lie:

- after a resume in the asynchronous modes the engines get the loaded weights as version k while later
  steps train on: an engine that joins (or replaces one) before the next sync must get version k under
  the label k, not the weights trained since;
- a broadcast that fails half-way (an engine dies) leaves the others with some buckets of the new version
  under their old label: once the dead engine is left out (not replaced), they get that version whole,
  and only then its label.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from engine_fixtures import EngineServer

# The trainer rank in this process imports Ray, which reads its auth settings once per process: the session's
# cluster (conftest.py) must have set them first, or a later test could not start it.
pytestmark = pytest.mark.usefixtures("local_ray")
API_KEY = "labels-key"
BUCKET_BYTES = 16 << 10  # the tiny model is ~190 KiB: many buckets
PROMPT = [5, 6, 7, 8]


@pytest.fixture
def servers(tiny_model_dir, tmp_path):
    """Start CPU engines on the tiny model: `servers(n)`; all stopped afterwards."""
    started = []

    def start(count: int) -> list[EngineServer]:
        new = [EngineServer(tiny_model_dir, tmp_path / f"engine{len(started) + i}.log", API_KEY).start()
               for i in range(count)]
        started.extend(new)
        for server in new:
            server.wait_healthy()
        return new

    yield start
    for server in started:
        server.stop()


def rank0(model_dir: Path, overlap: bool, urls: list[str]):
    from relax_core.config.loader import load_recipe
    from relax_core.controller.workers import RankSetup, TrainerWorker
    from relax_core.train.settings import trainer_config

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml", [])
    worker = TrainerWorker(0, 1)
    worker.setup("", RankSetup(str(model_dir), trainer_config(recipe), threads=1, overlap=overlap))
    worker.connect_engines(urls, API_KEY, BUCKET_BYTES, 1, "gloo")
    return worker


def weights(worker) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in worker.trainer.named_parameters_for_sync()}


def train(worker, seed: int) -> None:
    """What an optimizer step does to the live weights: every one moves, in place."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in worker.trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05)


def engine_answer(url: str) -> tuple[str, list[int], list[float]]:
    """The engine's label, and its greedy tokens with their log-probs."""
    from relax_core.rollout.client import EngineClient, parse_generate_output

    async def ask():
        async with EngineClient(url, api_key=API_KEY) as client:
            raw = await client.generate(PROMPT, sampling_params={"max_new_tokens": 16, "temperature": 0,
                                                                 "ignore_eos": True}, return_logprob=True)
            return await client.get_weight_version(), parse_generate_output(raw)

    label, out = asyncio.run(ask())
    return label, out.output_ids, out.logprobs


def distance(model_dir: Path, named: dict[str, torch.Tensor], url: str) -> tuple[str, float]:
    """The engine's label, and how far its log-probs are from those of a model holding `named`."""
    from transformers import AutoModelForCausalLM

    label, tokens, logprobs = engine_answer(url)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.load_state_dict(named, strict=False)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([PROMPT + tokens])).logits[0], dim=-1)
    ours = [logp[len(PROMPT) + t - 1, tok].item() for t, tok in enumerate(tokens)]
    return label, max(abs(a - b) for a, b in zip(logprobs, ours))


def test_after_a_resume_an_engine_that_joins_gets_the_resumed_version_not_the_weights_trained_since(
        tiny_model_dir, servers, one_torch_thread):
    first, = servers(1)
    worker = rank0(tiny_model_dir, overlap=True, urls=[first.base_url])
    try:
        train(worker, seed=1)  # the checkpoint's weights differ from the model directory's
        resumed = weights(worker)
        worker.sync_weights(5)  # Job.resume's resync: the loaded weights as version 5
        train(worker, seed=2)  # step 6 trains; its snapshot is not sent yet
        trained = weights(worker)
        joining, = servers(1)
        worker.set_engines([first.base_url, joining.base_url], resend=True)  # EngineSet.join
        for url in (first.base_url, joining.base_url):
            label, off = distance(tiny_model_dir, resumed, url)
            assert label == "5" and off < 1e-4, (url, label, off)
            assert distance(tiny_model_dir, trained, url)[1] > 1e-3
    finally:
        worker.close()


def test_engines_left_after_a_failed_broadcast_get_its_version_whole_before_its_label(
        tiny_model_dir, servers, one_torch_thread):
    survivor, dying = servers(2)
    worker = rank0(tiny_model_dir, overlap=False, urls=[survivor.base_url, dying.base_url])
    try:
        train(worker, seed=3)
        new = weights(worker)
        live = worker._live_weights

        def dies_half_way():
            """The second engine dies between two buckets, and the broadcast fails there: between buckets,
            so that no engine waits in a collective that was given up (gloo cannot end that receive)."""
            for i, named in enumerate(live()):
                if i == 6:
                    dying.proc.kill()
                    dying.proc.wait()
                    raise ConnectionError(f"engine {dying.base_url} died")
                yield named

        worker._live_weights = dies_half_way
        with pytest.raises(ConnectionError):
            worker.sync_weights(7)  # colocate's sync: the live weights as version 7
        worker._live_weights = live
        label, off = distance(tiny_model_dir, new, survivor.base_url)
        assert label != "7" and off > 1e-3  # some buckets of it: not labelled with it
        worker.set_engines([survivor.base_url], resend=False)  # recovery leaves it out: EngineSet.remove
        label, off = distance(tiny_model_dir, new, survivor.base_url)
        assert label == "7" and off < 1e-4
        assert worker.broadcaster.partial is None
    finally:
        worker.close()
