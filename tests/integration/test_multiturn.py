"""Multi-turn trajectories on a real engine, trained by the real trainer.

What a researcher doing agentic RL relies on:
- a trajectory is one token sequence in which the environment's tokens carry loss mask 0 and get exactly zero
  gradient, while every model turn's tokens get gradient;
- after a weight sync the engine's log-probs of the model's tokens, in every turn, are the trainer's (1e-4),
  so the off-policy corrections compare like with like;
- the token budget and the turn limits hold.

The CPU engine is a real server (HTTP, SGLang's API) on a tiny random Qwen3; the trainer is `TorchTrainer` in
this process; the weights go to the engine over gloo with `WeightBroadcaster`, as in a run.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from engine_fixtures import EngineServer

from relax_core.config.rollout import EnvConfig
from relax_core.models.tiny import materialize_tiny_model
from relax_core.models.tokenizer import load_tokenizer
from relax_core.rewards.hub import RewardHub
from relax_core.rollout.chat_turns import ChatTurns
from relax_core.rollout.client import EngineClient
from relax_core.rollout.manager import RolloutManager, SamplingConfig
from relax_core.rollout.multiturn import EnvEpisodes
from relax_core.train.config import TorchTrainerConfig
from relax_core.train.torch_backend import TorchTrainer
from relax_core.weights.sync import WeightBroadcaster

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEY = "multiturn-key"
ENV = '''
from relax_core.rollout.envs import Environment

class Counter(Environment):
    """Answers every turn with the turn number's letters; never done (the turn limit ends it)."""
    def __init__(self, answer="ab"):
        self.answer, self.turns = answer, 0
    def reset(self, sample):
        self.turns = 0
        return sample["prompt"]
    def step(self, response):
        self.turns += 1
        return self.answer * self.turns, 0.25, False, {"seen": len(response)}
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multiturn")
    model_dir = materialize_tiny_model(tmp / "model", alphabet="abcd=?", seed=0)
    (tmp / "counter.py").write_text(ENV)
    engine = EngineServer(model_dir, tmp / "engine.log", KEY).start()
    try:
        engine.wait_healthy()
        yield tmp, model_dir, engine
    finally:
        engine.stop()


def manager_for(model_dir: Path, engine, env: EnvConfig, n: int = 2, max_new_tokens: int = 64) -> RolloutManager:
    tokenizer = load_tokenizer(model_dir)
    episodes = EnvEpisodes(env, ChatTurns(tokenizer), max_new_tokens, max_prompt_len=64)
    sampling = SamplingConfig(n_samples_per_prompt=n, max_new_tokens=max_new_tokens, max_prompt_len=64, seed=0)
    return RolloutManager([EngineClient(engine.base_url, api_key=KEY)], tokenizer, sampling,
                          RewardHub.from_function(lambda text, label, meta: 0.0), agentic=episodes)


def spans(mask: list[int]) -> list[tuple[int, int]]:
    """(value, length) runs of a loss mask."""
    runs: list[tuple[int, int]] = []
    for m in mask:
        runs = runs[:-1] + [(m, runs[-1][1] + 1)] if runs and runs[-1][0] == m else runs + [(m, 1)]
    return runs


