"""Small network look-ups the launcher needs (stdlib only; nothing is sent anywhere).

``source_address(host)`` asks the kernel's routing table which local address reaches ``host`` (a UDP
``connect`` only selects a route); ``interface_of(address)`` names the interface that holds an address,
which the node agent gives gloo as ``GLOO_SOCKET_IFNAME`` (gloo otherwise binds to whatever this
machine's host name resolves to, which on multi-homed nodes or in namespaces is often the wrong network).
"""

from __future__ import annotations

import fcntl
import socket
import struct

_SIOCGIFADDR = 0x8915


def resolve(host: str) -> str:
    """The IPv4 address of ``host`` (an address is returned unchanged)."""
    return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]


def source_address(host: str) -> str:
    """This machine's address on the route to ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((resolve(host), 9))  # no packet: connect() on UDP only picks the route
        return str(probe.getsockname()[0])


def interface_addresses() -> dict[str, str]:
    """``{interface name: IPv4 address}`` for the interfaces that have one (Linux ioctl)."""
    found: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def interface_of(address: str) -> str | None:
    """The interface holding ``address``, or None when none does (or the platform cannot say)."""
    try:
        return next((name for name, addr in interface_addresses().items() if addr == address), None)
    except OSError:
        return None


def interface_towards(host: str) -> str | None:
    """The interface this machine uses to reach ``host``."""
    try:
        return interface_of(source_address(host))
    except OSError:
        return None


def is_this_machine(host: str) -> bool:
    """Whether ``host`` names this machine (its name, a loopback or an own address); OSError if it does not resolve."""
    if host in ("localhost", socket.gethostname()):
        return True
    address = resolve(host)
    return address.startswith("127.") or address in interface_addresses().values()


def port_is_free(port: int) -> bool:
    """Whether a TCP server could listen on ``port`` on all interfaces of this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])
