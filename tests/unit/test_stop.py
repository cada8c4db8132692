import random

import pytest

from pipeserve.scheduler.sampling_params import SamplingParams
from pipeserve.runtime.engine.stop import StopDecision, check_stop

EOS = 2


def generate(pieces, params, *, token_ids=None, eos_token_ids=(EOS,), max_tokens=100):
    """Feed tokens one at a time, as the engine does, until check_stop finishes the request.

    Returns (decision, number of tokens generated)."""
    token_ids = token_ids or [100 + i for i in range(len(pieces))]
    text = ""
    for n, (token_id, piece) in enumerate(zip(token_ids, pieces), start=1):
        text += piece
        decision = check_stop(
            output_token_ids=token_ids[:n],
            output_text=text,
            new_text_len=len(piece),
            params=params,
            eos_token_ids=eos_token_ids,
            max_tokens=max_tokens,
        )
        if decision.finish_reason is not None:
            return decision, n
        assert decision.output_text == text
    return decision, len(pieces)


def test_running_request_returns_none_and_text():
    decision, n = generate(["a", "b"], SamplingParams())
    assert decision == StopDecision(None, None, "ab") and n == 2


def test_eos_stops_and_its_text_is_dropped():
    p = SamplingParams()
    assert generate(["a", "b", "", "c"], p, token_ids=[5, 6, EOS, 7]) == (
        ("stop", None, "ab"),
        3,
    )
    # With skip_special_tokens=False the EOS text reaches the detokenized output.
    assert generate(["a", "</s>"], p, token_ids=[5, EOS])[0] == ("stop", None, "a")
    p = SamplingParams(include_stop_str_in_output=True)
    assert generate(["a", "</s>"], p, token_ids=[5, EOS])[0] == ("stop", None, "a</s>")


def test_any_of_several_eos_ids():
    p = SamplingParams()
    decision, n = generate(["a", "b", "c"], p, token_ids=[5, 9, 6], eos_token_ids=(EOS, 9))
    assert decision.finish_reason == "stop" and n == 2


def test_ignore_eos_runs_to_length():
    p = SamplingParams(ignore_eos=True)
    decision, n = generate(["a", "", "b", "c"], p, token_ids=[5, EOS, 6, 7], max_tokens=3)
    assert decision == ("length", None, "ab") and n == 3


def test_stop_token_ids():
    p = SamplingParams(stop_token_ids=[42], ignore_eos=True)
    decision, n = generate(["x", "y", "<|end|>", "z"], p, token_ids=[5, 6, 42, 7])
    assert decision == ("stop", 42, "xy") and n == 3
    p = p.clone(include_stop_str_in_output=True)
    assert generate(["x", "<|end|>"], p, token_ids=[5, 42])[0] == ("stop", 42, "x<|end|>")


@pytest.mark.parametrize(
    "include, expected", [(False, "Hello "), (True, "Hello World")], ids=["cut", "include"]
)
def test_stop_string_spanning_tokens(include, expected):
    p = SamplingParams(stop=["World"], include_stop_str_in_output=include)
    decision, n = generate(["Hel", "lo W", "or", "ld! and", " more"], p)
    assert decision == ("stop", "World", expected) and n == 4


def test_stop_string_inside_one_token_cuts_the_rest():
    p = SamplingParams(stop=["\n\n"])
    assert generate(["a", "b\n\nc", "d"], p) == (("stop", "\n\n", "ab"), 2)


def test_earliest_stop_string_wins():
    p = SamplingParams(stop=["cd", "bcde", "bc"])
    assert generate(["a", "bcdef"], p)[0] == ("stop", "bc", "a")
    p = p.clone(include_stop_str_in_output=True)
    assert generate(["a", "bcdef"], p)[0] == ("stop", "bc", "abc")


def test_only_the_tail_is_searched():
    # "STOP" lies wholly in text from earlier steps, so this step cannot match it.
    p = SamplingParams(stop=["STOP"])
    kwargs = dict(output_token_ids=[1, 2, 3], params=p, eos_token_ids=(EOS,), max_tokens=10)
    assert check_stop(output_text="xSTOPyz", new_text_len=2, **kwargs).finish_reason is None
    assert check_stop(output_text="xSTOPyz", new_text_len=3, **kwargs).finish_reason == "stop"
    assert check_stop(output_text="xxSTOP", new_text_len=0, **kwargs).finish_reason is None


def test_unknown_new_text_len_searches_the_whole_text():
    p = SamplingParams(stop=["STOP"])
    kwargs = dict(output_token_ids=[1, 2, 3], params=p, eos_token_ids=(EOS,), max_tokens=10)
    assert check_stop(output_text="xSTOPyz", **kwargs) == ("stop", "STOP", "x")
    assert check_stop(output_text="abc", **kwargs) == (None, None, "abc")
    kwargs["output_token_ids"] = [1, EOS]
    assert check_stop(output_text="ab</s>", **kwargs) == ("stop", None, "ab</s>")


def test_max_tokens_gives_length_and_stop_wins_on_the_last_token():
    assert generate(["a", "b", "c"], SamplingParams(), max_tokens=2) == (("length", None, "ab"), 2)
    decision, n = generate(["a", ""], SamplingParams(), token_ids=[5, EOS], max_tokens=2)
    assert decision.finish_reason == "stop" and n == 2


def test_min_tokens_defers_eos_stop_ids_and_stop_strings():
    p = SamplingParams(min_tokens=2, stop_token_ids=[42], stop=["!"])
    # Tokens 1 and 2 cannot stop the request; token 3 can.
    assert generate(["", "", "", ""], p, token_ids=[EOS, 42, EOS, 5])[1] == 3
    assert generate(["!", "!", "a!", "b"], p)[0] == ("stop", "!", "!!a")
    # max_tokens (which the engine may clamp to the context length) still applies.
    assert generate(["a", "b"], p, max_tokens=1)[0].finish_reason == "length"


def naive_first_stop(pieces, stops):
    """Reference: scan the whole text after every token for the earliest stop string."""
    text = ""
    for n, piece in enumerate(pieces, start=1):
        text += piece
        hits = [(text.find(s), len(s), s) for s in stops if s in text]
        if hits:
            start, length, stop = min(hits)
            return ("stop", stop, text[:start]), n
    return (None, None, text), len(pieces)


def test_stop_strings_match_naive_reference_on_random_streams():
    rng = random.Random(0)
    num_stopped = 0
    for _ in range(500):
        pieces = ["".join(rng.choices("ab c", k=rng.randint(0, 4))) for _ in range(12)]
        stops = ["".join(rng.choices("ab c", k=rng.randint(1, 4))) for _ in range(3)]
        p = SamplingParams(stop=stops)
        expected = naive_first_stop(pieces, stops)
        assert generate(pieces, p) == expected, (pieces, stops)
        num_stopped += expected[0][0] == "stop"
    assert 100 < num_stopped < 450  # both outcomes are well exercised
