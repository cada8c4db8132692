"""The server's pure parts, without a server: request parsing, streamed-text hold-back, flags,
/metrics from engine stats."""

from __future__ import annotations

import pytest

from pipeserve.launch.flags import to_overrides
from pipeserve.parallel.wire import EngineStats
from pipeserve.runtime.serving.api_server import ServerConfig
from pipeserve.runtime.serving.engine_server import _Stream
from pipeserve.runtime.serving.openai_protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ignored_fields,
    parse,
)
from pipeserve.runtime.engine.outputs import CompletionOutput, RequestOutput
from pipeserve.scheduler.sampling_params import SamplingParams
from pipeserve.runtime.serving.server_metrics import ServerMetrics, token_buckets


def out(text: str, num_tokens: int, finish: str | None = None) -> RequestOutput:
    c = CompletionOutput(index=0, text=text, token_ids=list(range(num_tokens)), finish_reason=finish)
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], outputs=[c], finished=finish is not None)


def test_stream_holds_back_what_a_stop_string_may_cut():
    s = _Stream(SamplingParams(stop=["END", "x"]))
    # The engine's text grows, then the stop string "END" is found and cut off at the finish.
    steps = [out("Hello", 1), out("Hello E", 2), out("Hello EN", 3), out("Hello ", 4, "stop")]
    deltas = [s.delta(o) for o in steps]
    sent = [d.text for d in deltas if d is not None]
    assert "".join(sent) == "Hello "
    assert all("E" not in t for t in sent)  # never streamed, then retracted
    assert [len(d.token_ids) for d in deltas] == [1, 1, 1, 1]
    assert deltas[-1].finish_reason == "stop"


def test_stream_without_stop_strings_sends_everything_at_once():
    s = _Stream(SamplingParams())
    assert s.delta(out("Hi", 1)).text == "Hi"
    assert s.delta(out("Hi", 2)).text == ""  # a token whose text is not complete yet
    assert s.delta(out("Hi", 2)) is None  # nothing new: no message
    assert s.delta(out("Hi there", 3, "length")).text == " there"


def test_requests_parse_strictly():
    r = parse(CompletionRequest, b'{"prompt": [[1, 2], [3]], "max_tokens": 3, "temperature": 0}')
    assert r.prompts() == [[1, 2], [3]] and r.temperature == 0.0
    assert parse(CompletionRequest, b'{"prompt": [5, 6]}').prompts() == [[5, 6]]
    for body, param in [(b'{"prompt": "a", "max_tokens": "3"}', "max_tokens"),
                        (b'{"prompt": "a", "n": 1.5}', "n"),
                        (b'{"prompt": "a", "extra": 1, "truncate_prompt_tokens": "2"}', "truncate_prompt_tokens"),
                        (b'{"messages": [{"role": "user", "content": 3}]}', "messages")]:
        model = ChatCompletionRequest if b"messages" in body else CompletionRequest
        with pytest.raises(ApiError) as e:
            parse(model, body)
        assert e.value.status == 400 and e.value.param == param


def test_unknown_fields_are_ignored_and_named():
    """As vLLM: extras pass (benchmark clients send their own), nested ones too; known fields stay strict."""
    r = parse(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "a", "audio": {}}],'
                                     b'"frobnicate": {"x": 1}, "max_tokens": 3}')
    assert r.token_limit == 3 and ignored_fields(r) == ["frobnicate", "messages.audio"]
    assert ignored_fields(parse(CompletionRequest, b'{"prompt": "a"}')) == []


def test_chat_request_fields():
    r = parse(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},'
                                     b'{"type": "text", "text": "b"}]}], "logprobs": true, "top_logprobs": 2,'
                                     b'"max_completion_tokens": 7}')
    assert r.messages[0].as_template_input() == {"role": "user", "content": "ab"}
    assert r.num_logprobs == 2 and r.token_limit == 7


def test_flags_become_overrides():
    assert to_overrides("serve", ["--api-key", "k1", "--port=9000", "parallel.pp=2", "--host", "0.0.0.0"]) == [
        "server.host='0.0.0.0'", "server.port=9000", "server.api_key='k1'", "parallel.pp=2"]


def test_server_config_validates():
    assert ServerConfig().host == "127.0.0.1"
    with pytest.raises(ValueError, match="port"):
        ServerConfig(port=70000)
    with pytest.raises(ValueError, match="api_key"):
        ServerConfig(api_key="")


