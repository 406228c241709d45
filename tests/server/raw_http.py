"""HTTP/1.1 over one raw socket, for tests about the connection itself (keep-alive after an
error): requests are written by hand and responses read by their ``Content-Length``."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self):
        return json.loads(self.body)


class RawConnection:
    """One keep-alive connection to ``host:port``."""

    def __init__(self, host: str, port: int, timeout: float = 60.0) -> None:
        self.host, self.port = host, port
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self._buffer = b""

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def post(self, path: str, body: bytes | str, headers: dict[str, str] | None = None):
        """Send a POST with a JSON body (a str is encoded keeping lone surrogates) and read
        the whole response."""
        if isinstance(body, str):
            body = body.encode("utf-8", "surrogatepass")
        lines = [
            f"POST {path} HTTP/1.1",
            f"Host: {self.host}:{self.port}",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
        ]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        return self._read_response()

    def _read(self) -> bytes:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        return data

    def _read_response(self) -> RawResponse:
        while b"\r\n\r\n" not in self._buffer:
            self._buffer += self._read()
        head, self._buffer = self._buffer.split(b"\r\n\r\n", 1)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        assert "content-length" in headers, f"no Content-Length: {headers}"
        length = int(headers["content-length"])
        while len(self._buffer) < length:
            self._buffer += self._read()
        body, self._buffer = self._buffer[:length], self._buffer[length:]
        return RawResponse(status, headers, body)
