"""A step's response lengths in its metrics: a long tail shows as the longest far above the median."""

from relax_core.data.sample import Sample, length_stats


def test_mean_median_and_longest_of_a_long_tailed_step():
    samples = [Sample([1], [7] * n, [0.0] * n) for n in (2, 3, 3, 4, 28)]
    assert length_stats(samples) == {"response_len_mean": 8.0, "response_len_median": 3.0,
                                     "response_len_max": 28.0}


def test_an_empty_step_has_zeros():
    assert set(length_stats([]).values()) == {0.0}
