"""A real PostgreSQL for integration tests, the demo and SQL benchmarks.

Two back ends give the same `Server` (tests/conftest.py's `pg_server` fixture; chosen with
DFLASH_TEST_BACKEND, see `choose_backend`):

- containers: the project's PostgreSQL image (docker/postgres.Dockerfile, `make images`)
  started with testcontainers, ready when the image's health check says so. The directory
  for worker sockets is a bind mount at /run/dflash, so backends in the container reach a
  worker running on the host (the tests' in-process worker); sockets there get the image's
  socket group, of which the container's `postgres` is a member.
- local: a throwaway cluster made with initdb + pg_ctl in a temp directory, as the
  unprivileged `postgres` user when running as root (initdb refuses root). The extension
  must be installed into the local server (`make install-extension`).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

BACKEND_ENV = "DFLASH_TEST_BACKEND"
BACKENDS = ("auto", "containers", "local")
# The image's group for worker sockets (docker/users.sh); its `postgres` is a member.
SOCKET_GROUP = "dflash-socket"
CONTAINER_SOCKET_DIR = "/run/dflash"
COMPOSE_FILE = Path("docker") / "compose.yaml"


def pg_bindir() -> Path:
    return Path(subprocess.check_output(["pg_config", "--bindir"], text=True).strip())


def docker_engine_available() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def docker_image_present(image: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode == 0


def compose_image(repo: Path, service: str) -> str:
    """The image name docker/compose.yaml gives a service (the one `make images` builds)."""
    import yaml

    return yaml.safe_load((repo / COMPOSE_FILE).read_text())["services"][service]["image"]


class BackendUnavailable(RuntimeError):
    """The requested back end cannot run here; the message says what is missing."""


def choose_backend(repo: Path) -> tuple[str, str]:
    """("containers" | "local", why). DFLASH_TEST_BACKEND=containers|local|auto (default
    auto: containers when a Docker engine answers and the PostgreSQL image is built).
    An explicit choice that cannot run raises BackendUnavailable instead of falling back."""
    choice = os.environ.get(BACKEND_ENV, "auto") or "auto"
    if choice not in BACKENDS:
        raise BackendUnavailable(f"{BACKEND_ENV}={choice!r}: expected one of {', '.join(BACKENDS)}")
    if choice == "local":
        return "local", f"{BACKEND_ENV}=local"
    missing = None
    if not docker_engine_available():
        missing = "no Docker engine answers (`docker info` fails)"
    elif not docker_image_present(image := compose_image(repo, "postgres")):
        missing = f"image {image} is not built (run `make images`)"
    if missing is None:
        return "containers", f"{BACKEND_ENV}={choice}"
    if choice == "containers":
        raise BackendUnavailable(f"{BACKEND_ENV}=containers, but {missing}")
    return "local", f"{BACKEND_ENV}=auto and {missing}"


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
    backend: str = "local"
    # The group to give worker sockets (mode 0660) so the server's backends may connect;
    # None: the socket's default group already works.
    socket_group: str | int | None = None

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

    return Server(str(sockdir), port, os_user, os_user, stop, workerdir, str(workerdir),
                  backend="local", socket_group=os_user if root else None)


def _use_reaper_only_if_present() -> None:
    """testcontainers' clean-up container (Ryuk) comes from a registry; where its image is
    not here (no registry), run without it: `stop` removes the container either way."""
    from testcontainers.core.config import testcontainers_config

    if not testcontainers_config.ryuk_disabled and not docker_image_present(testcontainers_config.ryuk_image):
        testcontainers_config.ryuk_disabled = True


def start_container(repo: Path, startup_timeout_s: float = 120) -> Server:
    """The project's PostgreSQL image via testcontainers (trust auth: a throwaway server)."""
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.wait_strategies import HealthcheckWaitStrategy

    _use_reaper_only_if_present()
    root = os.geteuid() == 0
    sockdir = Path(tempfile.mkdtemp(prefix="dflash-sock-"))
    os.chmod(sockdir, 0o755)  # the container's postgres only needs to reach sockets in it
    container = (
        DockerContainer(compose_image(repo, "postgres"))
        .with_env("POSTGRES_HOST_AUTH_METHOD", "trust")
        .with_command(["postgres", "-c", "fsync=off"])
        .with_volume_mapping(str(sockdir), CONTAINER_SOCKET_DIR, "rw")
        # Not root: sockets keep our own group, which the container's postgres then joins.
        .with_kwargs(group_add=[] if root else [str(os.getegid())])
        .waiting_for(HealthcheckWaitStrategy().with_startup_timeout(startup_timeout_s))
    )
    # A free host port on loopback only (trust auth); with_bind_ports takes no address.
    container.ports["5432/tcp"] = ("127.0.0.1", None)
    try:
        container.start()
        socket_group = None
        if root:
            entry = container.exec(["getent", "group", SOCKET_GROUP])
            if entry.exit_code != 0:
                raise RuntimeError(f"the PostgreSQL image has no group {SOCKET_GROUP} (docker/users.sh)")
            socket_group = int(entry.output.decode().split(":")[2])
    except BaseException:
        container.stop()
        shutil.rmtree(sockdir, ignore_errors=True)
        raise

    def stop():
        container.stop()
        shutil.rmtree(sockdir, ignore_errors=True)

    return Server("127.0.0.1", int(container.get_exposed_port(5432)), "postgres",
                  "postgres", stop, sockdir, CONTAINER_SOCKET_DIR, backend="containers", socket_group=socket_group)


def start_server(repo: Path, backend: str | None = None) -> Server:
    backend = backend or choose_backend(repo)[0]
    return start_container(repo) if backend == "containers" else start_local_cluster()
