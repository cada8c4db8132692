"""What the ranks of a worker group exchange over gloo besides the data plane: the engine's
endpoints at start-up (rank 0 knows them, the others may be on other nodes) and, after a
benchmark, every rank's stage timeline, moved onto rank 0's clock (so rank 0 can write them
all without a shared file system). Plain bytes in tensors: never pickle."""

from __future__ import annotations

import json
import socket
import time

import torch
import torch.distributed as dist

_ENDPOINT_BYTES = 1024
_CLOCK_ROUNDS = 8


def broadcast_json(value: dict | None, group) -> dict:
    """Rank 0's ``value`` on every rank."""
    buf = torch.zeros(_ENDPOINT_BYTES, dtype=torch.uint8)
    if value is not None:
        data = json.dumps(value).encode()
        assert len(data) < _ENDPOINT_BYTES
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=group)
    return json.loads(bytes(buf[buf.nonzero().flatten()].tolist()).decode())


def gather_timelines(own: dict | None, rank: int, world: int, group) -> list[dict | None] | None:
    """Every rank's stage timeline on rank 0, in rank order, its times on rank 0's
    time.monotonic clock (None elsewhere)."""
    payload = None if own is None else dict(own, boot_id=_boot_id())
    if rank != 0:
        _answer_clock(group)
        _send_json(payload, group)
        return None
    timelines = [payload]
    for src in range(1, world):
        offset = _clock_offset(src, group)
        data = _recv_json(src, group)
        if data is not None and data["boot_id"] != _boot_id():  # another host, another clock
            data["spans"] = shift_spans(data["spans"], -offset)
        timelines.append(data)
    for data in timelines:
        if data is not None:
            data.pop("boot_id")
    return timelines


def shift_spans(spans: list[list[float]], seconds: float) -> list[list[float]]:
    """[step id, recv start, compute start, compute end(, queued)] spans with their times moved."""
    return [[step, *(t + seconds for t in times)] for step, *times in spans]


def _boot_id() -> str:
    """Processes with the same boot id share time.monotonic (one kernel since one boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def _clock_offset(peer: int, group) -> float:
    """The peer's time.monotonic() minus ours, from the round trip with the least delay
    (Cristian's algorithm): off by at most half that round trip."""
    buf = torch.zeros(1, dtype=torch.float64)
    best = (float("inf"), 0.0)
    for _ in range(_CLOCK_ROUNDS):
        t0 = time.monotonic()
        dist.send(buf, dst=peer, group=group)
        dist.recv(buf, src=peer, group=group)
        t1 = time.monotonic()
        best = min(best, (t1 - t0, buf.item() - (t0 + t1) / 2))
    return best[1]


def _answer_clock(group) -> None:
    buf = torch.zeros(1, dtype=torch.float64)
    for _ in range(_CLOCK_ROUNDS):
        dist.recv(buf, src=0, group=group)
        buf.fill_(time.monotonic())
        dist.send(buf, dst=0, group=group)


def _send_json(value, group) -> None:
    data = json.dumps(value).encode()
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=0, group=group)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=0, group=group)


def _recv_json(src: int, group):
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=src, group=group)
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(buf, src=src, group=group)
    return json.loads(buf.numpy().tobytes().decode())
