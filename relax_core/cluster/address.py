"""The address a Ray node advertises, and the interface NCCL and Gloo use with it.

With `cluster.network.interface` set (names or patterns, in order), each node
takes the first of its own interfaces that matches and has an IPv4 address.
Unset, the node's hostname decides, unless it resolves to a loopback address
(Debian and Ubuntu map the hostname to 127.0.1.1 in /etc/hosts): then the
interface that routes to the head, the default route's, or the first other
interface that is up; a node of a multi-node job never advertises loopback.
Where Relax chose by interface, NCCL and Gloo are told that interface, so the
collectives run where Ray's address points.
"""

from __future__ import annotations

import fcntl
import fnmatch
import ipaddress
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

SIOCGIFFLAGS, SIOCGIFADDR = 0x8913, 0x8915
IFF_UP, IFF_LOOPBACK = 0x1, 0x8
NOT_AUTO = ("docker", "virbr", "veth")  # container bridges: never picked unless named (NCCL skips docker* too)


@dataclass(frozen=True)
class NodeAddress:
    address: str
    interface: str | None  # the interface Relax chose it by; None when the hostname's address is used as is

    def socket_env(self) -> dict[str, str]:
        """NCCL_SOCKET_IFNAME (`=name`: this exact interface) and GLOO_SOCKET_IFNAME for the chosen interface."""
        if self.interface is None:
            return {}
        return {"NCCL_SOCKET_IFNAME": f"={self.interface}", "GLOO_SOCKET_IFNAME": self.interface}


def _ioctl(request: int, interface: str) -> bytes | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            return fcntl.ioctl(sock.fileno(), request, struct.pack("256s", interface[:15].encode()))
        except OSError:
            return None


def ipv4_address(interface: str) -> str | None:
    """The IPv4 address of `interface`, or None when it has none (or does not exist)."""
    packed = _ioctl(SIOCGIFADDR, interface)
    return socket.inet_ntoa(packed[20:24]) if packed else None


def _flags(interface: str) -> int:
    packed = _ioctl(SIOCGIFFLAGS, interface)
    return struct.unpack("H", packed[16:18])[0] if packed else 0


def interfaces() -> list[str]:
    """This node's network interfaces, in the kernel's order."""
    return [name for _, name in socket.if_nameindex()]


def matching_interface(patterns: list[str]) -> NodeAddress | None:
    """The first interface, pattern by pattern, that matches and has an IPv4 address."""
    names = interfaces()
    for pattern in patterns:
        for name in sorted(fnmatch.filter(names, pattern)):
            address = ipv4_address(name)
            if address:
                return NodeAddress(address, name)
    return None


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def _holding(address: str) -> NodeAddress | None:
    """The interface that holds `address` (a non-loopback one), if any."""
    if _is_loopback(address):
        return None
    return next((NodeAddress(address, name) for name in interfaces() if ipv4_address(name) == address), None)


def route_to(host: str) -> NodeAddress | None:
    """The interface this node's packets to `host` leave by (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, 9))
        except OSError:
            return None
        return _holding(sock.getsockname()[0])


def default_route() -> NodeAddress | None:
    """The interface of the default IPv4 route with the lowest metric (from /proc/net/route)."""
    try:
        rows = [line.split() for line in Path("/proc/net/route").read_text().splitlines()[1:]]
    except OSError:
        return None
    defaults = sorted((int(row[6]), row[0]) for row in rows if len(row) > 6 and row[1] == "00000000"
                      and int(row[3], 16) & IFF_UP)  # RTF_UP has IFF_UP's value
    for _, name in defaults:
        address = ipv4_address(name)
        if address and not _is_loopback(address):
            return NodeAddress(address, name)
    return None


def first_up_interface() -> NodeAddress | None:
    for name in interfaces():
        flags = _flags(name)
        if flags & IFF_UP and not flags & IFF_LOOPBACK and not name.startswith(NOT_AUTO):
            address = ipv4_address(name)
            if address and not _is_loopback(address):
                return NodeAddress(address, name)
    return None


def hostname_address() -> str | None:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def pick_address(patterns: list[str] | None, *, head: str | None, multi_node: bool) -> NodeAddress:
    """The address this node advertises (see the module docstring); RuntimeError names what to set when none fits.

    Args:
        patterns: `cluster.network.interface`.
        head: the head's host, on the other nodes (the route to it is preferred).
        multi_node: whether other nodes must reach this one (then loopback never fits).
    """
    host = socket.gethostname()
    if patterns:
        picked = matching_interface(patterns)
        if picked is None:
            raise RuntimeError(f"cluster.network.interface: none of {patterns} is an interface with an IPv4 "
                               f"address on {host} (it has: {', '.join(interfaces())})")
        return picked
    resolved = hostname_address()
    if resolved and not _is_loopback(resolved):
        return NodeAddress(resolved, None)
    picked = (route_to(head) if head else None) or default_route() or first_up_interface()
    if picked:
        return picked
    if multi_node or not resolved:
        raise RuntimeError(f"the hostname {host} resolves to {resolved or 'nothing'} and no other interface has "
                           f"an IPv4 address: set cluster.network.interface to the interfaces the nodes reach "
                           f"each other over (e.g. [ib0, 'eth*']; this node has: {', '.join(interfaces())})")
    return NodeAddress(resolved, None)