def test_environment_tokens_get_no_gradient_and_engine_logprobs_match_the_trainer_after_a_sync(setup):
    tmp, model_dir, engine = setup
    env = EnvConfig(path=str(tmp / "counter.py"), name="Counter", max_turns=3, max_tokens_per_turn=4)
    manager = manager_for(model_dir, engine, env)
    rows = [{"prompt": p, "label": p, "metadata": {}} for p in ("ab", "cd", "da")]
    loop = asyncio.new_event_loop()
    tokenizer = manager.tokenizer
    try:
        samples = loop.run_until_complete(manager.generate(rows, step=1))
        assert len(samples) == 6
        chat = ChatTurns(tokenizer)
        for s in samples:
            runs = spans(s.loss_mask)
            model_runs = [length for value, length in runs if value == 1]
            assert len(model_runs) == 3 and all(1 <= r <= 4 for r in model_runs), runs  # 3 turns of <= 4 tokens
            assert [v for v, _ in runs] == [1, 0, 1, 0, 1]
            assert s.reward == pytest.approx(0.75)  # 3 steps x 0.25, summed
            assert s.metadata["turns"] == 3
            # The environment's tokens are what the chat template writes for its answers: decode them.
            start = runs[0][1]
            env_ids = s.response_ids[start:start + runs[1][1]]
            turn_end = s.response_ids[start - 1]
            assert env_ids == chat.observation_ids([{"role": "user", "content": "ab"}],
                                                   closed=chat.closes_turn(turn_end))
            assert "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n" in tokenizer.decode(env_ids)
            assert all(lp == 0.0 for lp, m in zip(s.rollout_logprobs, s.loss_mask) if m == 0)
        assert manager.last_reward_stats["turns_mean"] == 3.0

        # One optimizer step on these trajectories; capture d loss / d log-prob of every response token.
        trainer = TorchTrainer(model_dir, TorchTrainerConfig(lr=1e-2, micro_batch_size=1, grad_clip=1.0))
        captured = []
        loss_from = trainer.loss_from

        def spy(logp, entropy, micro, mini):
            logp.retain_grad()
            captured.append(logp)
            return loss_from(logp, entropy, micro, mini)

        trainer.loss_from = spy
        trainer.train_step(samples, advantages=[1.0, -1.0] * 3)
        assert len(captured) == len(samples)  # micro_batch_size 1: one row each, in order
        for s, logp in zip(samples, captured):
            grad = logp.grad[0, :s.response_len]
            mask = torch.tensor(s.loss_mask, dtype=torch.bool)
            assert torch.all(grad[~mask] == 0.0), "an environment token got gradient"
            assert torch.all(grad[mask] != 0.0), "a model token in some turn got no gradient"

        # The new weights to the engine over gloo, as a run syncs them; then roll out with them.
        client = EngineClient(engine.base_url, api_key=KEY)
        sync = WeightBroadcaster([client], "127.0.0.1", backend="gloo", bucket_bytes=64 << 10)

        async def push():
            await sync.init()
            await sync.broadcast(trainer.named_parameters_for_sync(), version=1)
            await sync.close()
            await client.aclose()

        loop.run_until_complete(push())
        after = loop.run_until_complete(manager.generate(rows, step=2))
        assert {s.policy_version for s in after} == {1}
        recomputed = trainer.compute_logprobs(after)
        worst = 0.0
        for s, lps in zip(after, recomputed):
            for engine_lp, trainer_lp, m in zip(s.rollout_logprobs, lps, s.loss_mask):
                if m:
                    worst = max(worst, abs(engine_lp - trainer_lp))
        print(f"largest |engine - trainer| log-prob over the model's tokens of {len(after)} trajectories: {worst:.2e}")
        assert worst < 1e-4
        before = trainer.compute_logprobs(after[:1])
        assert before == recomputed[:1]
    finally:
        manager.close(loop)
        loop.close()


def test_the_token_budget_and_the_turn_limits_end_a_trajectory(setup):
    tmp, model_dir, engine = setup
    rows = [{"prompt": "ab", "label": "ab", "metadata": {}}]
    loop = asyncio.new_event_loop()
    try:
        # max_turns: 1 turn, no environment token at all.
        one = manager_for(model_dir, engine, EnvConfig(path=str(tmp / "counter.py"), name="Counter", max_turns=1,
                                                       max_tokens_per_turn=3))
        samples = loop.run_until_complete(one.generate(rows, step=1))
        assert all(set(s.loss_mask) == {1} and s.response_len <= 3 for s in samples)
        one.close(loop)
        # max_tokens_per_turn caps each turn; the env's args reach its constructor ("abc" per answer turn).
        capped = manager_for(model_dir, engine, EnvConfig(path=str(tmp / "counter.py"), name="Counter", max_turns=2,
                                                          max_tokens_per_turn=1, args={"answer": "abc"}))
        samples = loop.run_until_complete(capped.generate(rows, step=1))
        for s in samples:
            assert [length for value, length in spans(s.loss_mask) if value == 1] == [1, 1]
            assert "<|im_start|>user\nabc<|im_end|>" in capped.tokenizer.decode(s.response_ids)
        capped.close(loop)
        # The budget covers the environment's tokens too: 20 tokens leave no room for an answer of ~17.
        tight = manager_for(model_dir, engine, EnvConfig(path=str(tmp / "counter.py"), name="Counter", max_turns=4,
                                                         max_tokens_per_turn=4), max_new_tokens=20)
        samples = loop.run_until_complete(tight.generate(rows, step=1))
        for s in samples:
            assert s.response_len <= 20 and s.finish_reason == "length"
            assert s.metadata["turns"] == 1  # the answer would not fit: the trajectory ends after turn 1
        tight.close(loop)
    finally:
        loop.close()


AGENT = '''
import json, os, subprocess, sys
from openai import OpenAI

task = json.load(open(os.environ["RELAX_TASK_FILE"]))
here = os.path.dirname(os.path.abspath(__file__))
try:  # the first program to get here hangs (with a child of its own); the test expects it killed
    fd = os.open(os.path.join(here, "hang.lock"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    child = subprocess.Popen(["sleep", "1000"])
    os.write(fd, f"{os.getpid()} {child.pid}".encode())
    os.close(fd)
    child.wait()
except FileExistsError:
    pass
client = OpenAI(max_retries=0, timeout=60)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
messages = [{"role": "user", "content": task["prompt"]}]
first = client.chat.completions.create(model="policy", messages=messages, max_tokens=3, temperature=0.0)
messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "cab"}]
second = client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
if task["metadata"].get("rewrite"):  # a program that rewrites its history: a second segment
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "dd"}], max_tokens=2)
with open(os.environ["RELAX_REWARD_FILE"], "w") as out:
    out.write(str(0.5 + 0.5 * (second.choices[0].finish_reason == "length")))
'''


