"""Which interface holds an address, and when gloo is pointed at it (the cross-host path runs in
test_multinode.py, on a two-raylet Ray cluster)."""

import os
import socket
import sys

import pytest

from tandem.controller.network import (
    GLOO_INTERFACE,
    NCCL_INTERFACE,
    SOCKET_INTERFACE_VARIABLES,
    interface_of,
    route_collectives_through,
)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the interface lookup is Linux's"
)


def _outbound_address() -> str:
    """The address this host sends from (a UDP socket's source; no packet leaves)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.200", 9))
        except OSError:
            pytest.skip("this host has no route out")
        return sock.getsockname()[0]


def test_the_loopback_address_is_on_lo_and_a_foreign_one_nowhere():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.77") is None


def test_gloo_and_nccl_are_routed_through_a_real_interface_but_never_loopback_or_over_the_users_choice(
    monkeypatch,
):
    for variable in SOCKET_INTERFACE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    route_collectives_through("127.0.1.1")
    assert not any(variable in os.environ for variable in SOCKET_INTERFACE_VARIABLES)
    address = _outbound_address()
    route_collectives_through(address)
    assert os.environ.get(GLOO_INTERFACE) == os.environ.get(NCCL_INTERFACE) == interface_of(address) != None  # noqa: E711
    monkeypatch.setenv(GLOO_INTERFACE, "mine")
    monkeypatch.delenv(NCCL_INTERFACE)
    route_collectives_through(address)
    assert os.environ[GLOO_INTERFACE] == "mine" and os.environ[NCCL_INTERFACE] == interface_of(address)
