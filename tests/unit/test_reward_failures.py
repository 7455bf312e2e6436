"""The failure window that ends a run whose reward keeps failing, and the progress line's `rerr`.

Both recipe knobs (`reward.max_error_frac`, `reward.error_window`) are shown to
change when a run stops; the expected counts are worked out by hand.
"""

from __future__ import annotations

import pytest

from relax_core.config.reward import RewardConfig
from relax_core.metrics.tracker import progress_line
from relax_core.rewards.failures import FailureWindow, RewardFailureError
from relax_core.rewards.hub import RewardResult


def ok(n: int) -> list[RewardResult]:
    return [RewardResult(1.0, "judge")] * n


def failed(n: int, reward: str = "judge", error: str = "ValueError: no verdict") -> list[RewardResult]:
    return [RewardResult(0.0, reward, status="error", error=error)] * n


def test_the_default_window_stops_a_reward_that_fails_on_most_samples():
    config = RewardConfig()
    window = FailureWindow(config.max_error_frac, config.error_window)
    window.add(failed(128))  # 128 of 256: exactly the limit, the run goes on
    with pytest.raises(RewardFailureError) as caught:
        window.add(failed(1, error="KeyError: 'x'"))
    message = str(caught.value)
    assert "reward 'judge': 129 of the last 129 samples failed" in message
    assert "its first error: ValueError: no verdict" in message  # the first one, not the latest
    assert "reward.max_error_frac=0.5" in message and "reward.error_window=256" in message


def test_max_error_frac_sets_how_many_failures_a_window_may_hold():
    lenient, strict = FailureWindow(0.5, 10), FailureWindow(0.3, 10)
    batch = ok(6) + failed(4)      # 4 failures: <= 5 allowed at 0.5, > 3 allowed at 0.3
    lenient.add(batch)
    with pytest.raises(RewardFailureError, match="4 of the last 10 samples failed"):
        strict.add(batch)


def feed(window: FailureWindow, pattern: str) -> int:
    """Add samples one by one ("F" failed, "." scored); the number added when the run stopped, else 0."""
    for count, mark in enumerate(pattern, 1):
        try:
            window.add(failed(1) if mark == "F" else ok(1))
        except RewardFailureError:
            return count
    return 0


def test_error_window_sets_over_how_many_samples_failures_count():
    # max_error_frac 0.5: a window of 4 allows 2 failures, one of 10 allows 5
    assert feed(FailureWindow(0.5, 4), "FFF" + "." * 20) == 3       # a burst of 3 stops the short window
    assert feed(FailureWindow(0.5, 10), "FFF" + "." * 20) == 0      # but not the long one
    spread = "FF..FF..FF" + "." * 10                                 # never 3 in any 4, but 6 in 10
    assert feed(FailureWindow(0.5, 4), spread) == 0
    assert feed(FailureWindow(0.5, 10), spread) == 10


def test_a_window_that_forgets_old_failures_lets_the_run_go_on():
    assert feed(FailureWindow(0.5, 4), "FF" + "...." + "FF" + "...." + "FF") == 0


def test_max_error_frac_one_never_stops_a_run():
    assert feed(FailureWindow(1.0, 4), "F" * 50) == 0


def test_the_first_error_named_is_that_of_the_reward_that_failed_most():
    window = FailureWindow(0.0, 8)
    with pytest.raises(RewardFailureError) as caught:
        window.add(failed(1, "genrm", "TimeoutError") + failed(3, "math", "ZeroDivisionError: x (at m.py:3 in f)"))
    assert "reward 'math': 4 of the last 4" in str(caught.value)
    assert "its first error: ZeroDivisionError: x (at m.py:3 in f)" in str(caught.value)


@pytest.mark.parametrize("errors,timeouts,shown", [
    (0, 0, None), (3, 0, "rerr 3"), (2, 5, "rerr 7 (5 timed out)"), (0, 1, "rerr 1 (1 timed out)"),
])
def test_the_progress_line_shows_reward_failures_only_when_there_are_some(errors, timeouts, shown):
    line = progress_line({"step": 4, "reward_mean": 0.5, "reward_errors": errors, "reward_timeouts": timeouts}, 10)
    assert line.startswith("step 4/10 | reward 0.500")
    assert ("rerr" in line) == (shown is not None)
    if shown:
        assert line.endswith(" | " + shown)
