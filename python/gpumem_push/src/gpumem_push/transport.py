"""Sending one push body to the agent: over its Unix socket (``unix:<path>``) or HTTP, with
a timeout, never through a proxy."""

from .config import PUSH_PATH


class Refused(Exception):
    """The agent answered with an error status."""

    def __init__(self, status, message):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def send(url, body, timeout, path=None, content_type="application/json"):
    """POSTs `body` to `url` (to `path` on its server where given: a push's by default).
    Raises Refused for an error status, OSError (and http.client's errors) when the agent
    cannot be reached in time."""
    import http.client  # here, not at import: the hook imports this package at interpreter start

    headers = {"Content-Type": content_type, "Content-Length": str(len(body))}
    if url.startswith("unix:"):
        import socket

        class UnixConnection(http.client.HTTPConnection):
            def connect(self):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout)
                try:
                    sock.connect(url[len("unix:"):])
                except OSError:
                    sock.close()
                    raise
                self.sock = sock

        connection = UnixConnection("localhost", timeout=timeout)
        path = path or PUSH_PATH
    else:
        # http.client, not urllib: an HTTP_PROXY set for the job must not carry node-local
        # pushes away.
        from urllib.parse import urlsplit
        parts = urlsplit(url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = kind(parts.hostname, parts.port, timeout=timeout)
        path = path or parts.path + ("?" + parts.query if parts.query else "")
    try:
        connection.request("POST", path, body=body, headers=headers)
        response = connection.getresponse()
        reply = response.read(4096)
        if response.status >= 300:
            raise Refused(response.status, reply[:300].decode("utf-8", "replace").strip())
    finally:
        connection.close()
