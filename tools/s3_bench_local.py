"""``fastpersist bench save`` against a local s3proxy, in one command.

    python tools/s3_bench_local.py [--https] [bench save options...]
    python tools/s3_bench_local.py --size 256MiB --repeat 4 --peers boto3,s3torchconnector --json s3bench.json

Starts s3proxy (tests/s3server.py: filesystem backend in a temporary directory; the jar
from .ci-cache/ or Maven), creates a bucket, runs ``python -m fastpersist bench save
--dir s3://bench/run`` with the other arguments in a child process whose AWS variables
point at the server, and stops the server. The peers that are not installed
(s3torchconnector: ``pip install s3torchconnector``) are reported as unavailable.
"""
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import s3server  # noqa: E402


def main(argv: list[str]) -> int:
    tls = "--https" in argv
    rest = [a for a in argv if a != "--https"]
    work = pathlib.Path(tempfile.mkdtemp(prefix="s3bench-"))
    srv = s3server.start(work, tls=tls)
    try:
        env = dict(os.environ, **srv.env())
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
            env.pop(name, None)
        subprocess.run([sys.executable, "-c", "from fastpersist import s3client; s3client.client().create_bucket(Bucket='bench')"],
                       env=env, check=True)
        cmd = [sys.executable, "-m", "fastpersist", "bench", "save", "--dir", "s3://bench/run", *rest]
        return subprocess.run(cmd, env=env).returncode
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
