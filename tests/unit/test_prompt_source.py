"""`RowSource`: the documented epoch order, exact resumes, and which column routes rewards.

The reference order is written here from the contract in the class docstring
(`range(n)` shuffled by `random.Random(f"{seed}:{epoch}")`), not taken from
the code under test.
"""

from __future__ import annotations

import json
import random

import pytest

from relax_core.config.data import FileData
from relax_core.data.prompts import RowSource, build_prompt_source
from relax_core.errors import UserError
from relax_core.rewards.hub import check_routes


def source(rows, **fields) -> RowSource:
    return RowSource(rows, FileData(path="mem.jsonl", **fields))


def numbered(n: int) -> list[dict]:
    return [{"prompt": f"p{i}", "label": str(i)} for i in range(n)]


def reference_labels(n: int, seed: int, epochs: int) -> list[str]:
    labels = []
    for epoch in range(epochs):
        order = list(range(n))
        random.Random(f"{seed}:{epoch}").shuffle(order)
        labels += [str(i) for i in order]
    return labels


def test_rows_follow_the_documented_epoch_permutation():
    rows = source(numbered(50), seed=7)
    served = [item["label"] for _ in range(13) for item in rows.next_batch(10)]  # 130 rows: 2.6 epochs
    assert served == reference_labels(50, seed=7, epochs=3)[:130]
    assert sorted(served[:50]) == sorted(str(i) for i in range(50))  # each epoch serves every row once


def test_no_shuffle_serves_the_file_order():
    rows = source(numbered(5), shuffle=False)
    assert [item["label"] for item in rows.next_batch(7)] == ["0", "1", "2", "3", "4", "0", "1"]


@pytest.mark.parametrize("cursor", [0, 1, 37, 49, 50, 51, 99, 123])
def test_resume_at_any_cursor_gives_the_same_following_rows(cursor):
    first = source(numbered(50), seed=3)
    first.next_batch(cursor)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    expected = first.next_batch(40)
    resumed = source(numbered(50), seed=3)
    resumed.next_batch(5)  # a source that already cached another epoch's order
    resumed.load_state_dict(state)
    assert resumed.next_batch(40) == expected
    assert [item["label"] for item in expected] == reference_labels(50, 3, 4)[cursor:cursor + 40]


def test_a_column_called_reward_is_data_not_a_route():
    rows = source([{"prompt": "p", "label": "l", "reward": 0.7}])
    item = rows.next_batch(1)[0]
    assert item["reward"] is None                 # the recipe's reward scores it
    assert item["metadata"] == {"reward": 0.7}    # and the column stays available to the reward
    assert rows.reward_names() == set()


def test_the_reward_key_column_routes_each_row(tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [{"prompt": "2+2?", "label": "4", "task": {"reward": "math"}},
             {"prompt": "Pick one", "label": "B", "task": {"reward": "multiple_choice"}, "reward": 3}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    rows = build_prompt_source(FileData(path=str(path), reward_key="task.reward", shuffle=False))
    assert [item["reward"] for item in rows.next_batch(2)] == ["math", "multiple_choice"]
    assert rows.reward_names() == {"math", "multiple_choice"}
    check_routes(rows.reward_names(), "task.reward")  # both exist: no error


def test_an_unknown_reward_in_the_routing_column_stops_the_start():
    rows = source([{"prompt": "p", "label": "l", "task": name} for name in ("math", "maths", "mc", None)],
                  reward_key="task")
    with pytest.raises(UserError, match=r"data.reward_key: column 'task' names rewards that do not exist: "
                                        r"'maths', 'mc' \(available: .*multiple_choice"):
        check_routes(rows.reward_names(), "task")


def test_without_the_chat_template_a_row_of_chat_messages_is_refused_naming_it():
    rows = numbered(3)
    rows[1]["prompt"] = [{"role": "user", "content": "p1"}]
    assert source(rows, shuffle=False).next_batch(3)[1]["prompt"] == rows[1]["prompt"]  # fine with the template
    with pytest.raises(UserError) as info:
        source(rows, apply_chat_template=False)
    assert "data.apply_chat_template" in str(info.value) and "row 1 " in str(info.value)
