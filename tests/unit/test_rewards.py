"""Built-in rewards on the shapes of output real models produce.

Each table row is (response, label, expected score), with the expected score
worked out by hand from the reward's documented rule.
"""

from __future__ import annotations

import json

import pytest

from relax_core.rewards.choice import extract_choice
from relax_core.rewards.hub import select_score
from relax_core.rewards.registry import get_reward, get_spec, list_rewards

LONG_PROOF = "Let x be the number of apples. " * 40

MATH_CASES = [
    ("We get $x = 3$, so the answer is $\\boxed{3}$.", "3", 1.0),
    ("Simplifying, \\boxed{\\frac{1}{2}}", "0.5", 1.0),                    # equivalence, not string
    ("The probability is \\boxed{\\dfrac{2}{4}}.", "\\frac{1}{2}", 1.0),
    ("Therefore \\boxed{x = 7}", "7", 1.0),                                  # equation vs value
    ("So the roots are \\boxed{\\{2, 1\\}}", "\\{1,2\\}", 1.0),              # set order
    ("Final Answer: $\\sqrt{2}/2$", "\\frac{\\sqrt{2}}{2}", 1.0),           # answer line, no box
    ("<think>maybe 5? no</think>The answer is \\boxed{4}", "4", 1.0),
    ("The answer is \\boxed{5}.", "4", 0.0),                                 # wrong
    ("", "4", 0.0),                                                          # empty
    (LONG_PROOF + "Hence the answer is \\boxed{\\frac{1}{", "\\frac{1}{2}", 0.0),  # truncated mid-box
    ("<think>Let me compute 2+2 = 4, so \\boxed{4}", "4", 0.0),             # truncated inside reasoning
    ("It is either \\boxed{3} or \\boxed{4}.", "4", 0.0),                   # two boxed answers: a hedge
    ("First \\boxed{4}, and checking again: \\boxed{4}.", "4", 1.0),         # the same answer twice
    ("I think it is 4 but I did not box it", "4", 0.0),
    ("\\boxed{1,000}", "1000", 1.0),
]


@pytest.mark.parametrize("response,label,expected", MATH_CASES)
def test_math(response, label, expected):
    assert get_reward("math")(response, label, {}) == expected


DAPO_CASES = [
    ("Step 1 ... Step 5.\nAnswer: 34", "34", 1.0),
    ("...\nAnswer: $34$", "34", 1.0),
    ("The total is 1,024.\nAnswer: 1,024", "1024", 1.0),
    ("...\nAnswer: 90 degrees", "90", 1.0),
    ("...\nAnswer: \\frac{3}{6}", "\\frac{1}{2}", 1.0),
    ("...\nAnswer: 35", "34", -1.0),
    ("", "34", -1.0),
    ("Let me think step by step. First we", "34", -1.0),                    # truncated, no answer
    ("Answer: 12\nWait, I made a mistake.\nAnswer: 34", "34", 1.0),          # the last answer line counts
    ("Answer: 34\nHmm, actually\nAnswer: 12", "34", -1.0),
    ("so the result is \\boxed{34}", "34", 1.0),                             # boxed accepted without a line
    ("<think>Answer: 34</think>I refuse to answer.", "34", -1.0),            # reasoning is not the answer
]


@pytest.mark.parametrize("response,label,expected", DAPO_CASES)
def test_dapo(response, label, expected):
    result = get_reward("dapo")(response, label, {})
    assert result == {"score": expected, "acc": 1.0 if expected == 1.0 else 0.0}


