"""A robot's openpi session that a test can close.

openpi-client 0.1.2's ``WebsocketClientPolicy`` (what RoboLab runs) has no
``close()``: its connection lives until the server ends it, so a test that
used it would leave an idle session behind on a server other tests share.
``OpenpiSession`` is that client as the robots run it -- the same connection
(``websockets`` sync, no compression, no size limit, ``Authorization:
Api-Key`` when given a key), the metadata frame read first, each observation
packed by openpi's own streaming ``Packer``, a text reply raised as
``RuntimeError`` -- with a connection it owns and closes.  The bytes are
openpi's (tests/test_wire.py holds our codec to them).
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import Any

import websockets.sync.client
from openpi_client import msgpack_numpy


class OpenpiSession:
    def __init__(self, url: str, api_key: str | None = None) -> None:
        headers = {"Authorization": f"Api-Key {api_key}"} if api_key else None
        self._open = contextlib.ExitStack()  # the connection as websockets wants it held: entered, then exited
        self.connection = self._open.enter_context(
            websockets.sync.client.connect(url, compression=None, max_size=None, additional_headers=headers)
        )
        try:
            self.metadata: dict[str, Any] = msgpack_numpy.unpackb(self.connection.recv())
        except BaseException:
            self.close()
            raise
        self._packer = msgpack_numpy.Packer()

    def get_server_metadata(self) -> dict[str, Any]:
        return self.metadata

    def infer(self, obs: dict[str, Any]) -> dict[str, Any]:
        self.connection.send(self._packer.pack(obs))
        response = self.connection.recv()
        if isinstance(response, str):  # the server's error in --error-format text (openpi's own convention)
            raise RuntimeError(f"Error in inference server:\n{response}")
        reply: dict[str, Any] = msgpack_numpy.unpackb(response)
        return reply

    def close(self) -> None:
        self._open.close()

    def __enter__(self) -> OpenpiSession:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def session_at(host: str, port: int) -> OpenpiSession:
    """``WebsocketClientPolicy(host=..., port=...)``'s address form."""
    return OpenpiSession(f"ws://{host}:{port}")