def gone(pid: int, within_s: float = 10.0) -> bool:
    """True once `pid` has ended (a zombie that nobody reaped counts: it runs nothing). A killed process with
    much memory takes a moment to exit."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if "(zombie)" in Path(f"/proc/{pid}/status").read_text():
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_agent_programs_calls_are_recorded_with_masks_and_a_hung_one_is_killed(setup):
    from relax_core.config.rollout import AgentConfig
    from relax_core.rollout.agent_app import AgentPrograms

    tmp, model_dir, engine = setup
    folder = tmp / "agent"
    folder.mkdir()
    (folder / "agent.py").write_text(AGENT)
    tokenizer = load_tokenizer(model_dir)
    programs = AgentPrograms(AgentConfig(command=f"{sys.executable} agent.py", cwd=str(folder), timeout_s=15),
                             ChatTurns(tokenizer), max_new_tokens=48, max_prompt_len=64)
    sampling = SamplingConfig(n_samples_per_prompt=2, max_new_tokens=48, max_prompt_len=64, seed=0)
    manager = RolloutManager([EngineClient(engine.base_url, api_key=KEY)], tokenizer, sampling,
                             RewardHub.from_function(lambda text, label, meta: 0.0), agentic=programs)
    rows = [{"prompt": "ab", "label": "ab", "metadata": {}},
            {"prompt": "cd", "label": "cd", "metadata": {"rewrite": 1}}]
    loop = asyncio.new_event_loop()
    try:
        samples = loop.run_until_complete(manager.generate(rows, step=1))
        stats = manager.last_reward_stats
        # One endpoint serves every trajectory of the process, however many started at once.
        assert sum(t.name == "relax-agent-endpoint" for t in threading.enumerate()) == 1
        pids = [int(p) for p in (folder / "hang.lock").read_text().split()]
        for pid in pids:  # the hung program and its child: killed with their process group (SIGKILL)
            assert gone(pid), f"process {pid} outlived its program's time limit"
        assert stats["agent/timeouts"] == 1.0 and stats["agent/failures"] == 0.0
        # 4 programs: the hung one (no call: one masked placeholder sample, reward 0), 3 that ran.
        hung = [s for s in samples if set(s.loss_mask) == {0}]
        assert len(hung) == 1 and hung[0].reward == 0.0 and hung[0].response_len == 1
        ran = [s for s in samples if s is not hung[0]]
        two_calls = [s for s in ran if [v for v, _ in spans(s.loss_mask)] == [1, 0, 1]]
        rewritten = [s for s in ran if [v for v, _ in spans(s.loss_mask)] == [1]]
        assert len(two_calls) == 3  # every program that ran made its two calls as one sequence
        for s in two_calls:
            runs = spans(s.loss_mask)
            assert runs[0][1] <= 3 and runs[2][1] <= 2  # max_tokens of each call
            env_text = tokenizer.decode(s.response_ids[runs[0][1]:runs[0][1] + runs[1][1]])
            assert env_text.endswith("<|im_start|>user\ncab<|im_end|>\n<|im_start|>assistant\n")
            assert s.reward in (0.5, 1.0)
        by_group: dict[int, list] = {}
        for s in samples:
            by_group.setdefault(s.group_id % 1_000_000, []).append(s)
        hung_row = hung[0].group_id % 1_000_000
        # The rewriting row's programs give 2 segments each, the other row's 1; the hung program gives 1.
        assert len(rewritten) == (1 if hung_row == 1 else 2)
        assert [len(by_group[0]), len(by_group[1])] == ([2, 4] if hung_row == 0 else [2, 3])
        assert len({s.sample_id for s in samples}) == len(samples)
    finally:
        manager.close(loop)
        loop.close()


def test_the_agent_endpoint_refuses_unknown_keys_and_serves_only_loopback(setup):
    import httpx

    from relax_core.rollout.agent_app import Endpoint

    endpoint = Endpoint()
    try:
        assert endpoint.url.startswith("http://127.0.0.1:")
        answer = httpx.post(endpoint.url + "/chat/completions", json={"messages": [{"role": "user", "content": "a"}]},
                            headers={"Authorization": "Bearer guessed"})
        assert answer.status_code == 401 and "unknown API key" in answer.json()["error"]["message"]
        assert httpx.get(endpoint.url + "/models").status_code == 401
    finally:
        endpoint.stop()