MC_CASES = [
    ("The answer is (C)", "C", 1.0),
    ("After comparing the options, **C** is correct.", "C", 1.0),
    ("C) 42 J/mol", "C", 1.0),
    ("B", "B", 1.0),
    ("Answer: D", "(D)", 1.0),
    ("The final answer is $\\boxed{\\text{A}}$", "A", 1.0),
    ("A farmer has 3 fields.\nThe correct answer is **B**.", "B", 1.0),     # sentence starting with "A"
    ("Option A is wrong because of X. The answer is (B).", "A", 0.0),         # wrong
    ("", "A", 0.0),
    ("The answer is A or B", "A", 0.0),                                       # hedge
    ("<think>I think A, but let me check the constants", "A", 0.0),          # truncated in reasoning
    ("The answer is (A).\nWait, recomputing... the answer is (D).", "D", 1.0),  # the last statement wins
    ("I believe the answer is: (B) because A is wrong", "B", 1.0),
    ("<think>A looks close</think><answer>B</answer>", "B", 1.0),             # R1-style tags
    ("<think>hm</think><answer> The answer is (C) </answer>", "<answer> C </answer>", 1.0),  # tagged label
    ("<answer>A</answer> though B is tempting", "B", 0.0),                    # the tags are the answer
]


@pytest.mark.parametrize("response,label,expected", MC_CASES)
def test_multiple_choice(response, label, expected):
    assert get_reward("multiple_choice")(response, label, {}) == expected


# (response, the letter it commits to): the same answers phrased as real models phrase them,
# and text whose letters are not answers. Expected letters are written by hand.
MC_EXTRACTION = [
    # the misses from the issue: first-person sentences, letter followed by ")"
    ("I think the answer is B) because the force doubles.", "B"),
    ("I'd go with C).", "C"),
    ("My choice: (D)", "D"),
    ("I choose B)", "B"),
    ("I believe it's B) since the others contradict the data.", "B"),
    ("I pick B) here.", "B"),
    ("I'll go with A) for this one.", "A"),
    ("I would select D) given the constraints.", "D"),
    ("I'm going with C) 12 m/s.", "C"),
    ("Let's go with B).", "B"),
    ("I'd say E).", "E"),
    # answer statements
    ("The answer is B", "B"),
    ("The answer is B.", "B"),
    ("Answer: B", "B"),
    ("ANSWER: C", "C"),
    ("Final answer: B.", "B"),
    ("**Final Answer:** D", "D"),
    ("The final answer is (A).", "A"),
    ("My final answer is (C)", "C"),
    ("Answer - D", "D"),
    ("The correct answer is option B.", "B"),
    ("the correct choice is b", "B"),
    ("The correct option is D", "D"),
    ("answer: c", "C"),
    ("The answer is definitely B.", "B"),
    ("So the correct answer must be C.", "C"),
    ("Correct answer: (A) 3.2 eV", "A"),
    ("The answer is \\(B\\).", "B"),
    ("Answer: $C$", "C"),
    # formats without words
    ("**B**", "B"),
    ("\\boxed{B}", "B"),
    ("The final answer is $\\boxed{\\text{C}}$", "C"),
    ("\\boxed{(D)}", "D"),
    ("B) 42", "B"),
    ("(B)", "B"),
    ("B", "B"),
    ("b", "B"),
    ("[C]", "C"),
    ("D.", "D"),
    ("(C) 12 m/s", "C"),
    # the letter with its verdict, and reasoning
    ("B is correct", "B"),
    ("Option B is correct.", "B"),
    ("B is the correct answer because the rate doubles.", "B"),
    ("option B", "B"),
    ("It's B.", "B"),
    ("Between A and B, I pick B", "B"),
    ("First, A is too large.\nSecond, C ignores friction.\nSo: B)", "B"),
    ("The rate constant doubles.\nTherefore, D", "D"),
    ("Let me think. The mass cancels out.\nThus the answer is A.", "A"),
    ("A) is wrong, B) is right", "B"),
    ("A) 3\nB) 4\nC) 5\nD) 6\nThe answer is C", "C"),
    ("Because the force doubles, the answer is D.", "D"),
    ("a good answer is C", "C"),
    ("<think>Maybe A? No, the units rule it out.</think>The answer is (B).", "B"),
    ("The answer is (A).\nWait, recomputing... the answer is (D).", "D"),
    ("I believe the answer is: (B) because A is wrong", "B"),
    # no answer, hedges, and letters that are not answers
    ("I am not sure", None),
    ("Because it is hard to say.", None),
    ("I think it is a hard question.", None),
    ("The answer is A or B", None),
    ("It is either B or C.", None),
    ("", None),
    ("<think>I think A, but let me check the constants", None),
    ("Option A is tempting, but I am not sure.", None),
    ("Answer: a lot depends on the temperature.", None),
    ("I cannot decide between A and D.", None),
    ("The answer is B, a classic result.", "B"),
    ("Let's say a = 5. Then x = 10.", None),
    ("\\boxed{A or B}", None),
    ("The options are A, B, C and D.", None),
    ("Is it B? I'm not sure.", None),
]


