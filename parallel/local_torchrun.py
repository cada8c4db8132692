"""torchrun on one node with nothing listening beyond one address: how an engine starts its workers.

    python -m pipeserve.parallel.local_torchrun --host 127.0.0.1 --nproc-per-node N -m MODULE

``torchrun --standalone`` serves its rendezvous store, which the workers also use to set up their
process groups, from a TCPStore bound to the wildcard address whatever host it is given: any
machine that reaches the node could write to it. This runs torchrun itself
(``torch.distributed.run``: its agent, its monitoring and clean-up, its signal handling) with one
change, a rendezvous backend (``pipeserve-local``) whose store serves from a socket this module
binds to ``--host`` (TCPStore's ``master_listen_fd``). The workers reach it as torchrun's own
workers do (``TORCHELASTIC_USE_AGENT_STORE``).

With a loopback host, Gloo and NCCL are kept on the loopback interface too
(``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, where the caller set neither): their listeners
bind that interface's address, not the one the machine's name resolves to.
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
import sys
from datetime import timedelta

BACKEND = "pipeserve-local"
LOOPBACK = "127.0.0.1"


def loopback_interface() -> str | None:
    """The name of the loopback interface (``lo`` on Linux), None if there is none."""
    for _, name in socket.if_nameindex():
        if name == "lo" or name.startswith("lo"):
            return name
    return None


def interface_env(host: str) -> dict[str, str]:
    """Gloo's and NCCL's interface for a run on ``host``: the loopback interface when ``host``
    is a loopback address, else none (the caller's or the libraries' own choice stands)."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    name = loopback_interface() if loopback else None
    return {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name} if name else {}


def _register_backend(host: str) -> None:
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import (
        RendezvousHandler,
        RendezvousInfo,
        RendezvousStoreInfo,
        rendezvous_handler_registry,
    )

    class LocalRendezvous(RendezvousHandler):
        """One node: the agent is node 0 of 1 and hosts the store, on ``host`` only."""

        def __init__(self, run_id: str, timeout_s: float) -> None:
            self.run_id, self.timeout = run_id, timedelta(seconds=timeout_s)
            self._store = None
            self._listener: socket.socket | None = None

        def get_backend(self) -> str:
            return BACKEND

        @property
        def use_agent_store(self) -> bool:
            return True

        def next_rendezvous(self) -> RendezvousInfo:
            if self._store is None:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                self._listener = socket.create_server((host, 0), family=family)
                port = self._listener.getsockname()[1]
                self._store = dist.TCPStore(host, port, 1, True, self.timeout, multi_tenant=True,
                                            master_listen_fd=self._listener.fileno())
                self._port = port
            return RendezvousInfo(dist.PrefixStore(self.run_id, self._store), 0, 1,
                                  RendezvousStoreInfo(host, self._port))

        def is_closed(self) -> bool:
            return False

        def set_closed(self) -> None:
            pass

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return self.run_id

        def shutdown(self) -> bool:
            return True

    rendezvous_handler_registry.register(
        BACKEND, lambda params: LocalRendezvous(params.run_id, float(params.config.get("timeout", 600))))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    p.add_argument("--host", required=True)
    args, rest = p.parse_known_args(argv)
    _register_backend(args.host)
    from torch.distributed import run

    endpoint = f"[{args.host}]:0" if ":" in args.host else f"{args.host}:0"
    run.main(["--nnodes=1", f"--rdzv-backend={BACKEND}", f"--rdzv-endpoint={endpoint}", *rest])


if __name__ == "__main__":
    main()
