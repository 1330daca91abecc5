"""Refuse, and record, every connection a worker tries beyond this machine (loopback and local sockets pass).

    import network_guard
    network_guard.install()
    ...
    network_guard.attempts   # ["('1.2.3.4', 443)", "resolve www.comet.com", ...]
"""

import ipaddress
import socket

attempts = []


def _local(address) -> bool:
    if isinstance(address, (str, bytes)):  # AF_UNIX
        return True
    host = address[0]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def install() -> None:
    connect_, connect_ex_, getaddrinfo_ = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo

    def connect(self, address):
        if not _local(address):
            attempts.append(repr(address))
            raise OSError(f"network refused in this test: {address!r}")
        return connect_(self, address)

    def connect_ex(self, address):
        if not _local(address):
            attempts.append(repr(address))
            return 111
        return connect_ex_(self, address)

    def getaddrinfo(host, *args, **kwargs):
        name = host.decode() if isinstance(host, bytes) else host
        if name not in (None, "localhost") and not _local((name, 0)):
            attempts.append(f"resolve {name}")
            raise socket.gaierror(f"network refused in this test: {name}")
        return getaddrinfo_(host, *args, **kwargs)

    socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = connect, connect_ex, getaddrinfo
