"""The official `openai` client against `pipeserve serve`, streaming and not."""

from __future__ import annotations

import openai
import pytest
from helpers_server import API_KEY, MODEL

pytestmark = pytest.mark.timeout(600)

PARIS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def test_models(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat_greedy_answer(client):
    r = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=12)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content.strip() == "The capital of France is Paris."
    assert choice.finish_reason == "stop"
    assert r.usage.completion_tokens == 8  # 7 tokens of text + the EOS that ended it
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.id.startswith("chatcmpl-") and r.model == MODEL


def test_chat_streaming_matches_and_reports_usage(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=PARIS, temperature=0, max_tokens=12, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() == "The capital of France is Paris."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert len({c.id for c in chunks}) == 1


def test_completions_n_seed_logprobs(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=1.0, seed=11, n=2, logprobs=2)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert [c.index for c in a.choices] == [0, 1]
    one = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1)
    assert a.usage.completion_tokens == 10
    assert a.usage.prompt_tokens == one.usage.prompt_tokens > 0  # a prompt counts once, whatever n
    for c in a.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
        assert "".join(lp.tokens) == c.text
        assert all(x <= 0 for x in lp.token_logprobs)
        assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)


def test_completions_streaming_with_stop_and_batch(client):
    prompts = ["1, 2, 3, 4,", "a, b, c, d,"]
    full = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    stopped = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, stop=[","])
    streamed = ["", ""]
    reasons = [None, None]
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, stop=[","],
                                           stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    for i in range(2):
        assert stopped.choices[i].text == full.choices[i].text.split(",")[0]
        assert stopped.choices[i].finish_reason == "stop"
        assert streamed[i] == stopped.choices[i].text and reasons[i] == "stop"


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=3,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 2
        # Greedy: the chosen token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == entry.top_logprobs[0].logprob


def test_errors_are_openai_errors(client, server):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=PARIS, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=2, temperature=-1)
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_penalties_logit_bias_and_vllm_extras(client, server):
    """OpenAI's penalties and logit_bias (token ids as string keys); vLLM's repetition_penalty,
    bad_words and allowed_token_ids through extra_body."""
    status, r = server.post("/tokenize", {"prompt": " banana", "add_special_tokens": False})
    assert status == 200 and len(r["tokens"]) == 1
    banana = r["tokens"][0]
    r = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=3, presence_penalty=0.5,
                                       frequency_penalty=0.5, logit_bias={str(banana): 100})
    assert r.choices[0].message.content.split() == ["banana"] * 3
    r = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=12,
                                       extra_body={"bad_words": ["Paris"], "repetition_penalty": 1.2})
    assert "Paris" not in r.choices[0].message.content
    r = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=2,
                                  extra_body={"allowed_token_ids": [banana]})
    assert r.choices[0].text == " banana banana"
