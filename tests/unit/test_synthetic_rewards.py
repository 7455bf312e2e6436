"""The quick start's synthetic tasks and the small reward registry."""

from __future__ import annotations

import subprocess
import sys

import pytest

from relax_core.data.synthetic import SyntheticTask
from relax_core.rewards.registry import get_reward, list_rewards, reward


def test_copy_task_items_are_strings_over_the_alphabet():
    task = SyntheticTask("copy", seed=1, alphabet="ab", min_len=2, max_len=4)
    for item in task.next_batch(50):
        assert item["label"] == item["prompt"]
        assert 2 <= len(item["prompt"]) <= 4 and set(item["prompt"]) <= {"a", "b"}
        assert item["metadata"] == {"task": "copy"}


def test_reverse_and_add_labels():
    rev = SyntheticTask("reverse", seed=2).item(0)
    assert rev["label"] == rev["prompt"][::-1]
    add = SyntheticTask("add", seed=3, min_len=1, max_len=2)
    for item in add.next_batch(20):
        a, b = item["prompt"].rstrip("=").split("+")
        assert int(item["label"]) == int(a) + int(b)


def test_stream_is_deterministic_and_resumes_at_the_cursor():
    a = SyntheticTask("copy", seed=7)
    first = a.next_batch(5)
    state = a.state_dict()
    rest = a.next_batch(5)
    b = SyntheticTask("copy", seed=7)
    b.load_state_dict(state)
    assert state == {"cursor": 5}
    assert b.next_batch(5) == rest
    assert SyntheticTask("copy", seed=7).next_batch(5) == first
    assert SyntheticTask("copy", seed=8).next_batch(5) != first


def test_bad_task_settings_say_what_to_change():
    with pytest.raises(ValueError, match="valid: copy, reverse, add"):
        SyntheticTask("sort")
    with pytest.raises(ValueError, match="min_len"):
        SyntheticTask("copy", min_len=3, max_len=2)


def test_builtin_rewards():
    exact, copy = get_reward("exact_match"), get_reward("copy")
    assert exact(" abc\n", "abc", {}) == 1.0 and exact("abd", "abc", {}) == 0.0
    assert copy("abc", "abc", {}) == 1.0
    assert copy("abd", "abc", {}) == pytest.approx(2 / 3)
    assert copy("abcd", "abc", {}) == pytest.approx(
        3 / 4
    )  # an extra character costs like a wrong one
    assert copy("a", "abc", {}) == pytest.approx(1 / 3)
    assert copy("", "ab", {}) == 0.0
    assert {"copy", "exact_match"} <= set(list_rewards())


def test_register_a_reward_and_unknown_names():
    @reward("test_length")
    def length(response, label, metadata):
        return float(len(response))

    assert get_reward("test_length")("abc", None, {}) == 3.0
    with pytest.raises(KeyError, match="registered rewards: .*copy"):
        get_reward("nope")


def test_registry_and_tasks_import_no_torch():
    code = (
        "import sys, relax_core.rewards.registry as r, relax_core.data.synthetic; r.list_rewards(); "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
