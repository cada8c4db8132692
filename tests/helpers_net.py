"""What a process tree listens on, read from /proc as `ss -ltnp` reads it."""

from __future__ import annotations

import ipaddress
import os
import struct


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, their children, …)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _socket_inodes(pids: list[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    return inodes


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_addr)  # the kernel's words, each in host (little-endian) order
    words = struct.unpack(f"<{len(raw) // 4}I", raw)
    return ipaddress.ip_address(b"".join(struct.pack(">I", w) for w in words))


def listening_sockets(pids: list[int] | None = None) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket these processes (None: any process) listen on; an
    IPv4-mapped IPv6 address is given as its IPv4 address."""
    inodes, out = _socket_inodes(pids or []), set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and (pids is None or fields[9] in inodes):  # LISTEN
                hex_addr, hex_port = fields[1].split(":")
                addr = _address(hex_addr)
                if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
                    addr = addr.ipv4_mapped
                out.add((str(addr), int(hex_port, 16)))
    return out
