"""Two simulated hosts on one machine: network namespaces joined by a shaped veth pair (Linux, root).

Each host is a network namespace with one end of a veth pair; a token-bucket
filter (``tc qdisc ... tbf``) on both ends holds the link to the given rate in
each direction.  A rank started in a namespace reaches the other one only
through that link, so gloo's traffic crosses a real interface at a real rate.
Both namespaces share the machine's ``/dev/shm``, so runs over the link force
``MULTIGPU_TRANSPORT=gloo``.  Each namespace gets an ``/etc/netns/NAME/hosts``
(``ip netns exec`` puts it over ``/etc/hosts``) where this machine's hostname
is the namespace's address, so that libraries that bind to the hostname's
address (XLA's gloo collectives on JAX) use the link.

Used by ``benchmarks/bench_network.py`` and by the test of the multi-host
path; :class:`Link` removes both namespaces (and with them the veth pair)
whatever happens, including on SIGTERM.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["Link", "rate_bytes", "unavailable"]


def unavailable() -> str | None:
    """Why links cannot be simulated here, or ``None`` when they can."""
    if not sys.platform.startswith("linux"):
        return f"simulated links need Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return "simulated links need root (network namespaces and tc); run as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"simulated links need the `{tool}` command (iproute2)"
    return None


def rate_bytes(rate: str) -> float:
    """Bytes per second of a tc rate such as ``"1gbit"``, ``"100mbit"``, ``"10gbit"``."""
    text = rate.lower().strip()
    for suffix, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if text.endswith(suffix):
            try:
                return float(text[: -len(suffix)]) * scale / 8
            except ValueError:
                break
    raise ValueError(f"A link rate is a number with gbit, mbit or kbit, e.g. '1gbit'. Received: {rate!r}")


def _sh(*args: str) -> None:
    res = subprocess.run(list(args), capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed: {res.stderr.strip()}")


class Link:
    """Two namespaces ``hosts[0]``, ``hosts[1]`` joined by a veth pair shaped to ``rate``.

    Args:
        rate: tc's rate, e.g. ``"1gbit"``, ``"100mbit"``; ``None`` for no shaping.
        tag: a short name that keeps concurrent links apart (default: this process id).

    Use as a context manager; ``addresses[i]`` is host ``i``'s address and
    ``interfaces[i]`` its interface (for ``GLOO_SOCKET_IFNAME``).
    """

    def __init__(self, rate: str | None, tag: str | None = None) -> None:
        why = unavailable()
        if why:
            raise RuntimeError(why)
        if rate is not None:
            rate_bytes(rate)
        tag = tag or f"{os.getpid() % 100000}"
        self.rate = rate
        self.hosts = (f"mgA{tag}", f"mgB{tag}")
        self.interfaces = (f"mga{tag}", f"mgb{tag}")
        octet = os.getpid() % 200 + 20
        self.addresses = (f"10.{octet}.77.1", f"10.{octet}.77.2")
        self._old_term = None

    def __enter__(self) -> Link:
        self._old_term = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_term)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_term(self, signum, frame) -> None:
        self.close()
        raise SystemExit(128 + signum)

    def _create(self) -> None:
        a, b = self.hosts
        ia, ib = self.interfaces
        self.close(quiet=True)  # leftovers of a killed run with the same tag
        _sh("ip", "netns", "add", a)
        _sh("ip", "netns", "add", b)
        _sh("ip", "link", "add", ia, "type", "veth", "peer", "name", ib)
        for host, iface, addr in ((a, ia, self.addresses[0]), (b, ib, self.addresses[1])):
            _sh("ip", "link", "set", iface, "netns", host)
            _sh("ip", "-n", host, "addr", "add", f"{addr}/24", "dev", iface)
            _sh("ip", "-n", host, "link", "set", iface, "up")
            _sh("ip", "-n", host, "link", "set", "lo", "up")
            os.makedirs(f"/etc/netns/{host}", exist_ok=True)
            with open(f"/etc/netns/{host}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n{addr} {socket.gethostname()}\n")
            if self.rate:
                # burst: 10 ms at the rate (at least 256 KiB), above the kernel timer's tick at 10 Gbit/s
                burst = max(256 << 10, int(rate_bytes(self.rate) / 100))
                _sh("ip", "netns", "exec", host, "tc", "qdisc", "add", "dev", iface, "root", "tbf", "rate",
                    self.rate, "burst", str(burst), "latency", "200ms")

    def close(self, quiet: bool = False) -> None:
        """Removes both namespaces (the veth pair goes with them, or with its own removal if it never moved)."""
        subprocess.run(["ip", "link", "del", self.interfaces[0]], capture_output=True, check=False)
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", host], capture_output=True, check=False)
            shutil.rmtree(f"/etc/netns/{host}", ignore_errors=True)
        if self._old_term is not None and not quiet:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    def command(self, host: int, argv: Sequence[str], own_hosts_file: bool = False) -> list[str]:
        """``argv`` run inside host ``host``'s network namespace.

        Args:
            host: 0 or 1.
            argv: the command.
            own_hosts_file: through ``ip netns exec``, which also puts the namespace's hosts file over
                ``/etc/hosts`` (this machine's hostname is then the namespace's address) but mounts a
                ``/sys`` of its own, without the cgroup tree a throttled device (``cpu:1@0.5``) needs;
                otherwise through ``nsenter``, which enters the network namespace only.
        """
        if own_hosts_file:
            return ["ip", "netns", "exec", self.hosts[host], *argv]
        return ["nsenter", f"--net=/run/netns/{self.hosts[host]}", *argv]

    def rank_env(self, rank: int, port: int) -> dict:
        """torchrun's variables for rank ``rank`` of a two-host run whose rank 0 is on host 0."""
        return {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": self.addresses[0], "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": self.interfaces[rank], "MULTIGPU_TRANSPORT": "gloo"}
