"""A real S3 server for the tests: s3proxy 2.6.0 with its filesystem backend.

The jar (Maven ``org.gaul:s3proxy:2.6.0``, classifier ``jar-with-dependencies``) is
looked up in ``$FASTPERSIST_S3PROXY_JAR``, then in ``.ci-cache/`` at the repository
root (where ``.ci/run`` fetches it); when missing there it is fetched into
``.ci-cache/`` with ``mvn dependency:copy`` (:func:`fetch_jar`). The server listens on
a free port of 127.0.0.1, stores its buckets under a temporary directory, and checks
AWS signatures (v2 or v4) against fixed credentials (:data:`ACCESS_KEY`,
:data:`SECRET_KEY`), so that wrong credentials are refused as on a real store.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

VERSION = "2.6.0"
ARTIFACT = f"org.gaul:s3proxy:{VERSION}:jar:jar-with-dependencies"
JAR_NAME = f"s3proxy-{VERSION}-jar-with-dependencies.jar"
ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".ci-cache"
ACCESS_KEY = "fastpersist-test"
SECRET_KEY = "fastpersist-test-secret"
REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fetch_jar(cache: Path = CACHE) -> Path:
    """The s3proxy jar, fetched into ``cache`` with Maven when it is not there yet."""
    env = os.environ.get("FASTPERSIST_S3PROXY_JAR")
    if env:
        if not Path(env).is_file():
            raise FileNotFoundError(f"FASTPERSIST_S3PROXY_JAR={env!r} is not a file")
        return Path(env)
    jar = cache / JAR_NAME
    if jar.is_file():
        return jar
    mvn = shutil.which("mvn")
    if mvn is None:
        raise FileNotFoundError(
            f"{jar} is missing and Maven (mvn) is not installed to fetch {ARTIFACT}; run "
            f"`mvn dependency:copy -Dartifact={ARTIFACT} -DoutputDirectory=.ci-cache` on a machine with Maven")
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([mvn, "-q", "dependency:copy", f"-Dartifact={ARTIFACT}", f"-DoutputDirectory={cache}"],
                   check=True, cwd=cache, timeout=600)
    if not jar.is_file():
        raise FileNotFoundError(f"mvn dependency:copy of {ARTIFACT} did not produce {jar}")
    return jar


@dataclass
class S3Server:
    """A running s3proxy: its endpoint and the credentials it accepts."""

    endpoint: str
    access_key: str
    secret_key: str
    region: str
    datadir: Path
    proc: subprocess.Popen

    def env(self, endpoint: Optional[str] = None) -> dict[str, str]:
        """The standard AWS variables that point a client at this server."""
        return {
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(workdir: Path, jar: Optional[Path] = None, timeout: float = 90.0) -> S3Server:
    """Start s3proxy on a free port with its data under ``workdir``; wait until it answers."""
    java = shutil.which("java")
    if java is None:
        raise FileNotFoundError("java is not installed")
    jar = jar or fetch_jar()
    datadir = workdir / "data"
    datadir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    props = workdir / "s3proxy.properties"
    props.write_text(
        f"s3proxy.endpoint={endpoint}\n"
        "s3proxy.authorization=aws-v2-or-v4\n"
        f"s3proxy.identity={ACCESS_KEY}\n"
        f"s3proxy.credential={SECRET_KEY}\n"
        "jclouds.provider=filesystem\n"
        f"jclouds.filesystem.basedir={datadir}\n"
    )
    log = open(workdir / "s3proxy.log", "wb")
    proc = subprocess.Popen([java, "-jar", str(jar), "--properties", str(props)], stdout=log,
                            stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"s3proxy exited with {proc.returncode}: {(workdir / 's3proxy.log').read_text()[-2000:]}")
        try:
            urllib.request.urlopen(endpoint + "/", timeout=2)
        except urllib.error.HTTPError:
            break  # 403 to an anonymous request: it is up
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"s3proxy did not answer on {endpoint} within {timeout} s")
            time.sleep(0.25)
            continue
        break
    return S3Server(endpoint, ACCESS_KEY, SECRET_KEY, REGION, datadir, proc)