@pytest.mark.parametrize("response,letter", MC_EXTRACTION)
def test_multiple_choice_extraction(response, letter):
    assert extract_choice(response) == letter
    if letter is not None:  # and the reward scores it against the label, in either case
        assert get_reward("multiple_choice")(response, letter.lower(), {}) == 1.0


F1_CASES = [
    ("Barack Obama", "Barack Obama", 1.0),
    ("The Eiffel Tower.", "eiffel tower", 1.0),                               # case, article, punctuation
    ("Answer: Paris", "Paris", 1.0),
    ("<think>It could be Lyon</think><answer>Paris, France</answer>", "Paris", 2 * 0.5 * 1 / 1.5),
    ("in 1969", "1969", 2 * 0.5 * 1 / 1.5),
    ("New York City", "New York", 2 * (2 / 3) * 1 / (2 / 3 + 1)),
    ("London", "Paris", 0.0),
    ("", "Paris", 0.0),
    ("George Washington", ["Washington", "George Washington"], 1.0),         # several gold answers
    ("the the the", "the", 1.0),                                              # both empty once normalised
    ("Paris Paris Paris", "Paris", 2 * (1 / 3) * 1 / (1 / 3 + 1)),           # repetition does not help
    ("<think>The capital is Pa", "Paris", 0.0),                               # truncated
]


@pytest.mark.parametrize("response,label,expected", F1_CASES)
def test_f1(response, label, expected):
    result = get_reward("f1")(response, label, {})
    assert result["score"] == pytest.approx(expected)
    assert result["em"] == (1.0 if expected == 1.0 else 0.0)


GOOD_FORMAT = "<think>The image shows 3 cats.</think>\n<answer>3</answer>"
R1_CASES = [
    (GOOD_FORMAT, "3", 1.0, 1.0),
    ("<think>two plus one</think><answer>\\frac{6}{2}</answer>", "3", 1.0, 1.0),   # math equivalence
    ("<answer>3</answer>", "3", 1.0, 0.0),                                          # no reasoning block
    ("<think>counting</think><answer>4</answer>", "3", 0.0, 1.0),                  # wrong, well formed
    ("", "3", 0.0, 0.0),
    ("<think>there are three cats and", "3", 0.0, 0.0),                            # truncated
    ("<think>a</think><answer>3</answer> Extra words after.", "3", 1.0, 0.0),      # trailing text
    ("<think>a</think><answer>B</answer>", "B", 1.0, 1.0),                         # option letter
    ("<think>a</think><answer>(B) a red car</answer>", "B", 1.0, 1.0),
    ("<think>a</think><answer>3</answer><answer>4</answer>", "4", 1.0, 0.0),       # two answers: last, bad format
    ("<think>a</think><answer>a red car</answer>", "A red car.", 1.0, 1.0),        # text answer
    ("<think>a<think>b</think></think><answer>3</answer>", "3", 1.0, 0.0),         # nested tags
]


@pytest.mark.parametrize("response,label,accuracy,fmt", R1_CASES)
def test_openr1mm(response, label, accuracy, fmt):
    result = get_reward("openr1mm")(response, label, {})
    assert result == {"score": accuracy + fmt, "accuracy": accuracy, "format": fmt}


def _if(instructions, response):
    return get_reward("ifbench")(response, None, {"instructions": instructions})


