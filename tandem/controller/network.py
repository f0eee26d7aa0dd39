"""Addresses between hosts: where a group's ranks meet, and which interface gloo and NCCL send through.

A hostname often resolves to a loopback address (Debian's ``127.0.1.1``), which other hosts
cannot reach. Inside a Ray cluster the node's address in the cluster is what Ray itself uses
between nodes, so the ranks meet there (:func:`rendezvous_host`), and gloo, which would bind
to whatever the hostname resolves to, and NCCL's sockets, which may pick a bridge such as
``docker0``, are pointed at the interface holding that address
(:func:`route_collectives_through`). Outside Ray every worker process shares its controller's
host, and the loopback address serves.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import sys

LOOPBACK = "127.0.0.1"
GLOO_INTERFACE = "GLOO_SOCKET_IFNAME"
NCCL_INTERFACE = "NCCL_SOCKET_IFNAME"
SOCKET_INTERFACE_VARIABLES = (GLOO_INTERFACE, NCCL_INTERFACE)
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def rendezvous_host() -> str:
    """The address this process's peers reach it at: the node's address in Ray's cluster inside
    a Ray actor (or driver), the loopback address otherwise."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return LOOPBACK


def interface_of(address: str) -> str | None:
    """The name of the network interface holding the IPv4 ``address`` (None when none does, or
    the system cannot say: the lookup is Linux's)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for _, name in socket.if_nameindex():
                request = struct.pack("256s", name[:15].encode())
                try:
                    reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
                except OSError:  # an interface without an IPv4 address
                    continue
                if socket.inet_ntoa(reply[20:24]) == address:
                    return name
    except OSError:
        return None
    return None


def route_collectives_through(address: str) -> None:
    """Make gloo groups and NCCL's sockets set up from now on in this process use the interface
    holding ``address`` (PyTorch's ``GLOO_SOCKET_IFNAME``, NCCL's ``NCCL_SOCKET_IFNAME``; each
    only where unset), unless ``address`` is a loopback one or no interface holds it."""
    if address.startswith("127."):
        return
    name = interface_of(address)
    if name is None:
        return
    for variable in SOCKET_INTERFACE_VARIABLES:
        if not os.environ.get(variable):
            os.environ[variable] = name
