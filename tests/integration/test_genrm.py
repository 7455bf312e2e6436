"""`genrm` (LLM-as-judge) against the real CPU engine over HTTP.

The tiny judge has random weights, so what it replies is arbitrary; the test
asks the engine the same prompt directly (greedy, so the reply is the same)
and checks the hub turned that reply into the score `parse_score` gives, or
into a counted error when the reply holds no number.
"""

from __future__ import annotations

import httpx
import pytest
from engine_fixtures import ENGINE_API_KEY

from relax_core.config.reward import DEFAULT_TEMPLATE
from relax_core.rewards.genrm import Judge, parse_score, register_judge
from relax_core.rewards.hub import RewardHub, RewardItem


@pytest.fixture
def judge_url(engine) -> str:
    """The session's engine server (conftest.py) as the judge: a server of the user's own, with its key."""
    return engine.base_url


def _direct_reply(url: str, response: str, label: str, question: str) -> str:
    prompt = DEFAULT_TEMPLATE.format(question=question, response=response, label=label)
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 0.0}}
    headers = {"Authorization": f"Bearer {ENGINE_API_KEY}"}
    return httpx.post(f"{url}/generate", json=body, headers=headers, timeout=60).json()["text"]


def _expected(reply: str) -> float | None:
    try:
        return parse_score(reply)
    except ValueError:
        return None


def test_genrm_asks_the_judge_engine_and_parses_its_reply(judge_url, monkeypatch):
    monkeypatch.setenv("RELAX_GENRM_URL", judge_url)
    monkeypatch.setenv("RELAX_GENRM_API_KEY", ENGINE_API_KEY)
    items = [RewardItem("Paris", "Paris", {"question": "Capital of France?"}),
             RewardItem("42", "41", {"question": "6*7?"})]
    with RewardHub("genrm", timeout_s=60) as hub:
        results = hub.score_sync(items)
    for item, result in zip(items, results):
        expected = _expected(_direct_reply(judge_url, item.response, item.label, item.metadata["question"]))
        if expected is None:
            assert result.status == "error" and "judge reply has no score" in result.error
        else:
            assert result.status == "ok" and result.score == pytest.approx(expected)


def test_a_registered_judge_with_a_dead_server_counts_errors():
    register_judge("dead_judge", Judge("http://127.0.0.1:9"))
    with RewardHub("dead_judge", timeout_s=10) as hub:
        results = hub.score_sync([RewardItem("x", "y")] * 3)
        assert hub.last_stats["reward_errors"] == 3
    assert all(r.score == 0.0 for r in results)


@pytest.mark.parametrize("reply,expected", [
    (" 7", 0.7), ("Score: 9/10", 0.9), ("I'd give it 3/5.", 0.6), ("score=12", 1.0),
    ("The answer is wrong. Score: 0", 0.0), ("8.5 out of 10", 0.85), ("-3", 0.0),
    ("Score: 4. Reasoning: 2 errors", 0.4), ("score: 4/5", 0.8), ("Score: 4. Fixed 2/3 bugs", 0.4),
])
def test_parse_score(reply, expected):
    assert parse_score(reply) == pytest.approx(expected)


def test_parse_score_without_a_number_is_an_error():
    with pytest.raises(ValueError, match="no score"):
        parse_score("The response is quite good.")