IF_CASES = [
    ([{"type": "word_count", "relation": "at least", "num": 5}], "one two three four five", 1.0),
    ([{"type": "word_count", "relation": "at most", "num": 3}], "one two three four", 0.0),
    ([{"type": "sentence_count", "relation": "exactly", "num": 2}], "It rains. We stay in!", 1.0),
    ([{"type": "paragraph_count", "num": 3}], "First.\n\nSecond.\n\nThird.", 1.0),
    ([{"type": "paragraph_count", "num": 3}], "First.\nSecond.\nThird.", 0.0),
    ([{"type": "include_keywords", "keywords": ["ocean", "Blue"]}], "The blue ocean.", 1.0),
    ([{"type": "exclude_keywords", "keywords": ["very"]}], "It is very good.", 0.0),
    ([{"type": "exclude_keywords", "keywords": ["very"]}], "Everything is good.", 1.0),  # word boundary
    ([{"type": "json_format"}], '```json\n{"name": "Ada", "age": 36}\n```', 1.0),
    ([{"type": "json_format"}], '{"name": "Ada", "age": ', 0.0),                         # truncated JSON
    ([{"type": "lowercase"}], "all lower case here.", 1.0),
    ([{"type": "uppercase"}], "MOSTLY UPPER but not all", 0.0),
    ([{"type": "end_phrase", "phrase": "Is there anything else I can help with?"}],
     "Done. Is there anything else I can help with?  ", 1.0),
    ([{"type": "keyword_frequency", "keyword": "data", "num": 2, "relation": "at least"}], "data, more data", 1.0),
    # only lowercase holds
    ([{"type": "no_commas"}, {"type": "lowercase"}, {"type": "word_count", "num": 100}], "hello, world", 1 / 3),
    ([{"type": "no_commas"}, {"type": "lowercase"}, {"type": "word_count", "num": 100}], "hello world", 2 / 3),
    ([{"type": "lowercase"}], "", 0.0),                                                    # empty
]


@pytest.mark.parametrize("instructions,response,expected", IF_CASES)
def test_ifbench(instructions, response, expected):
    result = _if(instructions, response)
    assert result["score"] == pytest.approx(expected)
    assert result["all"] == (1.0 if expected == 1.0 else 0.0)


def test_ifbench_reads_instructions_from_a_json_label():
    label = json.dumps([{"type": "start_phrase", "phrase": "Dear"}])
    assert get_reward("ifbench")("Dear Sir, ...", label, {}) == {"score": 1.0, "all": 1.0}


def test_ifbench_unknown_check_is_an_error_not_free_reward():
    with pytest.raises(ValueError, match="unknown ifbench check 'word_cuont'"):
        _if([{"type": "word_cuont", "num": 3}], "a b c")


def test_every_builtin_is_listed_with_a_docstring():
    builtins = {"copy", "exact_match", "math", "dapo", "multiple_choice", "f1", "ifbench", "openr1mm",
                "genrm", "math_concise"}
    assert builtins <= set(list_rewards())
    for name in builtins:
        assert get_reward(name).__doc__, name


def test_cheap_rewards_run_in_process_and_math_does_not():
    assert get_spec("copy").in_process and get_spec("multiple_choice").in_process
    assert not get_spec("math").in_process and not get_spec("openr1mm").in_process


def test_example_plugin_penalises_length():
    fn = get_reward("math_concise")
    assert fn("\\boxed{4}", "4", {}) == {"score": 1.0, "accuracy": 1.0, "length_penalty": 0.0}
    long = "x" * 6000 + "\\boxed{4}"   # 6009 chars, 2009 over the 4000 default: penalty 0.2009
    assert fn(long, "4", {})["score"] == pytest.approx(1.0 - 0.1 * 2009 / 1000)


@pytest.mark.parametrize("value,key,expected", [
    (0.5, None, 0.5), (True, None, 1.0), ({"score": 2.0, "acc": 1.0}, None, 2.0),
    ({"score": 2.0, "acc": 1.0}, "acc", 1.0), ({"only": 0.25}, None, 0.25),
])
def test_select_score(value, key, expected):
    assert select_score(value, key)[0] == expected


@pytest.mark.parametrize("value,key", [({"a": 1.0, "b": 2.0}, None), ({"score": 1.0}, "acc"),
                                       (float("nan"), None), ("1.0", None), (None, None)])
def test_select_score_rejects(value, key):
    with pytest.raises(ValueError):
        select_score(value, key)
