"""The worker's Unix socket: binding it safely, the peer's credentials, a hung-up peer."""

from __future__ import annotations

import grp
import os
import select
import socket
import stat
import struct
from pathlib import Path

from dflash.errors import DFlashError


def bind_socket(path: Path, socket_group: str | None) -> socket.socket:
    """Listen on a Unix socket created 0660 (group `socket_group`), replacing only a stale one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise DFlashError("socket_in_use", f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # stale: nobody listens there
        else:
            raise DFlashError("socket_in_use", f"another worker is already listening on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o117)  # created 0660: never a moment with wider permissions
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o660)
    if socket_group:
        group = str(socket_group)
        os.chown(path, -1, int(group) if group.isdigit() else grp.getgrnam(group).gr_gid)
    # A burst of callers (one per PostgreSQL backend) must queue, not be refused: the
    # kernel caps this at net.core.somaxconn.
    sock.listen(socket.SOMAXCONN)
    sock.settimeout(0.2)
    return sock


def peer_creds(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end (SO_PEERCRED)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)


def hung_up(conn: socket.socket) -> bool:
    readable, _, _ = select.select([conn], [], [], 0)
    if not readable:
        return False
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