def test_stage_metrics_from_engine_stats():
    m = ServerMetrics("m")

    def stats(busy, active):
        return EngineStats(num_waiting=0, num_running=1, num_kv_blocks=8, num_free_kv_blocks=8,
                           stage_busy_s=busy, active_s=active)

    def sample(name, stage):
        line = next(x for x in m.render().decode().splitlines()
                    if x.startswith(name + "{") and f'stage="{stage}"' in x)
        return float(line.rsplit(" ", 1)[1])

    m.on_stats(stats([0.0, 0.0], 0.0))
    assert sample("pipeserve:stage_busy_seconds_total", 1) == 0.0
    assert "pipeserve:stage_bubble_fraction{" not in m.render().decode()  # no work yet: no figure
    m.on_stats(stats([1.0, 3.0], 4.0))
    m.on_stats(stats([2.0, 3.5], 5.0))
    assert sample("pipeserve:stage_busy_seconds_total", 0) == 2.0
    assert sample("pipeserve:stage_busy_seconds_total", 1) == 3.5
    assert sample("pipeserve:stage_bubble_fraction", 0) == pytest.approx(1 - 2.0 / 5.0)
    assert sample("pipeserve:stage_bubble_fraction", 1) == pytest.approx(1 - 3.5 / 5.0)


def test_the_frontend_turns_unhealthy_as_soon_as_the_engine_reports_lost_workers():
    """Real CURVE sockets between a stand-in engine end and the frontend's client: an
    EngineStats with ``failed`` makes new requests fail at once, before the engine exits."""
    import asyncio
    import subprocess
    import sys

    import zmq

    from pipeserve.parallel.auth import Guard, RunKey
    from pipeserve.parallel.wire import encode
    from pipeserve.runtime.serving.frontend import AsyncEngineClient, EngineProcess

    key = RunKey.generate()
    ctx = zmq.Context()
    guard = Guard(ctx, key)
    requests, updates = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (requests, updates):
        guard.serve(sock)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],  # the engine's process, alive
                            start_new_session=True)
    engine = EngineProcess(proc, key)
    engine.info = {"requests": f"tcp://127.0.0.1:{requests.bind_to_random_port('tcp://127.0.0.1')}",
                   "updates": f"tcp://127.0.0.1:{updates.bind_to_random_port('tcp://127.0.0.1')}"}

    async def scenario() -> str | None:
        client = AsyncEngineClient(engine)
        await client.start(on_engine_exit=lambda code: None)
        updates.send(encode(EngineStats(num_waiting=0, num_running=0, num_kv_blocks=8, num_free_kv_blocks=8,
                                        failed="worker rank 1 failed: killed")))
        for _ in range(100):
            if client.engine_error is not None:
                break
            await asyncio.sleep(0.05)
        with pytest.raises(RuntimeError, match="lost its workers"):
            client.add("r", [1], SamplingParams(), stream=False, sink=asyncio.Queue(), index=0)
        assert proc.poll() is None  # the engine process has not exited: the report alone did it
        error = client.engine_error
        await client.close(grace_s=0.1)  # stops the stand-in too
        return error

    try:
        assert "worker rank 1 failed" in asyncio.run(scenario())
    finally:
        proc.kill()
        guard.close()
        ctx.destroy(linger=0)


def test_chat_template_from_a_file_or_itself(tmp_path):
    from pipeserve.runtime.serving.api_server import load_chat_template

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert load_chat_template(str(tmp_path / "t.jinja")) == template == load_chat_template(template)
    with pytest.raises(ValueError, match="neither a file nor"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not parse"):
        load_chat_template("{% for m in messages %}")
    with pytest.raises(ValueError, match="ssl_keyfile"):
        ServerConfig(ssl_certfile="cert.pem")


def test_vllm_token_buckets():
    assert token_buckets(512) == (1, 2, 5, 10, 20, 50, 100, 200, 500)
    assert token_buckets(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


def test_vllm_engine_figures_from_engine_stats():
    """Gauges follow the last stats; cumulative engine totals become counter increments."""
    from prometheus_client.parser import text_string_to_metric_families

    m = ServerMetrics("m", max_model_len=512)

    def stats(free, preemptions, queries, hits):
        return EngineStats(num_waiting=2, num_running=3, num_kv_blocks=8, num_free_kv_blocks=free,
                           num_preemptions=preemptions, num_prefix_cache_queries=queries, num_prefix_cache_hits=hits)

    m.on_stats(stats(8, 0, 0, 0))
    m.on_stats(stats(6, 1, 100, 32))
    m.on_stats(stats(2, 3, 180, 64))
    samples = {(s.name, s.labels.get("model_name")): s.value
               for family in text_string_to_metric_families(m.render().decode()) for s in family.samples}
    assert samples[("vllm:num_requests_running", "m")] == 3 and samples[("vllm:num_requests_waiting", "m")] == 2
    assert samples[("vllm:kv_cache_usage_perc", "m")] == samples[("vllm:gpu_cache_usage_perc", "m")] == 0.75
    assert samples[("vllm:num_preemptions_total", "m")] == 3
    assert samples[("vllm:prefix_cache_queries_total", "m")] == 180
    assert samples[("vllm:prefix_cache_hits_total", "m")] == 64
