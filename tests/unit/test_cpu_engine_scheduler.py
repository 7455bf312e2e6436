"""The CPU engine's scheduler in-process, with a tiny random model: when it prefills.

Requests of one step reach the engine one HTTP request at a time; an idle
engine takes the whole burst into one prefill instead of decoding the first
request alone while the rest arrive. The burst timings are stretched here so
that a loaded machine cannot make the test flaky.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from relax_core.rollout.cpu_engine import batcher as scheduler
from relax_core.rollout.cpu_engine.batcher import Batcher, Sequence
from relax_core.rollout.cpu_engine.sampling import RowSampling


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax_core.models.tiny import materialize_tiny_model

    model_dir = materialize_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture
def batcher(model_and_tokenizer, one_torch_thread):
    model, tokenizer = model_and_tokenizer
    batcher = Batcher(model, tokenizer, max_running=16, seed=0, original_logprob=False)
    batcher.start()
    yield batcher
    batcher.stop()


def sequences(n: int, done: threading.Semaphore) -> list[Sequence]:
    return [
        Sequence(
            rid=f"r{i}",
            prompt_ids=[5 + i] * (2 + i),
            max_new_tokens=4,
            sampling=RowSampling(1.0, -1, 1.0, 0.0, greedy=False, generator=torch.Generator().manual_seed(i)),
            stop_ids=frozenset(),
            stop_strings=[],
            skip_special_tokens=True,
            on_done=lambda _: done.release(),
        )
        for i in range(n)
    ]


def run(batcher: Batcher, parts: list[list[Sequence]], done: threading.Semaphore, pause_s: float) -> None:
    for i, part in enumerate(parts):
        if i:
            time.sleep(pause_s)
        batcher.submit(part)
    for _ in range(sum(len(p) for p in parts)):
        assert done.acquire(timeout=60)


def test_a_burst_reaching_an_idle_engine_is_prefilled_at_once(batcher, monkeypatch):
    monkeypatch.setattr(scheduler, "BURST_GAP_S", 1.0)
    monkeypatch.setattr(scheduler, "BURST_WAIT_S", 10.0)
    done = threading.Semaphore(0)
    seqs = sequences(6, done)

    run(batcher, [seqs[:1], seqs[1:3], seqs[3:]], done, pause_s=0.1)

    assert batcher.stats.prefill_passes == 1
    assert all(len(s.output_ids) == 4 and s.finish_reason["type"] == "length" for s in seqs)


def test_a_burst_waits_no_longer_than_its_bound(batcher, monkeypatch):
    monkeypatch.setattr(scheduler, "BURST_GAP_S", 1.0)
    monkeypatch.setattr(scheduler, "BURST_WAIT_S", 0.0)
    done = threading.Semaphore(0)
    seqs = sequences(2, done)

    run(batcher, [seqs[:1], seqs[1:]], done, pause_s=0.5)

    # The first request was not held for the second: they were prefilled apart.
    assert batcher.stats.prefill_passes == 2
