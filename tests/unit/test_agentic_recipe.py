"""`rollout.env` and `rollout.agent` in a recipe: what is refused before anything starts (exit 2, the field
named, nothing written), and how their paths are read (next to the recipe).

And the chat rendering multi-turn rollouts rely on: the tokens of a conversation grown turn by turn equal the
chat template's rendering of the whole conversation, also for a template that renders the last assistant turn
differently from earlier ones (Qwen3's thinking block).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from relax_core.config import load_recipe

REPO = Path(__file__).resolve().parents[2]
AGENT_QS = yaml.safe_load((REPO / "recipes" / "quickstart_agent.yaml").read_text())
ENV = "from relax_core.rollout.envs import Environment\n\nclass Game(Environment):\n" \
      "    def __init__(self, size=2):\n        self.size = size\n" \
      "    def step(self, response):\n        return None, 1.0, True, {}\n"


def validate(tmp_path: Path, recipe: dict, *overrides: str) -> subprocess.CompletedProcess:
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    env = os.environ | {"COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "relax_cli.main", "validate", "r.yaml", *overrides], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=120)


def with_env(**env) -> dict:
    recipe = yaml.safe_load(yaml.safe_dump(AGENT_QS))
    recipe["rollout"]["env"] = {"path": "game.py", "name": "Game", "max_turns": 2} | env
    return recipe


def test_paths_are_read_next_to_the_recipe(tmp_path):
    (tmp_path / "game.py").write_text(ENV)
    (tmp_path / "tools.py").write_text("def add(a: int, b: int):\n    return a + b\n")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(with_env()))
    assert load_recipe(tmp_path / "r.yaml").rollout.env.path == str(tmp_path / "game.py")
    recipe = with_env(path=None, name="tools", args={"tools": "tools.py"})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert load_recipe(tmp_path / "r.yaml").rollout.env.args["tools"] == str(tmp_path / "tools.py")
    recipe = yaml.safe_load(yaml.safe_dump(AGENT_QS))
    recipe["rollout"].pop("env")
    recipe["rollout"]["agent"] = {"command": "python a.py"}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert load_recipe(tmp_path / "r.yaml").rollout.agent.cwd == str(tmp_path)  # unset: the recipe's folder
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(with_env()))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run([sys.executable, "-m", "relax_cli.main", "validate", str(tmp_path / "r.yaml")], cwd=elsewhere,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr  # game.py is found next to the recipe, not in the working folder

@pytest.mark.parametrize("change, expected", [
    ({"path": "missing.py"}, "missing.py: no such file"),
    ({"name": "Nope"}, "defines no 'Nope' (its environments: Game)"),
    ({"args": {"colour": "red"}}, "rollout.env.args: Game(colour) does not match its constructor"),
    ({"path": None, "name": "chess"}, "rollout.env.name: no built-in environment 'chess' (built-in: tools)"),
    ({"path": "broken.py"}, "broken.py:2 failed to import: NameError"),
    ({"max_turns": 0}, "max_turns"),
])
def test_an_environment_that_cannot_be_used_is_refused_naming_the_field(tmp_path, change, expected):
    (tmp_path / "game.py").write_text(ENV)
    (tmp_path / "broken.py").write_text("x = 1\ny = undefined_name\n")
    done = validate(tmp_path, with_env(**change))
    assert done.returncode == 2, done.stdout + done.stderr
    assert expected in done.stderr
    if change.get("path") == "missing.py":
        assert "rollout.env.path: environment file" in done.stderr


def test_env_and_agent_together_media_and_an_agent_without_a_chat_template_are_refused(tmp_path):
    (tmp_path / "game.py").write_text(ENV)
    both = with_env()
    both["rollout"]["agent"] = {"command": "true"}
    done = validate(tmp_path, both)
    assert done.returncode == 2 and "env and agent both drive the turns of a trajectory" in done.stderr
    media = with_env()
    media["model"]["architecture"] = "qwen3_vl"
    media["data"] = {"source": "synthetic", "task": "colours"}
    done = validate(tmp_path, media)
    assert done.returncode == 2 and "rollout.env: multi-turn rollouts with images, video or audio" in done.stderr
    agent = yaml.safe_load(yaml.safe_dump(AGENT_QS))
    agent["rollout"].pop("env")
    agent["rollout"]["agent"] = {"command": "true", "cwd": "nowhere"}
    done = validate(tmp_path, agent)
    assert done.returncode == 2 and "rollout.agent.cwd: folder" in done.stderr
    assert "nowhere' does not exist" in done.stderr
    agent["rollout"]["agent"] = {"command": "true"}
    agent["data"]["apply_chat_template"] = False
    done = validate(tmp_path, agent)
    assert done.returncode == 2 and "data.apply_chat_template: an agent program sends chat messages" in done.stderr
    assert not (tmp_path / "runs").exists()  # nothing written


QWEN3_LIKE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and loop.last %}"
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.parametrize("template", ["tiny", "qwen3_like"])
def test_a_conversation_grown_turn_by_turn_is_the_templates_rendering_of_it(tmp_path, template):
    from relax_core.models.tiny import materialize_tiny_model
    from relax_core.models.tokenizer import load_tokenizer
    from relax_core.rollout.chat_turns import ChatTurns

    tokenizer = load_tokenizer(materialize_tiny_model(tmp_path / "m", alphabet="abcd<>/ hkol"))
    if template == "qwen3_like":
        tokenizer.chat_template = QWEN3_LIKE
    chat = ChatTurns(tokenizer)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    end = encode("<|im_end|>")[0]
    ids = chat.prompt_ids("ab")
    conversation = [{"role": "user", "content": "ab"}]
    for turn, (said, closed) in enumerate([("cd", True), ("dd", False), ("a", True)]):
        model = encode(said) + ([end] if closed else [])
        ids += model
        conversation.append({"role": "assistant", "content": said})
        answer = [{"role": "tool" if turn % 2 else "user", "content": "b" * (turn + 1)}]
        ids += chat.observation_ids(answer, closed=closed)
        conversation += answer
        # Earlier assistant turns render without the thinking block in the full conversation, as here.
        whole = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        assert tokenizer.decode(ids) == whole
