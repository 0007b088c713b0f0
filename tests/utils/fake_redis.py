"""A loopback TCP server that answers Redis commands with canned replies.

For code that talks to server features no test server here has (the search module): a
test gives the raw replies a real server sends, byte for byte, and reads back the
commands the client sent. redis-py 8 speaks RESP3 unless told otherwise (it opens with
`HELLO 3`), so replies are RESP3. They are chosen by the command's first word, or its
first two (`MODULE LIST`); `HELLO` answers as Debian's Redis 7.0 does unless given, and
`CLIENT ...` (the rest of redis-py's handshake) +OK; anything else answers as Redis 7
does to a command it does not know.
"""

from __future__ import annotations

import io
import socketserver
import threading
from collections.abc import Mapping


def bulk(value: bytes | str) -> bytes:
    """A RESP bulk string."""
    raw = value.encode() if isinstance(value, str) else value
    return b"$%d\r\n%s\r\n" % (len(raw), raw)


def array(*items: bytes) -> bytes:
    """A RESP array of already-encoded items."""
    return b"*%d\r\n%s" % (len(items), b"".join(items))


def integer(value: int) -> bytes:
    """A RESP integer."""
    return b":%d\r\n" % value


def resp_map(*pairs: bytes) -> bytes:
    """A RESP3 map of already-encoded keys and values, alternating."""
    return b"%%%d\r\n%s" % (len(pairs) // 2, b"".join(pairs))


def hello(version: str, modules: bytes = b"*0\r\n") -> bytes:
    """A server's answer to `HELLO 3`."""
    return resp_map(bulk("server"), bulk("redis"), bulk("version"), bulk(version),
                    bulk("proto"), integer(3), bulk("id"), integer(7), bulk("mode"),
                    bulk("standalone"), bulk("role"), bulk("master"), bulk("modules"),
                    modules)  # fmt: skip


def unknown_command(words: list[bytes]) -> bytes:
    """Redis 7's error for a command it does not have."""
    return b"-ERR unknown command '%s', with args beginning with: \r\n" % words[0]


class FakeRedisServer:
    """Serves `replies` (command, upper case: "FT.SEARCH", "MODULE LIST" → raw RESP reply)
    on a free port."""

    def __init__(self, replies: Mapping[str, bytes]) -> None:
        self.replies = dict(replies)
        self.commands: list[list[bytes]] = []
        owner = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                while True:
                    words = _read_command(self.rfile)
                    if words is None:
                        return
                    owner.commands.append(words)
                    self.wfile.write(owner.reply_to(words))

        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        daemon=True)

    @property
    def url(self) -> str:
        """redis:// URL of the server."""
        host, port = self._server.server_address[:2]
        return f"redis://{host!s}:{port}/0"

    def reply_to(self, words: list[bytes]) -> bytes:
        """The canned reply for a command."""
        upper = [w.decode(errors="replace").upper() for w in words[:2]]
        for key in (" ".join(upper), upper[0]):
            if key in self.replies:
                return self.replies[key]
        if upper[0] == "HELLO":
            return hello("7.0.15")
        if upper[0] == "CLIENT":
            return b"+OK\r\n"
        return unknown_command(words)

    def sent(self, command: bytes) -> list[list[bytes]]:
        """The commands received whose first word is `command`."""
        return [words for words in self.commands if words[0].upper() == command]

    def __enter__(self) -> FakeRedisServer:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def _read_command(stream: io.BufferedIOBase) -> list[bytes] | None:
    """One RESP array of bulk strings from a client; None when it hung up."""
    try:
        header = stream.readline()
    except (TimeoutError, ConnectionError):
        return None
    if not header:
        return None
    if not header.startswith(b"*"):  # an inline command
        return header.strip().split()
    words = []
    for _ in range(int(header[1:])):
        size = int(stream.readline()[1:])
        words.append(stream.read(size + 2)[:-2])
    return words
