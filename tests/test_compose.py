"""The Compose stack end to end: docker/compose.yaml with the images `make images` built.

Up; one `dflash_generate` through the worker container (the real default models); one
generate-on-insert row filled by the worker container's queue consumer (as role
dflash_worker over the network); the containers' users, socket permissions and labels; down.
Runs on the containers back end (a Docker engine and the built images).

Then docker/compose.llamacpp.yaml, the worker in remote mode against a llama-server
container (`make images-llamacpp`: this machine's llama.cpp build and the default models):
the SQL answer equals the server's own for the same prompt ids, the row carries its
speculative counts, and an insert is filled through it. Where that image is not built it
skips, saying so (`make images-llamacpp`); CI builds it, and fails without it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
import uuid

import pytest

from dflash import __version__
from dflash.localpg import BACKEND_ENV, free_port
from tests.conftest import REPO, unavailable

COMPOSE_FILE = REPO / "docker" / "compose.yaml"
LLAMACPP_COMPOSE_FILE = REPO / "docker" / "compose.llamacpp.yaml"
LLAMACPP_IMAGE = "dflash-llamacpp"
UP_TIMEOUT_S = 900  # worker start-up: models plus the cost-curve measurement (minutes on a busy CPU)


def compose_command() -> list[str] | None:
    """Debian 12 ships docker-compose (v1); newer engines have the `docker compose` plugin."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return None


