"""torchrun with nothing listening beyond one address: how pipeserve starts workers.

    python -m pipeserve.parallel.torchrun --host 127.0.0.1 --nproc-per-node N -m MODULE
    python -m pipeserve.parallel.torchrun --host HEAD_ADDR --nnodes 2 --node-rank R --master-port P \
        --nproc-per-node N -m MODULE                       # one per node (Slurm: launch/slurm/*_multinode)

torchrun's rendezvous store, which its workers also use to set up their process groups, is a
TCPStore, and a TCPStore binds the wildcard address whatever host it is given: any machine that
reaches the node could write to it. This runs torchrun itself (``torch.distributed.run``: its
agent, its monitoring and clean-up, its signal handling) with one change, a rendezvous backend
(``pipeserve``) whose store serves from a socket this module binds to ``--host`` (TCPStore's
``master_listen_fd``). On one node the port is any free one; across nodes node 0 (``--node-rank``)
serves on ``--host:--master-port``, which must be its own address, and the other nodes' agents
connect to it, each node's rank known beforehand as with torchrun's static rendezvous. The
workers reach the store as torchrun's own workers do (``TORCHELASTIC_USE_AGENT_STORE``).

With a loopback host, Gloo and NCCL are kept on the loopback interface too
(``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, where the caller set neither): their listeners
bind that interface's address, not the one the machine's name resolves to. Across nodes they use
the interface the caller names (docs/slurm.md).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shutil
import socket
import sys
import tempfile
from datetime import timedelta

BACKEND = "pipeserve"
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
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    class AddressRendezvous(RendezvousHandler):
        """Node ``node_rank`` of ``num_nodes``; node 0 hosts the store on (host, port) only."""

        def __init__(self, run_id: str, node_rank: int, num_nodes: int, port: int, timeout_s: float) -> None:
            self.run_id, self.node_rank, self.num_nodes = run_id, node_rank, num_nodes
            self.port, self.timeout = port, timedelta(seconds=timeout_s)
            self._store = None
            self._listener: socket.socket | None = None

        def get_backend(self) -> str:
            return BACKEND

        @property
        def use_agent_store(self) -> bool:
            return True

        def next_rendezvous(self) -> RendezvousInfo:
            if self._store is None:
                listen_fd = None
                if self.node_rank == 0:
                    family = socket.AF_INET6 if ":" in host else socket.AF_INET
                    self._listener = socket.create_server((host, self.port), family=family)
                    self.port = self._listener.getsockname()[1]
                    listen_fd = self._listener.fileno()
                self._store = dist.TCPStore(host, self.port, self.num_nodes, self.node_rank == 0, self.timeout,
                                            multi_tenant=True, master_listen_fd=listen_fd)
            return RendezvousInfo(dist.PrefixStore(self.run_id, self._store), self.node_rank, self.num_nodes,
                                  RendezvousStoreInfo(host, self.port))

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

    def create(params):
        _, port = parse_rendezvous_endpoint(params.endpoint, 0)
        return AddressRendezvous(params.run_id, int(params.config.get("rank", 0)), params.max_nodes, port,
                                 float(params.config.get("timeout", 600)))

    rendezvous_handler_registry.register(BACKEND, create)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    p.add_argument("--host", required=True, help="the store's address: this node's, or node 0's across nodes")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-port", type=int, default=0, help="the store's port (0: any free one, one node only)")
    args, rest = p.parse_known_args(argv)
    if args.nnodes > 1 and not args.master_port:
        p.error("--master-port is needed across nodes")
    for name, value in interface_env(args.host).items():  # the workers inherit this environment
        os.environ.setdefault(name, value)
    _register_backend(args.host)
    from torch.distributed import run

    host = f"[{args.host}]" if ":" in args.host else args.host
    # torchrun's own default is a fresh torchelastic_* folder in TMPDIR, never removed.
    log_dir = tempfile.mkdtemp(prefix="pipeserve-torchrun-")
    try:
        run.main([f"--nnodes={args.nnodes}", f"--rdzv-backend={BACKEND}", f"--rdzv-conf=rank={args.node_rank}",
                  f"--rdzv-endpoint={host}:{args.master_port}", f"--log-dir={log_dir}", *rest])
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
