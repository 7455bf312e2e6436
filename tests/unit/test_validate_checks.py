"""`relax validate` makes every check `relax submit` makes of a recipe, from the same code, and a local data
file is read as the run reads it before anything is written: a broken line, a missing column, an empty
file, a missing file, an unknown reward and a context too short are refused by both, exit 2, naming
what to change, with no run directory left behind."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from relax_runs import relax

REPO = Path(__file__).resolve().parents[2]

ROWS = '{"prompt": "ab", "label": "ab"}\n{"prompt": "ba", "label": "ba"}\n'
CASES = {
    "a broken line": (ROWS + '{"prompt": "ab", \n', [], "line 3 of"),
    "a missing prompt column": ('{"prompt": "ab", "label": "ab"}\n{"question": "ab", "label": "ab"}\n', [],
                                "row 1 of"),
    "an empty file": ("", [], "holds no rows"),
    "a missing file": (None, [], "does not exist"),
    "an unknown reward": (ROWS, ["reward.name=nosuch"], "reward.name: no reward called 'nosuch'"),
    "a context too short": (ROWS, ["rollout.max_new_tokens=100000"], "exceeds the model's context"),
}


def recipe_with_file_data(folder: Path, rows: str | None) -> Path:
    recipe = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())
    recipe["data"] = {"source": "file", "path": str(folder / "data.jsonl"), "prompt_key": "prompt",
                      "label_key": "label"}
    if rows is not None:
        (folder / "data.jsonl").write_text(rows)
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_validate_and_submit_refuse_it_alike_and_write_nothing(tmp_path, case):
    rows, overrides, message = CASES[case]
    recipe = recipe_with_file_data(tmp_path, rows)
    checked = relax("validate", str(recipe), *overrides, cwd=tmp_path)
    submitted = relax("submit", str(recipe), *overrides, "--dry-run", "--run-dir", str(tmp_path / "run"),
                      cwd=tmp_path)
    for proc in (checked, submitted):
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "nothing was started" in proc.stderr
    assert checked.stdout == "" and not (tmp_path / "run").exists()


def test_the_missing_column_names_the_field_to_set(tmp_path):
    recipe = recipe_with_file_data(tmp_path, '{"question": "ab", "label": "ab"}\n')
    proc = relax("validate", str(recipe), cwd=tmp_path)
    assert "has no column 'prompt' (columns: question, label); set data.prompt_key" in proc.stderr


def test_a_good_data_file_passes_both(tmp_path):
    recipe = recipe_with_file_data(tmp_path, ROWS)
    assert relax("validate", str(recipe), cwd=tmp_path).returncode == 0
    assert relax("submit", str(recipe), "--dry-run", "--run-dir", str(tmp_path / "run"), cwd=tmp_path).returncode == 0
