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
    ca_bundle: Optional[Path] = None  #: the certificate to trust, for an HTTPS server


    def env(self, endpoint: Optional[str] = None) -> dict[str, str]:
        """The standard AWS variables that point a client at this server."""
        env = {
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }
        if self.ca_bundle is not None:
            env["AWS_CA_BUNDLE"] = str(self.ca_bundle)
            env["SSL_CERT_FILE"] = str(self.ca_bundle)
        return env

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def make_tls(workdir: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1: ``(Java keystore, PEM for AWS_CA_BUNDLE)``
    (password ``password``), made with the JDK's keytool."""
    keytool = shutil.which("keytool")
    if keytool is None:
        raise FileNotFoundError("keytool (from the JDK) is not installed")
    ks, pem = workdir / "keystore.jks", workdir / "ca.pem"
    subprocess.run([keytool, "-genkeypair", "-alias", "s3proxy", "-keyalg", "RSA", "-keysize", "2048", "-keystore",
                    str(ks), "-storepass", "password", "-keypass", "password", "-dname", "CN=127.0.0.1", "-ext",
                    "SAN=ip:127.0.0.1", "-validity", "30"], check=True, capture_output=True)
    cert = subprocess.run([keytool, "-exportcert", "-rfc", "-alias", "s3proxy", "-keystore", str(ks), "-storepass",
                           "password"], check=True, capture_output=True)
    pem.write_bytes(cert.stdout)
    return ks, pem


def _die_with_parent() -> None:
    """In the server's process before exec: SIGKILL it when the process that started it
    dies (a test run killed by a timeout or SIGKILL runs no teardown, and the server
    would outlive it, holding its port, memory and data directory)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the server is stopped by teardown only
        pass


def start(workdir: Path, jar: Optional[Path] = None, timeout: float = 90.0, tls: bool = False) -> S3Server:
    """Start s3proxy on a free port with its data under ``workdir``; wait until it answers.
    ``tls``: HTTPS with a self-signed certificate (:attr:`S3Server.ca_bundle`)."""
    java = shutil.which("java")
    if java is None:
        raise FileNotFoundError("java is not installed")
    jar = jar or fetch_jar()
    datadir = workdir / "data"
    datadir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    endpoint = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    props = workdir / "s3proxy.properties"
    ca_bundle = None
    listen = f"s3proxy.endpoint={endpoint}\n"
    if tls:
        ks, ca_bundle = make_tls(workdir)
        listen = (f"s3proxy.secure-endpoint={endpoint}\ns3proxy.keystore-path={ks}\n"
                  "s3proxy.keystore-password=password\n")
    props.write_text(
        listen +
        "s3proxy.authorization=aws-v2-or-v4\n"
        f"s3proxy.identity={ACCESS_KEY}\n"
        f"s3proxy.credential={SECRET_KEY}\n"
        "jclouds.provider=filesystem\n"
        f"jclouds.filesystem.basedir={datadir}\n"
    )
    log = open(workdir / "s3proxy.log", "wb")
    proc = subprocess.Popen([java, "-jar", str(jar), "--properties", str(props)], stdout=log,
                            stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    log.close()
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"s3proxy exited with {proc.returncode}: {(workdir / 's3proxy.log').read_text()[-2000:]}")
        try:
            ctx = None
            if ca_bundle is not None:
                import ssl

                ctx = ssl.create_default_context(cafile=str(ca_bundle))
            urllib.request.urlopen(endpoint + "/", timeout=2, context=ctx)
        except urllib.error.HTTPError:
            break  # 403 to an anonymous request: it is up
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"s3proxy did not answer on {endpoint} within {timeout} s")
            time.sleep(0.25)
            continue
        break
    return S3Server(endpoint, ACCESS_KEY, SECRET_KEY, REGION, datadir, proc, ca_bundle)
