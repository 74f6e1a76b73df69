"""Kill a child process at a chosen moment: the helper the SIGKILL tests of the adapters share."""

from __future__ import annotations

import os
import signal
import subprocess
import time


def sigkill_when_blocked(argv: list[str], root: str, env: dict, limit: float) -> None:
    """Run ``argv`` in ``root`` (output to ``root/child.log``) until it creates the file
    ``root/blocked`` (it then sits inside the write to be interrupted), SIGKILL it there,
    and check that the signal is what ended it. Fails with the child's log if it exits
    first, or if it does not get there within ``limit`` seconds."""
    blocked = os.path.join(root, "blocked")
    log_path = os.path.join(root, "child.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
        try:
            deadline = time.monotonic() + limit
            while not os.path.exists(blocked):
                assert proc.poll() is None, open(log_path).read()[-6000:]
                assert time.monotonic() < deadline, "the child never reached the blocking write"
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=60) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
