"""The two tiers (tests/tiers.py): on a small suite of its own, run by pytest's pytester."""

from __future__ import annotations

from pathlib import Path

import pytest

TIERS = Path(__file__).resolve().parents[1] / "tiers.py"

CONFTEST = """
import pytest
from tiers import pytest_terminal_summary, select_tier

def pytest_addoption(parser):
    parser.addoption("--full", action="store_true")

def pytest_configure(config):
    config.addinivalue_line("markers", "full(covered_by): full tier")

def pytest_collection_modifyitems(config, items):
    select_tier(config, items)
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(tiers=TIERS.read_text())
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_runs="""
import pytest

def test_quickstart():
    pass

@pytest.mark.parametrize("mode", ["colocate", "fully_async"])
def test_recovery(mode):
    pass

@pytest.mark.full(covered_by="test_runs.py::test_quickstart")
def test_long_learning():
    pass

@pytest.mark.full(covered_by="test_runs.py::test_recovery")
def test_recovery_variant():
    pass
""")
    return pytester


def test_the_default_tier_leaves_the_full_tier_out_and_says_so(suite: pytest.Pytester) -> None:
    result = suite.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, deselected=2)
    result.stdout.fnmatch_lines(["default tier: 2 full-tier tests not run (bash tests/run --full runs them)"])


def test_full_runs_everything(suite: pytest.Pytester) -> None:
    suite.runpytest("--full").assert_outcomes(passed=5)


def test_a_full_tier_test_named_on_the_command_line_runs(suite: pytest.Pytester) -> None:
    suite.runpytest("test_runs.py::test_long_learning").assert_outcomes(passed=1)


@pytest.mark.parametrize("mark, says", [
    ('@pytest.mark.full(covered_by="test_more.py::test_gone")', "names no test"),
    ('@pytest.mark.full(covered_by="test_runs.py::test_long_learning")', "is in the full tier itself"),
    ("@pytest.mark.full", "needs covered_by"),
])
def test_a_full_mark_must_name_a_default_tier_test(suite: pytest.Pytester, mark: str, says: str) -> None:
    suite.makepyfile(test_more=f"import pytest\n\n{mark}\ndef test_x():\n    pass\n")
    result = suite.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    assert says in result.stderr.str() + result.stdout.str()
