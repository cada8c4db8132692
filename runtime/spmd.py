"""SPMD under torchrun: every rank runs the user's script and builds the same `LLM`.

Rank 0 starts the engine process (`runtime.engine_server`) and hands its endpoints to every
rank; all ranks then serve as workers. Rank 0 runs its worker loop in a thread and talks to
the engine as a client (`EngineClient`), so `generate` returns results there; the other ranks
block in their worker loop until the engine shuts down, and their `generate` returns [].
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist
import zmq

from pipeserve.parallel.context import build_parallel_context
from pipeserve.parallel.transport import TransportConfig, WorkerChannel
from pipeserve.parallel.wire import AbortRequest, AddRequest, RequestUpdate, Shutdown, decode, encode
from pipeserve.runtime.config import EngineConfig, engine_config_to_dict
from pipeserve.runtime.engine import validate_request, _resolve_max_model_len
from pipeserve.runtime.loader import read_config_and_tokenizer
from pipeserve.runtime.outputs import CompletionOutput, RequestOutput
from pipeserve.runtime.sampling_params import SamplingParams
from pipeserve.runtime.worker import EXIT_ENGINE_LOST, Worker, _device

_ENDPOINT_BYTES = 1024


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def start(config: EngineConfig):
    """Joins this rank to the run. Returns an EngineClient on rank 0, None elsewhere (after the
    engine has shut down)."""
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if world != config.parallel.world_size:
        raise ValueError(f"torchrun started {world} ranks but parallel.tp × parallel.pp = "
                         f"{config.parallel.world_size}")
    device = _device(config, int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    ctx = build_parallel_context(config.parallel.tp, config.parallel.pp)
    control = dist.new_group(backend="gloo")  # every rank creates it, in the same order
    config = _with_rendezvous_host(config)
    engine_proc = _start_engine(config) if rank == 0 else None
    endpoints = _broadcast_json(engine_proc and engine_proc.endpoints, control)
    torch.manual_seed(config.seed)
    worker = Worker(config, ctx, device)
    channel = WorkerChannel(
        TransportConfig(liveness_timeout_s=config.parallel.liveness_timeout_s, handshake_timeout_s=600.0),
        rank=rank, world_size=world, stage=ctx.stage, tp_rank=ctx.tp_rank,
        plan_endpoint=endpoints["plan"], result_endpoint=endpoints["result"],
        on_engine_lost=lambda: os._exit(EXIT_ENGINE_LOST), num_kv_blocks=worker.num_kv_blocks,
    )
    channel.handshake()
    if rank != 0:
        _serve(worker, channel)
        dist.destroy_process_group()
        return None
    thread = threading.Thread(target=_serve, args=(worker, channel), name="pipeserve-worker0", daemon=True)
    thread.start()
    return EngineClient(config, engine_proc, endpoints, worker_thread=thread)


def _with_rendezvous_host(config: EngineConfig) -> EngineConfig:
    """Across nodes the engine must be reachable from the other nodes: bind it to the
    rendezvous host's interface (torchrun's MASTER_ADDR) unless parallel.host was set."""
    import dataclasses
    import socket

    nnodes = int(os.environ["WORLD_SIZE"]) // int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if nnodes <= 1 or config.parallel.host is not None or "MASTER_ADDR" not in os.environ:
        return config
    host = socket.gethostbyname(os.environ["MASTER_ADDR"])
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, host=host))


def _serve(worker: Worker, channel: WorkerChannel) -> None:
    try:
        worker.serve(channel)
    finally:
        channel.close()


class _EngineProcess:
    def __init__(self, proc: subprocess.Popen, endpoints: dict) -> None:
        self.proc, self.endpoints = proc, endpoints


def _start_engine(config: EngineConfig) -> _EngineProcess:
    env = dict(os.environ, PIPESERVE_ENGINE_CONFIG=json.dumps(engine_config_to_dict(config)))
    proc = subprocess.Popen([sys.executable, "-m", "pipeserve.runtime.engine_server"], env=env,
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the engine process exited with code {proc.wait()} before it started")
    return _EngineProcess(proc, json.loads(line))


def _broadcast_json(value: dict | None, group) -> dict:
    """Rank 0's endpoints to every rank, as bytes in a tensor (no pickle)."""
    buf = torch.zeros(_ENDPOINT_BYTES, dtype=torch.uint8)
    if value is not None:
        data = json.dumps(value).encode()
        assert len(data) < _ENDPOINT_BYTES
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=group)
    return json.loads(bytes(buf[buf.nonzero().flatten()].tolist()).decode())


class EngineClient:
    """Rank 0's view of the engine process, with the engine interface `LLM` drives."""

    def __init__(self, config: EngineConfig, engine: _EngineProcess, endpoints: dict, *, worker_thread) -> None:
        self.config, self._engine, self._thread = config, engine, worker_thread
        model_config, self.tokenizer, _ = read_config_and_tokenizer(config.model)
        self.model_config = model_config
        self.max_model_len = _resolve_max_model_len(config.max_model_len, model_config.max_position_embeddings)
        self._zmq = zmq.Context()
        self._requests = self._zmq.socket(zmq.PUSH)
        self._requests.connect(endpoints["requests"])
        self._updates = self._zmq.socket(zmq.PULL)
        self._updates.connect(endpoints["updates"])
        self._pending: dict[str, tuple[str | None, list[int]]] = {}
        self._next_id = 0
        self._closed = False

    def new_request_id(self) -> str:
        self._next_id += 1
        return str(self._next_id - 1)

    def validate(self, prompt, params: SamplingParams):
        return validate_request(prompt, params, tokenizer=self.tokenizer,
                                vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len)

    def add_request(self, request_id: str, prompt, params: SamplingParams) -> None:
        text, ids, _ = self.validate(prompt, params)
        fields = {f: getattr(params, f) for f in SamplingParams.__dataclass_fields__}
        self._requests.send(encode(AddRequest(request_id=request_id, prompt_token_ids=ids, prompt=text,
                                              params=fields)))
        self._pending[request_id] = (text, ids)

    def abort_request(self, request_id: str) -> None:
        self._requests.send(encode(AbortRequest(request_id=request_id)))

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """Waits for the next finished outputs (bounded: fails if the engine process dies)."""
        while not self._updates.poll(500):
            if (code := self._engine.proc.poll()) is not None:
                self._pending.clear()
                raise RuntimeError(f"the engine process exited with code {code}")
        outs = []
        while self._updates.poll(0):
            msg = decode(self._updates.recv())
            if isinstance(msg, RequestUpdate) and msg.request_id in self._pending:
                outs.append(self._output(msg))
        return outs

    def _output(self, u: RequestUpdate) -> RequestOutput:
        text, ids = self._pending.pop(u.request_id)
        if u.finish_reason == "error":
            raise RuntimeError(f"request {u.request_id} failed: {u.error}")
        c = CompletionOutput(index=0, text=u.text, token_ids=list(u.token_ids), finish_reason=u.finish_reason,
                             logprobs=u.logprobs, stop_reason=u.stop_reason)
        return RequestOutput(request_id=u.request_id, prompt=text, prompt_token_ids=ids, outputs=[c],
                             finished=True)

    def close(self) -> None:
        """Stops the engine; it shuts the workers down (rank 0's loop included)."""
        if self._closed:
            return
        self._closed = True
        self._requests.send(encode(Shutdown(reason="LLM closed")))
        try:
            self._engine.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._engine.proc.kill()
        self._thread.join(timeout=30)
        self._requests.close(linger=0)
        self._updates.close(linger=0)
        if dist.is_initialized():
            dist.destroy_process_group()
