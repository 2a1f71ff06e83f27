"""A real PostgreSQL for integration tests and SQL benchmarks (`pg` fixture in tests/conftest.py).

Where a Docker engine answers, testcontainers runs the image from docker/postgres.Dockerfile
(pgvector + plpython3 + the extension). Otherwise (here: no Docker engine) a throwaway
cluster is made with initdb + pg_ctl in a temp directory, as the unprivileged `postgres`
user when the tests run as root (initdb refuses root). The extension must be installed
into the local server (`make install-extension`).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


def pg_bindir() -> Path:
    return Path(subprocess.check_output(["pg_config", "--bindir"], text=True).strip())


def docker_engine_available() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    host: str  # a socket directory or a host name
    port: int
    superuser: str
    os_user: str  # the OS user the server runs as (who connects to the worker socket)
    stop: callable
    socket_dir: Path  # where tests put worker sockets the server can reach
    server_socket_dir: str  # the same directory as the server sees it

    def server_path(self, host_path: Path) -> str:
        return f"{self.server_socket_dir}/{Path(host_path).relative_to(self.socket_dir)}"

    def dsn(self, dbname: str = "postgres", user: str | None = None) -> str:
        return f"host={self.host} port={self.port} dbname={dbname} user={user or self.superuser}"


def start_local_cluster() -> Server:
    root = os.geteuid() == 0
    os_user = "postgres" if root else pwd.getpwuid(os.geteuid()).pw_name
    base = Path(tempfile.mkdtemp(prefix="dflash-pg-"))
    os.chmod(base, 0o755)
    data, sockdir, workerdir = base / "data", base / "sock", base / "worker"
    sockdir.mkdir()
    workerdir.mkdir(mode=0o755)
    os.chmod(workerdir, 0o755)
    if root:
        shutil.chown(base, os_user)
        shutil.chown(sockdir, os_user)
    run_as = ["runuser", "-u", os_user, "--"] if root else []
    bindir = pg_bindir()
    subprocess.run(
        [*run_as, str(bindir / "initdb"), "-D", str(data), "-U", os_user, "--auth=trust", "-E", "UTF8",
         "--locale=C.UTF-8"],
        check=True, capture_output=True,
    )
    port = free_port()
    opts = f"-k {sockdir} -c listen_addresses='' -p {port} -c fsync=off"
    subprocess.run(
        [*run_as, str(bindir / "pg_ctl"), "-D", str(data), "-o", opts, "-l", str(base / "log"), "-w", "start"],
        check=True, capture_output=True,
    )

    def stop():
        subprocess.run([*run_as, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True)
        shutil.rmtree(base, ignore_errors=True)

    return Server(str(sockdir), port, os_user, os_user, stop, workerdir, str(workerdir))


def start_container(repo: Path) -> Server:
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.image import DockerImage

    image = DockerImage(path=str(repo), dockerfile_path="docker/postgres.Dockerfile", tag="dflash-pg:test")
    image.build()
    sockdir = Path(tempfile.mkdtemp(prefix="dflash-sock-"))
    os.chmod(sockdir, 0o777)
    port = free_port()
    container = (
        DockerContainer(str(image))
        .with_env("POSTGRES_HOST_AUTH_METHOD", "trust")
        .with_bind_ports(5432, port)
        .with_volume_mapping(str(sockdir), "/run/dflash", "rw")
    )
    container.start()
    for _ in range(120):
        if subprocess.run(["pg_isready", "-h", "127.0.0.1", "-p", str(port)], capture_output=True).returncode == 0:
            break
        time.sleep(0.5)

    def stop():
        container.stop()
        shutil.rmtree(sockdir, ignore_errors=True)

    return Server("127.0.0.1", port, "postgres", "postgres", stop, sockdir, "/run/dflash")


def start_server(repo: Path) -> Server:
    return start_container(repo) if docker_engine_available() else start_local_cluster()
