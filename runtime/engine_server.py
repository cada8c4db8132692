"""The engine as its own process, serving one client over ZeroMQ.

    python -m pipeserve.runtime.engine_server        (started by rank 0 under torchrun)

It binds two sockets on the configured host (requests in: PULL; updates out: PUSH), prints
one JSON line with every endpoint the workers and the client need, handshakes with the
torchrun workers, then loops: take requests and aborts → step → send finished outputs.
Keeping it out of rank 0's process means scheduling never competes with stage 0's kernel
launches for the GIL.
"""

from __future__ import annotations

import json
import os
import sys

import zmq

from pipeserve.parallel.wire import (
    AbortRequest,
    AddRequest,
    RequestUpdate,
    Shutdown,
    WireError,
    decode,
    encode,
)
from pipeserve.runtime.config import engine_config_from_dict
from pipeserve.runtime.engine import LLMEngine
from pipeserve.runtime.executor import WorkerFailure
from pipeserve.runtime.outputs import RequestOutput
from pipeserve.runtime.sampling_params import SamplingParams


def update_of(out: RequestOutput) -> RequestUpdate:
    c = out.outputs[0]
    return RequestUpdate(
        request_id=out.request_id, token_ids=c.token_ids, text=c.text, finish_reason=c.finish_reason,
        stop_reason=c.stop_reason, logprobs=c.logprobs, error=out.error,
    )


class EngineServer:
    def __init__(self, engine: LLMEngine, requests: zmq.Socket, updates: zmq.Socket) -> None:
        self.engine, self.requests, self.updates = engine, requests, updates
        self._stop = False

    def serve(self) -> None:
        while not self._stop:
            busy = self.engine.has_unfinished_requests()
            self._take_messages(timeout_ms=0 if busy else 100)
            if self._stop:
                break
            if not self.engine.has_unfinished_requests():
                self.engine.executor.idle()
                continue
            for out in self.engine.step():
                if out.finished:
                    self._send(update_of(out))

    def _take_messages(self, timeout_ms: int) -> None:
        while self.requests.poll(timeout_ms):
            timeout_ms = 0
            try:
                msg = decode(self.requests.recv())
            except WireError as e:
                print(f"engine: dropped a malformed message: {e}", file=sys.stderr)
                continue
            if isinstance(msg, AddRequest):
                self._add(msg)
            elif isinstance(msg, AbortRequest):
                if self.engine.abort_request(msg.request_id):
                    self._send(update_of(self.engine.take_aborted(msg.request_id)))
            elif isinstance(msg, Shutdown):
                self._stop = True
                return

    def _add(self, msg: AddRequest) -> None:
        try:
            params = SamplingParams(**msg.params)
            prompt = msg.prompt if msg.prompt is not None and not msg.prompt_token_ids else msg.prompt_token_ids
            self.engine.add_request(msg.request_id, prompt, params)
        except (ValueError, TypeError) as e:
            self._send(RequestUpdate(request_id=msg.request_id, token_ids=[], text="",
                                     finish_reason="error", error=str(e)))

    def _send(self, update: RequestUpdate) -> None:
        self.updates.send(encode(update))

    def fail_all(self, message: str) -> None:
        for rid in list(self.engine._requests):
            self._send(RequestUpdate(request_id=rid, token_ids=[], text="", finish_reason="error",
                                     error=message))


def main() -> int:
    config = engine_config_from_dict(json.loads(os.environ["PIPESERVE_ENGINE_CONFIG"]))
    ctx = zmq.Context()
    requests, updates = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (requests, updates):
        sock.setsockopt(zmq.LINGER, 1000)
    host = f"tcp://{config.parallel.bind_host}"
    endpoints = {
        "requests": f"{host}:{requests.bind_to_random_port(host)}",
        "updates": f"{host}:{updates.bind_to_random_port(host)}",
    }

    def announce(plan_endpoint: str, result_endpoint: str) -> None:
        # Rank 0 reads this line and hands the endpoints to every rank; the workers are the
        # torchrun ranks themselves, so there is nothing to start here.
        endpoints.update(plan=plan_endpoint, result=result_endpoint)
        print(json.dumps(endpoints), flush=True)

    engine = LLMEngine(config, launch=announce)
    server = EngineServer(engine, requests, updates)
    code = 0
    try:
        server.serve()
    except WorkerFailure as e:
        server.fail_all(str(e))
        print(f"engine: {e}", file=sys.stderr)
        code = 1
    finally:
        engine.close()
        requests.close()
        updates.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
