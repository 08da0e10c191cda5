"""The one "do the tokens agree?" answer (parity/tokens.py)."""
from posbias_export.parity.tokens import agreeing, same_tokens, until_stop


def test_a_run_ends_at_its_first_stop_after_the_prompt():
    assert until_stop([5, 2, 7, 8, 2, 9], start=2, stop_ids=(2,)) == [5, 2, 7, 8, 2]  # the prompt's 2 does not stop
    assert until_stop([5, 7, 8], start=1, stop_ids=(2, 8)) == [5, 7, 8]  # any of several stop ids
    assert until_stop([5, 7], start=0) == [5, 7]


def test_only_tokens_before_the_first_difference_agree():
    assert agreeing([1, 2, 3, 4], [1, 2, 9, 4]) == 2  # the later 4s condition on different text
    assert agreeing([0, 0, 1, 2, 3], [0, 0, 1, 2], start=2) == 2
    assert agreeing([0, 1, 2, 7, 7], [0, 1, 2, 6, 6], start=1, stop_ids=(2,)) == 2  # both stopped at 2: agree


def test_same_tokens_up_to_the_stop():
    assert same_tokens([0, 3, 2, 5], [0, 3, 2, 6], start=1, stop_ids=(2,))
    assert not same_tokens([0, 3, 4], [0, 3, 5], start=1)
