"""The kubelet's log endpoint for the pod runner's node, so `kubectl logs` and the operator's
progress reads (`pods/log`) reach the containers it runs.

The API server proxies a log request to the node's kubelet: over HTTPS, to the node's address
and `status.daemonEndpoints.kubeletEndpoint.Port`, at `/containerLogs/NS/POD/CONTAINER` with
`tailLines` and `limitBytes`. It does not check the kubelet's certificate unless it is given a
CA for it (the local control plane is not), so a certificate of a throwaway CA does. The server
listens on loopback only, on a port of its own.
"""

from __future__ import annotations

import ssl
import tempfile
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Final
from urllib.parse import parse_qs, unquote, urlsplit

from preshard_devenv.pki import CertificateAuthority

ReadLog = Callable[[str, str, str], str | None]
"""(namespace, pod, container) -> the container's output so far, None for an unknown one."""

PREFIX: Final = "/containerLogs/"


def tail(text: str, lines: int | None, limit_bytes: int | None) -> bytes:
    """A log as the kubelet cuts it: the last `lines` lines, of which the first `limit_bytes`
    bytes."""
    if lines is not None:
        text = "".join(text.splitlines(keepends=True)[-lines:] if lines > 0 else [])
    data = text.encode()
    return data[:limit_bytes] if limit_bytes is not None and limit_bytes >= 0 else data


class LogServer:
    """Serves `read_log` over HTTPS on 127.0.0.1, on a free port (`port`)."""

    def __init__(self, read_log: ReadLog) -> None:
        handler = _handler(read_log)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._server.socket = _tls_context().wrap_socket(self._server.socket, server_side=True)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="podrunner-logs", daemon=True
        )

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self._server.server_address[1])

    def start(self) -> LogServer:
        """Serve in a thread of its own."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def _tls_context() -> ssl.SSLContext:
    pair = CertificateAuthority.create("preshard-runner-kubelet").issue_serving(
        "preshard-runner", ["127.0.0.1", "localhost"]
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    # ssl loads a key pair only from files; these live as long as the loading takes.
    with tempfile.TemporaryDirectory() as directory:
        cert, key = Path(directory) / "tls.crt", Path(directory) / "tls.key"
        cert.write_bytes(pair.cert_pem)
        key.write_bytes(pair.key_pem)
        key.chmod(0o600)
        context.load_cert_chain(cert, key)
    return context


def _handler(read_log: ReadLog) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlsplit(self.path)
            parts = [unquote(p) for p in url.path.removeprefix(PREFIX).split("/")]
            if not url.path.startswith(PREFIX) or len(parts) != 3:
                self.send_error(HTTPStatus.NOT_FOUND)
                return
            text = read_log(*parts)
            if text is None:
                self.send_error(HTTPStatus.NOT_FOUND)
                return
            query = parse_qs(url.query)
            body = tail(text, _number(query, "tailLines"), _number(query, "limitBytes"))
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            """Quiet: the API server asks often."""

    return Handler


def _number(query: dict[str, list[str]], name: str) -> int | None:
    values = query.get(name)
    try:
        return int(values[0]) if values else None
    except ValueError:
        return None
