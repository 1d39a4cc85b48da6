"""Fixtures of the reader-service tests (the dataset fixtures come from ``tests/readers``)."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator

import pytest

from readers.service import ReaderServer, ServiceConfig


@pytest.fixture
def start_server() -> Iterator[Callable[..., ReaderServer]]:
    """Start servers on 127.0.0.1:0 (reader threads unless ``readers`` says otherwise); every
    one is closed (readers joined) at teardown."""
    servers: list[ReaderServer] = []

    def start(producer: object, **options: object) -> ReaderServer:
        options = {"readers": 0, "report_every_s": 0, "heartbeat_s": 0.5, **options}
        server = ReaderServer(producer, config=ServiceConfig(**options), log=io.StringIO())
        servers.append(server.start())
        return server

    yield start
    for server in servers:
        stats = server.close()
        assert all(s.readers_alive == 0 for s in stats.sessions)
