
import pytest

from pipeserve.scheduler.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.seed, p.stop, p.stop_token_ids) == (None, [], [])
    assert (p.max_tokens, p.min_tokens, p.ignore_eos, p.logprobs) == (16, 0, False, None)
    assert p.skip_special_tokens and not p.include_stop_str_in_output
    assert not p.is_greedy


def test_normalization():
    p = SamplingParams(temperature=0, stop="###", stop_token_ids=(7, 9), top_k=-1)
    assert p.temperature == 0.0 and isinstance(p.temperature, float)
    assert p.is_greedy
    assert p.stop == ["###"] and p.stop_token_ids == [7, 9] and p.top_k == 0
    assert SamplingParams(temperature=1e-6).is_greedy  # vLLM's 1e-5 threshold
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None


def test_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        SamplingParams(1)
    p = SamplingParams(stop=["a"])
    with pytest.raises(AttributeError):
        p.temperature = 0.5


def test_clone_copies_and_revalidates():
    p = SamplingParams(temperature=0.7, stop=["a"])
    q = p.clone()
    assert q == p and q is not p
    assert p.clone(max_tokens=3).max_tokens == 3
    with pytest.raises(ValueError, match="top_p"):
        p.clone(top_p=0.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature="1"), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=-0.01), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n must"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=17, max_tokens=16), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=21), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs must be in"),
        (dict(prompt_logprobs=21), "prompt_logprobs must be in"),
        (dict(prompt_logprobs=1.0), "prompt_logprobs must be an int"),
        (dict(stop=3), "stop"),
        (dict(stop=["a", 3]), "stop"),
        (dict(stop=[""]), "non-empty"),
        (dict(stop=[str(i) for i in range(65)]), "at most 64"),
        (dict(stop=["x" * 1025]), "1024"),
        (dict(seed=1.5), "seed"),
        (dict(seed="7"), "seed"),
        (dict(seed=True), "seed"),
        (dict(stop_token_ids=[1, -1]), "stop_token_ids"),
        (dict(stop_token_ids=5), "stop_token_ids"),
    ],
)
def test_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_accepts_edge_values():
    SamplingParams(top_p=1e-9, min_p=1.0, logprobs=0, top_k=1, seed=-3, max_tokens=1, min_tokens=1)
    SamplingParams(logprobs=20, stop=["x" * 1024] + [str(i) for i in range(63)])
    SamplingParams(prompt_logprobs=0)
    SamplingParams(prompt_logprobs=20)


def test_one_type_from_the_api_to_the_wire():
    """The engine's plans carry the user's SamplingParams as they are: encoded, decoded and
    validated again on the way (an out-of-range value cannot be sent)."""
    import msgspec

    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=2**64 - 1, stop=["\n"], logprobs=2)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p
    bad = msgspec.msgpack.encode([1, -1.0] + list(msgspec.msgpack.decode(msgspec.msgpack.encode(p)))[2:])
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        msgspec.msgpack.decode(bad, type=SamplingParams)


@pytest.mark.parametrize("field, value", [("seed", 2**64), ("top_k", 2**70), ("stop_token_ids", [2**70])])
def test_integers_beyond_the_wire_are_rejected(field, value):
    """msgpack carries 64-bit integers: larger ones are a clear ValueError here, not an
    OverflowError when the engine encodes its plan."""
    with pytest.raises(ValueError, match=field.split("_ids")[0]):
        SamplingParams(**{field: value})