class Stack:
    def __init__(self, project: str, compose_file=COMPOSE_FILE, **env: str):
        self.base = [*compose_command(), "-f", str(compose_file), "-p", project]
        self.env = {**os.environ, "DFLASH_PG_PORT": str(free_port()), **env}

    def run(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        done = subprocess.run([*self.base, *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def container(self, service: str) -> str:
        return self.run("ps", "-q", service).strip()

    @staticmethod
    def health(container: str) -> str:
        """healthy, starting, unhealthy, or the state of a container that stopped."""
        state = subprocess.run(["docker", "inspect", "--format", "{{.State.Status}} {{.State.Health.Status}}",
                                container], capture_output=True, text=True).stdout.split()
        return state[1] if state[:1] == ["running"] and len(state) > 1 else (state[:1] or ["absent"])[0]

    def psql(self, sql: str) -> str:
        """The README's one-liner: psql inside the PostgreSQL container."""
        return self.run("exec", "-T", "postgres", "psql", "-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-c", sql).strip()


def needs_containers(pg_backend) -> None:
    if pg_backend != "containers" or compose_command() is None:
        # CI's local stage runs without it on purpose (its containers stage runs it).
        unavailable("the Compose stack", "it needs the containers back end (a Docker engine, `make images`, "
                    "docker-compose)", required_in_ci=os.environ.get(BACKEND_ENV) != "local")


def up(stack: Stack, services: tuple[str, ...]) -> None:
    """`up -d` and wait until every named service's container is healthy."""
    stack.run("up", "-d", "--no-build", timeout=UP_TIMEOUT_S)
    containers = [stack.container(s) for s in services]
    end = time.monotonic() + UP_TIMEOUT_S
    while (states := {stack.health(c) for c in containers}) != {"healthy"}:
        # "unhealthy" may only mean slow (a busy CPU stretches the worker's start-up past
        # its health check's start period); a container that stopped is a failure.
        if time.monotonic() > end or not states <= {"healthy", "starting", "unhealthy"}:
            raise AssertionError(f"stack not healthy ({states}):\n" + stack.run("logs", "--no-color", "--tail", "60"))
        time.sleep(3)


@pytest.fixture(scope="module")
def stack(pg_backend):
    needs_containers(pg_backend)
    stack = Stack(f"dflash-smoke-{uuid.uuid4().hex[:8]}")
    try:
        up(stack, ("postgres", "worker"))
        yield stack
    finally:
        stack.run("down", "-v", "--timeout", "30", check=False)


def test_generate_through_the_worker_container(stack):
    text = stack.psql("SELECT dflash_generate('Write a haiku about databases', max_new_tokens => 16)")
    assert text
    row = stack.psql("SELECT mode, status, target, drafter, new_tokens FROM dflash.generations ORDER BY id DESC LIMIT 1")
    assert row.split("|")[:3] == ["sync", "ok", "smollm2-135m-instruct"]
    assert 0 < int(row.split("|")[4]) <= 16


def test_insert_is_filled_by_the_worker_containers_queue_consumer(stack):
    stack.psql("CREATE TABLE questions (id serial PRIMARY KEY, question text, answer text)")
    stack.psql("SELECT dflash.enable_generation('questions', 'question', 'answer', '{\"max_new_tokens\": 12}')")
    stack.psql("INSERT INTO questions (question) VALUES ('What is a B-tree?')")
    end = time.monotonic() + 120
    while not (answer := stack.psql("SELECT coalesce(answer, '') FROM questions")):
        assert time.monotonic() < end, stack.run("logs", "--no-color", "--tail", "40", "worker")
        time.sleep(1)
    row = stack.psql("SELECT mode, status, output FROM dflash.generations WHERE source_table = 'questions'::regclass")
    assert row.split("|", 2) == ["trigger", "ok", answer]
    assert stack.psql("SELECT count(*) FROM dflash.queue") == "0"


def test_containers_run_unprivileged_with_a_group_socket_and_labels(stack):
    assert stack.run("exec", "-T", "worker", "id", "-un").strip() == "dflash"
    assert stack.run("exec", "-T", "postgres", "id", "-un").strip() == "postgres"
    sock = stack.run("exec", "-T", "worker", "stat", "-c", "%U %G %a", "/run/dflash/worker.sock").split()
    assert sock == ["dflash", "dflash-socket", "660"]
    for service in ("postgres", "worker"):
        labels = json.loads(subprocess.run(
            ["docker", "inspect", "--format", "{{json .Config.Labels}}", stack.container(service)],
            capture_output=True, text=True, check=True).stdout)
        assert labels["org.opencontainers.image.version"] == __version__
        assert labels["org.opencontainers.image.revision"] not in ("", "unknown")


# --- the llama-server variant (docker/compose.llamacpp.yaml) -------------------------------------


@pytest.fixture(scope="module")
def llama_stack(pg_backend):
    needs_containers(pg_backend)
    if subprocess.run(["docker", "image", "inspect", LLAMACPP_IMAGE], capture_output=True).returncode != 0:
        unavailable("the llama-server Compose stack", f"no {LLAMACPP_IMAGE} image: `make images-llamacpp` builds it "
                    "(llama.cpp from the llama-cpp-python sdist first: 15-30 minutes on 2 cores, once; CI builds it)")
    port = free_port()
    stack = Stack(f"dflash-llama-{uuid.uuid4().hex[:8]}", LLAMACPP_COMPOSE_FILE, DFLASH_LLAMACPP_PORT=str(port))
    stack.url = f"http://127.0.0.1:{port}"
    try:
        up(stack, ("postgres", "llamacpp", "worker"))
        yield stack
    finally:
        stack.run("down", "-v", "--timeout", "30", check=False)


def llama_direct(stack: Stack, prompt: str, n: int, smol_dir) -> dict:
    """The llama-server container's own greedy answer for the prompt ids the worker sends."""
    from dflash.engine.engine import GenerationRequest
    from dflash.remote.engine import remote_engine

    ids = remote_engine(stack.url, smol_dir).prompt_ids(GenerationRequest(prompt=prompt))
    body = {"prompt": ids, "n_predict": n, "temperature": 0, "return_tokens": True, "stream": False}
    req = urllib.request.Request(stack.url + "/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_remote_worker_container_answers_as_llama_server(llama_stack, smol_dir):
    prompt = "Write a haiku about databases"
    text = llama_stack.psql(f"SELECT dflash_generate('{prompt}', max_new_tokens => 32, temperature => 0)")
    row = json.loads(llama_stack.psql(
        "SELECT json_build_object('output', output, 'output_ids', output_ids, 'backend', backend, 'status', status, "
        "'spec', proposers->'endpoint') FROM dflash.generations ORDER BY id DESC LIMIT 1"))
    want = llama_direct(llama_stack, prompt, 32, smol_dir)
    # psql -A -t prints the text as is (a trailing newline of the answer is stripped by .strip())
    assert text == want["content"].strip() and row["output"] == want["content"]
    assert row["output_ids"] == want["tokens"] and (row["backend"], row["status"]) == ("openai/llama.cpp", "ok")
    assert row["spec"]["drafted"] > 0 and 0 <= row["spec"]["accepted"] <= row["spec"]["drafted"]
    status = json.loads(llama_stack.psql("SELECT dflash_worker_status()"))
    assert status["endpoint"] == "http://llamacpp:8080" and status["target_backend"] == "openai/llama.cpp"


def test_insert_is_filled_through_the_llama_server_container(llama_stack):
    llama_stack.psql("CREATE TABLE questions (id serial PRIMARY KEY, question text, answer text)")
    llama_stack.psql("SELECT dflash.enable_generation('questions', 'question', 'answer', "
                     "'{\"max_new_tokens\": 12, \"temperature\": 0}')")
    llama_stack.psql("INSERT INTO questions (question) VALUES ('What is a B-tree?')")
    end = time.monotonic() + 120
    while not (answer := llama_stack.psql("SELECT coalesce(answer, '') FROM questions")):
        assert time.monotonic() < end, llama_stack.run("logs", "--no-color", "--tail", "40", "worker")
        time.sleep(1)
    row = llama_stack.psql("SELECT mode, status, backend FROM dflash.generations "
                           "WHERE source_table = 'questions'::regclass")
    assert row.split("|") == ["trigger", "ok", "openai/llama.cpp"]
