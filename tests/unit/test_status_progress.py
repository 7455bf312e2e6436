"""`relax status`'s progress figures from metrics.jsonl rows: rate, ETA, reward trend."""

from relax_core.launch.status import progress


def test_rate_eta_and_trend_come_from_the_last_steps():
    # 30 steps, one every 2 s; reward 0.1 for steps 1-20, then 0.5
    rows = [{"step": s, "time": 1000.0 + 2 * s, "reward_mean": 0.1 if s <= 20 else 0.5, "staleness_max": 1}
            for s in range(1, 31)]
    figures = progress(rows, total=90)
    assert figures["steps_per_min"] == 30.0
    assert figures["eta_s"] == 120  # 60 steps left at 0.5 steps/s
    assert figures["reward_recent_mean"] == 0.5  # steps 21-30
    assert figures["reward_trend"] == 0.4  # against steps 11-20
    assert figures["staleness_max"] == 1


def test_rows_without_times_give_no_rate():
    figures = progress([{"step": 1, "reward_mean": 0.2}], total=10)
    assert figures["steps_per_min"] is None and figures["eta_s"] is None and figures["reward_trend"] is None
