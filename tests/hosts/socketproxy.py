"""What systemd does for chorus-actions-nats@.socket and its service, without systemd: run inside the actions unit's
private network namespace, bind the socket there (ListenStream=127.0.0.1:4222), move this process into the host's
network namespace (the proxy service runs in the host's network) and exec systemd-socket-proxyd with the socket
passed as systemd passes it (fd 3, LISTEN_FDS=1, LISTEN_PID of this very process, which exec keeps).

    python socketproxy.py HOST:PORT HOST_NETNS PROXYD ARGS...
"""

from __future__ import annotations

import ctypes
import os
import socket
import sys

CLONE_NEWNET = 0x40000000


def main() -> None:
    listen, netns, *proxy = sys.argv[1:]
    host, port = listen.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, int(port)))
    sock.listen(128)
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), f"setns into {netns} failed")
    os.close(fd)
    os.dup2(sock.fileno(), 3)
    os.set_inheritable(3, True)
    env = {**os.environ, "LISTEN_FDS": "1", "LISTEN_PID": str(os.getpid())}
    os.execve(proxy[0], proxy, env)


if __name__ == "__main__":
    main()
