"""The Lighthouse address of a torchft job, checked before torchft's Manager is started with it.

torchft's Manager reports a bad address as an 83-line traceback ("failed to connect ... within timeout"),
and one that does not answer only after its retries (77 s and 1,319 lines for an unreachable host). So the
address (``fault_tolerance.lighthouse_address``, else ``TORCHFT_LIGHTHOUSE``) must first be an
``http://`` or ``https://`` URL with a host and a port in 1-65535, an IPv6 literal in brackets that
parses, printable characters only; its name must resolve and a TCP connection to it must open, both
within ``fault_tolerance.connect_timeout_seconds``. Anything else is one line naming the address
(shown with its control characters escaped), in at most that time.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from urllib.parse import urlsplit

from titanctl.errors import ConfigError, TitanError
from titanctl.safe_io import visible

SCHEMES = ("http", "https")


def check_lighthouse(address: str, timeout_s: float, source: str) -> None:
    """Refuse ``address`` (given by ``source``: the config key or the environment variable) unless it is
    a Lighthouse URL that answers a TCP connection within ``timeout_s``."""
    shown = visible(repr(address))
    hint = "give the Lighthouse as http://HOST:PORT (scripts/ft_local.py prints it)"
    if not address.isprintable():
        raise ConfigError(f"{source} = {shown} holds control characters; {hint}")
    try:
        parts = urlsplit(address)
        port = parts.port
    except ValueError as e:  # a broken IPv6 literal, a port that is no number or out of range
        raise ConfigError(f"{source} = {shown} is no URL ({e}); {hint}") from None
    if parts.scheme not in SCHEMES:
        raise ConfigError(f"{source} = {shown} has scheme {parts.scheme or 'none'!r}, not http or https; {hint}")
    host = parts.hostname
    if not host or port is None or port == 0:
        missing = "a host" if not host else "a port"
        raise ConfigError(f"{source} = {shown} names no {missing}; {hint}")
    if "[" in parts.netloc:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"{source} = {shown} holds an IPv6 literal that is no IPv6 address; {hint}") from None
    reason = _unreachable(host, port, timeout_s)
    if reason is not None:
        raise TitanError(f"the torchft Lighthouse {shown} ({source}) {reason}; start it first (scripts/ft_local.py), "
                         "or fix the address")


def _unreachable(host: str, port: int, timeout_s: float) -> str | None:
    """Why a TCP connection to host:port did not open within ``timeout_s``, or None. In a thread that is
    no longer waited for once the time is up: a name lookup ignores socket timeouts."""
    result: list[str] = []

    def probe() -> None:
        try:
            addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as e:
            result.append(f"names a host that does not resolve ({getattr(e, 'strerror', None) or e})")
            return
        errors = []
        for family, kind, proto, _, where in addresses:
            try:
                with socket.socket(family, kind, proto) as sock:
                    sock.settimeout(timeout_s)
                    sock.connect(where)
                result.append("")
                return
            except TimeoutError:
                errors.append(f"no answer within {timeout_s:g} s")
            except OSError as e:
                errors.append(e.strerror or type(e).__name__)
        result.append(f"refuses connections ({errors[0] if errors else 'no address'})")

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not result:
        return (f"does not answer within {timeout_s:g} s (fault_tolerance.connect_timeout_seconds)")
    return result[0] or None
