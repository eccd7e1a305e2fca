"""An S3-compatible server on 127.0.0.1 (moto's server mode) for the whole session, buckets on it, and
helpers to copy checkpoints to object stores. The fixtures are imported by `tests/s3/conftest.py` and by
`tests/docs/conftest.py` (whose examples save to S3); a session without moto or s3fs skips what needs them.

ckptctl is pointed at it the way a user points it at MinIO or any S3-compatible store: the standard AWS
variables (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, ...), read by botocore. Nothing here talks to any
other host: the instance metadata service and shared config files are switched off, so that a missing
credential is missing rather than looked up on the network.
"""

from __future__ import annotations

import functools
import logging
import secrets
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

#: Credentials moto accepts while its authentication is off (the default).
FAKE_KEY = "testing"
#: AWS settings that would send a request elsewhere or change who we are; cleared for the session.
_CLEARED = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "FSSPEC_S3_ENDPOINT_URL",
)


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    #: One botocore client of the session, to the server itself whatever a test sets (buckets for the tests).
    client: Any = field(repr=False, compare=False)

    def make_bucket(self, name: str) -> str:
        """A new, empty bucket: `s3://NAME`."""
        self.client.create_bucket(Bucket=name)
        return f"s3://{name}"

    def filesystem(self) -> Any:
        """A fresh s3fs filesystem with the session's settings (for test set-up, not for ckptctl)."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)

    def upload(self, local: Path, url: str) -> str:
        """Copy a local folder to `url` (no trailing slash) and return `url`."""
        fs = self.filesystem()
        fs.put(str(local).rstrip("/") + "/", url.removeprefix("s3://") + "/", recursive=True)
        return url


def reset_s3fs() -> None:
    """Forget cached s3fs clients, so that the next call reads the credentials from the environment again."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")

    import botocore.loaders
    import botocore.session
    import moto.backends

    patch = pytest.MonkeyPatch()
    # Costs of the test process alone, none of them a behaviour a test checks:
    # - one loader of botocore's data files for every botocore session made here (s3fs makes one a filesystem,
    #   and these tests make many): each new session otherwise reads and parses the same JSON models again,
    #   some 90 ms of CPU a client, which was a sixth of these tests' CPU;
    patch.setattr(botocore.session, "create_loader", functools.lru_cache(maxsize=None)(botocore.loaders.create_loader))
    # - moto's server lists and stats its own package's ~180 folders twice a request to find the service
    #   (`list_of_moto_modules`), which never changes in a session;
    modules = tuple(moto.backends.list_of_moto_modules())
    patch.setattr(moto.backends, "list_of_moto_modules", lambda: modules)
    # - werkzeug logs every request at INFO (formatted, sent to each handler pytest captures with).
    werkzeug_log = logging.getLogger("werkzeug")
    werkzeug_level = werkzeug_log.level
    werkzeug_log.setLevel(logging.WARNING)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    nothing = str(tmp_path_factory.mktemp("aws") / "absent")
    for name in _CLEARED:
        patch.delenv(name, raising=False)
    patch.setenv("AWS_ENDPOINT_URL", endpoint)
    patch.setenv("AWS_ACCESS_KEY_ID", FAKE_KEY)
    patch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_KEY)
    patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    patch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    patch.setenv("AWS_CONFIG_FILE", nothing)
    patch.setenv("AWS_SHARED_CREDENTIALS_FILE", nothing)
    patch.setenv("NO_PROXY", "127.0.0.1")
    reset_s3fs()
    client = botocore.session.Session().create_client(
        "s3", endpoint_url=endpoint, aws_access_key_id=FAKE_KEY, aws_secret_access_key=FAKE_KEY
    )
    try:
        yield S3Server(endpoint, client)
    finally:
        reset_s3fs()
        server.stop()
        patch.undo()
        werkzeug_log.setLevel(werkzeug_level)


@pytest.fixture
def bucket(s3_server: S3Server) -> str:
    """A new, empty bucket: `s3://NAME`."""
    return s3_server.make_bucket(f"ckpt-{secrets.token_hex(4)}")


@pytest.fixture(scope="session")
def memory_store() -> Iterator[str]:
    """A private prefix of fsspec's in-process memory filesystem: `memory://NAME`."""
    import fsspec

    name = f"ckptctl-{secrets.token_hex(4)}"
    fs = fsspec.filesystem("memory")
    yield f"memory://{name}"
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


def copy_to_store(local: Path, url: str) -> str:
    """Copy a local folder to any fsspec URL (no trailing slash) and return `url`."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    fs.put(str(local).rstrip("/") + "/", path.rstrip("/") + "/", recursive=True)
    return url


@pytest.fixture(scope="session")
def stores(s3_server: S3Server, memory_store: str) -> dict[str, str]:
    """A bucket on the S3 server and a memory:// prefix, by scheme."""
    return {"s3": s3_server.make_bucket(f"ckpt-{secrets.token_hex(4)}"), "memory": memory_store}


class CountingProxy:
    """A TCP relay on 127.0.0.1 in front of the S3 server that counts the bytes the server sends: what
    a command really transferred (payloads, HTTP headers and listings included)."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("http://").partition(":")
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self.received = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._upstream)
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, count: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if count:
                    with self._lock:
                        self.received += len(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def reset(self) -> None:
        with self._lock:
            self.received = 0

    def close(self) -> None:
        self._closed = True
        self._listener.close()


@pytest.fixture
def counting_proxy(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[CountingProxy]:
    """Point ckptctl (through AWS_ENDPOINT_URL, as a user would) at a byte-counting relay to the server."""
    proxy = CountingProxy(s3_server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    reset_s3fs()
    try:
        yield proxy
    finally:
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
        reset_s3fs()
        proxy.close()
