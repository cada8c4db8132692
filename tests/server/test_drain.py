"""A server with torchrun workers drains whichever way SIGTERM arrives: to the server process
alone, to its process group, or to every process of the tree at once (what Slurm does on
`scancel` and at the time limit). Requests in flight finish in full, new ones get 503, every
process exits, and the server's exit code is 0."""

from __future__ import annotations

import pytest
from helpers_server import SIGNAL_MODES, Server, descendants, signal_server, streams_in_background, wait_gone

pytestmark = pytest.mark.timeout(400)

STREAM = {"prompt": "Count to ten:", "max_tokens": 24, "ignore_eos": True, "temperature": 0, "stream": True}


# Every way at pp=2 and tp=2; CI runs one of each layout (a server start each), `-m slow` the rest.
CASES = [(layout, how) for layout in ("parallel.pp=2", "parallel.tp=2") for how in SIGNAL_MODES]
IN_CI = {("parallel.pp=2", "every process"), ("parallel.tp=2", "server")}


@pytest.mark.parametrize("layout, how", [c if c in IN_CI else pytest.param(*c, marks=pytest.mark.slow) for c in CASES])
def test_sigterm_drains_and_exits_0(tmp_path, layout, how):
    server = Server.start(tmp_path, layout)
    try:
        tree = [server.proc.pid, *descendants(server.proc.pid)]
        assert len(tree) >= 5  # frontend, engine, torchrun, two workers
        threads, results = streams_in_background(server, STREAM, 2, timeout_s=180)
        server.wait_until(lambda m: m.get("pipeserve:generation_tokens_total", 0) >= 2, timeout_s=120)
        signal_server(server, how)
        for t in threads:
            t.join(timeout=180)
            assert not t.is_alive()
        assert server.proc.wait(timeout=180) == 0
        for events in results:  # both finished in full
            assert events[-1] == "[DONE]", events[-3:]
            assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert all(wait_gone(pid, timeout_s=60) for pid in tree)
    finally:
        server.kill()
