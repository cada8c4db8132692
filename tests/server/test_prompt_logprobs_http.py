"""Prompt logprobs over HTTP with the official `openai` client: /v1/completions with `echo` and
`logprobs` (the prompt's tokens, first one null, then the completion's), and vLLM's extra
`prompt_logprobs` field on completions and chat. A server of its own on the tiny random Llama
(word-level tokens "t<id>"), so transformers on the same weights is the reference; the prompts
span several 16-token chunks."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch
from helpers_model import hf_logits, load_hf_reference
from helpers_server import API_KEY, Server

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny"
PROMPT = [(7 * j) % 250 + 3 for j in range(37)]
ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("tiny_serve")
    (tmp / "template.jinja").write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    s = Server.start(tmp, "model=hf", f"model.path={tiny_model}", f"server.served_model_name={MODEL}",
                     f"server.chat_template={tmp / 'template.jinja'}", "scheduler.max_num_batched_tokens=16",
                     "engine.num_kv_blocks=64")
    try:
        yield s
    finally:
        s.kill()


@pytest.fixture(scope="module")
def client(tiny_server):
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def hf(tiny_model):
    return load_hf_reference(Path(tiny_model))


def reference(hf, token_ids: list[int]) -> torch.Tensor:
    """[len, V] float64 log-softmax: row i scores token i + 1."""
    return torch.log_softmax(hf_logits(hf, token_ids).double(), dim=-1)


def top_texts(row: torch.Tensor, k: int) -> list[str]:
    return [f"t{t}" for t in torch.argsort(row, descending=True, stable=True)[:k].tolist()]


def assert_vllm_prompt_logprobs(entries: list, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    """vLLM's shape: [null, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...]."""
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        entry, row = entries[i], ref[i - 1]
        assert str(prompt[i]) in entry
        assert [v["decoded_token"] for v in entry.values()][:k] == top_texts(row, k)
        for token, v in entry.items():
            assert v["logprob"] == pytest.approx(row[int(token)].item(), abs=ATOL)
            assert v["rank"] == 1 + int((row > row[int(token)]).sum())
            assert v["decoded_token"] == f"t{token}"


def test_completions_echo_with_logprobs(client, hf):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2)
    r = client.completions.create(**kw)
    c = r.choices[0]
    lp = c.logprobs
    output = [int(t[1:]) for t in lp.tokens[len(PROMPT):]]
    tokens = PROMPT + output
    assert lp.tokens == [f"t{t}" for t in tokens] and len(output) == 3
    assert c.text == " ".join(lp.tokens)
    ref = reference(hf, tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has no context
    for i in range(1, len(tokens)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, tokens[i]].item(), abs=ATOL)
        assert list(lp.top_logprobs[i]) == top_texts(ref[i - 1], 2)
    assert output == ref[len(PROMPT) - 1:-1].argmax(-1).tolist()
    # As vLLM, echo with logprobs computes the prompt's logprobs: the choice carries them too.
    assert_vllm_prompt_logprobs(c.model_extra["prompt_logprobs"], PROMPT, ref, 2)
    # Streamed: the prompt's tokens and logprobs come with the first chunk.
    chunks = list(client.completions.create(**kw, stream=True))
    assert [t for ch in chunks for t in ch.choices[0].logprobs.tokens] == lp.tokens
    streamed = [v for ch in chunks for v in ch.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)


def test_prompt_logprobs_field_on_completions_and_chat(client, tiny_server, hf):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 3})
    c = r.choices[0]
    assert c.logprobs is None
    assert_vllm_prompt_logprobs(c.model_extra["prompt_logprobs"], PROMPT, reference(hf, PROMPT), 3)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert plain.choices[0].model_extra["prompt_logprobs"] is None and plain.choices[0].text == c.text
    messages = [{"role": "user", "content": " ".join(f"t{t}" for t in PROMPT[:20])}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 1})
    status, rendered = tiny_server.post("/tokenize", {"messages": messages})
    assert status == 200 and len(rendered["tokens"]) == chat.usage.prompt_tokens
    prompt = rendered["tokens"]
    assert_vllm_prompt_logprobs(chat.model_extra["prompt_logprobs"], prompt, reference(hf, prompt), 1)


@pytest.mark.parametrize("body, param", [
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 21}, "logprobs"),
])
def test_bad_prompt_logprobs_are_a_400_naming_the_field(client, body, param):
    extra = {k: v for k, v in body.items() if k != "stream"}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT[:3], max_tokens=1, stream=body.get("stream", False),
                                  extra_body=extra)
    assert err.value.body["param"] == param and param in err.value.body["message"]
