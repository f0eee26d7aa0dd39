"""The host's end of a sandboxed command's route to its endpoint: a Unix-domain socket whose
every connection is relayed to the endpoint's TCP address.

A sandboxed command's network namespace reaches nothing of the host's (its loopback is its
own), so the endpoint is handed to it as a socket file instead: the directory holding it is
mounted into the sandbox, where a relay listening on the namespace's own ``127.0.0.1`` forwards
to it (:mod:`~tandem.agents.program.sandboxed_child`). Only that one address is reachable
through it: bytes go to the endpoint and back, nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator

READ_CHUNK = 65536
SOCKET_NAME = "endpoint.sock"


@contextlib.asynccontextmanager
async def unix_relay(host: str, port: int) -> AsyncIterator[str]:
    """A fresh directory holding ``endpoint.sock``, relayed to ``host:port`` while the block
    runs; yields the directory. Its connections are closed when the block ends."""
    connections: set[asyncio.Task] = set()

    async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.add(asyncio.current_task())
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(pump(reader, upstream_writer), pump(upstream_reader, writer))
        finally:
            for end in (writer, upstream_writer):
                end.close()
            connections.discard(asyncio.current_task())

    with tempfile.TemporaryDirectory(prefix="tandem-endpoint-") as directory:
        server = await asyncio.start_unix_server(forward, os.path.join(directory, SOCKET_NAME))
        try:
            yield directory
        finally:
            server.close()
            for task in list(connections):
                task.cancel()
            await asyncio.gather(*connections, return_exceptions=True)


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until its end, then end ``writer``'s side too."""
    with contextlib.suppress(ConnectionError, OSError):
        while chunk := await reader.read(READ_CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
