"""Fixtures of the object-storage tests (``tests/test_s3_*.py`` import them by name): a
real s3proxy server (session), a fault proxy in front of it, a fresh bucket per test,
and the standard AWS variables pointing at them."""

from __future__ import annotations

import shutil
import uuid
from typing import Iterator
from urllib.parse import urlsplit

import pytest

import fastpersist

import s3faultproxy as faultproxy
import s3server


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[s3server.S3Server]:
    """s3proxy 2.6.0 on a free port, filesystem backend in a temporary directory.
    Skipped only where Java is absent."""
    if shutil.which("java") is None:
        pytest.skip("java is not installed: the object-storage tests need Java 17 to run s3proxy")
    server = s3server.start(tmp_path_factory.mktemp("s3proxy"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def fault_proxy(s3_server: s3server.S3Server) -> Iterator[faultproxy.FaultProxy]:
    u = urlsplit(s3_server.endpoint)
    proxy = faultproxy.FaultProxy((u.hostname or "127.0.0.1", u.port or 80))
    yield proxy
    proxy.close()


@pytest.fixture
def s3_env(s3_server: s3server.S3Server, monkeypatch: pytest.MonkeyPatch) -> s3server.S3Server:
    """The standard AWS variables point at the server (no profile, no config file)."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/fastpersist-test-aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/fastpersist-test-aws-credentials")
    return s3_server


@pytest.fixture
def boto(s3_env: s3server.S3Server):  # noqa: ANN201 - a botocore client
    """A plain boto3 client on the server, for the tests' own checks."""
    boto3 = pytest.importorskip("boto3", reason="the s3 extra is not installed: pip install 'fastpersist[s3]'")
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=s3_env.endpoint, aws_access_key_id=s3_env.access_key,
                        aws_secret_access_key=s3_env.secret_key, region_name=s3_env.region,
                        config=Config(s3={"addressing_style": "path"}, request_checksum_calculation="when_required",
                                      response_checksum_validation="when_required"))


@pytest.fixture
def bucket(boto) -> str:  # noqa: ANN001
    """A fresh, empty bucket."""
    name = f"fp-{uuid.uuid4().hex[:12]}"
    boto.create_bucket(Bucket=name)
    return name


@pytest.fixture
def faulty(fault_proxy: faultproxy.FaultProxy, s3_env: s3server.S3Server,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[faultproxy.FaultProxy]:
    """fastpersist's client goes through the fault proxy (armed by the test)."""
    fault_proxy.clear()
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.endpoint)
    yield fault_proxy
    fault_proxy.clear()


@pytest.fixture
def five_mib_parts() -> Iterator[None]:
    """Parts and ranges of 5 MiB (S3's minimum): several parts from small states."""
    with fastpersist.config.override(s3_part_size=5 << 20):
        yield
