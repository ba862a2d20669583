"""Proof that a container's network is cut, without contacting any host outside this
machine: the probe (run inside the container) finds no default route and cannot
reach a listener this machine opens on its own non-loopback address, which the
machine itself can reach (so the listener is real)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager


def host_address() -> str:
    """This machine's primary non-loopback IPv4 address. The UDP "connect" sends no
    packet: it only asks the routing table which source address it would use (the
    address is from TEST-NET-1, reserved for documentation)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect(("192.0.2.1", 9))
        return sock.getsockname()[0]


@contextmanager
def host_listener() -> Iterator[tuple[str, int]]:
    """A TCP listener on this machine's own address; yields (address, port) after
    checking that this machine reaches it."""
    address = host_address()
    server = socket.create_server((address, 0))
    port = server.getsockname()[1]
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
                conn.close()
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        socket.create_connection((address, port), 3).close()  # reachable from here
        yield address, port
    finally:
        stop.set()
        thread.join()
        server.close()


# Runs inside the container: exit 0 only when the network is cut. Format with
# address and port of ``host_listener``.
PROBE = (
    "import socket, sys\n"
    "def routes(path, default):\n"
    "    try:\n"
    "        rows = open(path).read().splitlines()\n"
    "    except OSError:\n"
    "        return []\n"
    "    return [r for r in rows if default(r.split())]\n"
    # A default route through an interface other than loopback (a fresh namespace
    # has an IPv6 reject route on lo: not a way out).
    "v4 = routes('/proc/net/route', lambda f: len(f) > 1 and f[1] == '00000000' and f[0] != 'lo')\n"
    "v6 = routes('/proc/net/ipv6_route', lambda f: len(f) > 9 and f[0] == '0' * 32\n"
    "            and f[1] == '00' and f[-1] != 'lo' and not int(f[8], 16) & 0x0200)\n"
    "if v4 or v6:\n"
    "    print('default route:', v4, v6); sys.exit(4)\n"
    "try:\n"
    "    socket.create_connection(('{address}', {port}), 3)\n"
    "except OSError:\n"
    "    sys.exit(0)\n"
    "print('reached the host at {address}:{port}'); sys.exit(3)\n"
)
