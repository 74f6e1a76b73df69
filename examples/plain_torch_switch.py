"""Plain PyTorch with the no-code switch: FASTPERSIST_PATCH_TORCH_SAVE=1.

The training code below is ordinary PyTorch: it calls ``torch.save`` / ``torch.load``
and never imports fastpersist. This script runs it twice, in two child processes
that differ only in the environment: once stock, once with
``FASTPERSIST_PATCH_TORCH_SAVE=1`` (fastpersist's start-up hook then routes
``torch.save``/``torch.load`` through fastpersist). Each child trains a small MLP
with Adam on CPU, checkpoints every few steps, then resumes from the last
checkpoint in a fresh model and optimizer and checks it got the same state.
Checkpoint times are durable in both: the training code fsyncs the file and its
directory after ``torch.save`` (fastpersist has already done so; the extra fsync
then costs next to nothing).

    python examples/plain_torch_switch.py                 # tiny, a few seconds
    python examples/plain_torch_switch.py --hidden 2048   # bigger checkpoints
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def durable_save(obj, path):
    import torch

    torch.save(obj, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def child(args: argparse.Namespace) -> dict:
    import torch

    torch.manual_seed(0)

    def make():
        model = torch.nn.Sequential(
            torch.nn.Linear(64, args.hidden), torch.nn.ReLU(),
            torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
            torch.nn.Linear(args.hidden, 8),
        )
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    model, opt = make()
    x, y = torch.randn(256, 64), torch.randn(256, 8)
    times, path = [], None
    for step in range(1, args.steps + 1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.every == 0:
            path = os.path.join(args.dir, f"step{step}.pt")
            t0 = time.perf_counter()
            durable_save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, path)
            times.append(time.perf_counter() - t0)

    # Resume in a fresh model/optimizer from the last checkpoint.
    ck = torch.load(path)
    model2, opt2 = make()
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["optimizer"])
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    loss = torch.nn.functional.mse_loss(model2(x), y)
    opt2.zero_grad()
    loss.backward()
    opt2.step()
    with open(path, "rb") as f:
        import zipfile

        z = zipfile.ZipFile(f)
        align = [z.read(n).decode() for n in z.namelist() if n.endswith(".storage_alignment")]
    return {
        "patched": hasattr(torch.save, "_fastpersist_original"),
        "save_s": times,
        "bytes": os.path.getsize(path),
        "resumed_step": ck["step"],
        "resume_equal": same,
        "storage_alignment": align[0] if align else None,
    }


def run(switch: bool, args: argparse.Namespace, directory: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "FASTPERSIST_PATCH_TORCH_SAVE"}
    if switch:
        env["FASTPERSIST_PATCH_TORCH_SAVE"] = "1"
    os.makedirs(directory, exist_ok=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--dir", directory, "--hidden", str(args.hidden),
           "--steps", str(args.steps), "--every", str(args.every)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256, help="MLP width (checkpoint ~ 3 * 4 * hidden^2 bytes)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        stock = run(False, args, os.path.join(tmp, "stock"))
        fast = run(True, args, os.path.join(tmp, "fastpersist"))
    if not fast["patched"]:
        print("note: torch.save was not patched in the child: is fastpersist installed with pip "
              "(the start-up hook ships with the package)?", file=sys.stderr)
    for name, r in (("torch.save + fsync", stock), ("FASTPERSIST_PATCH_TORCH_SAVE=1", fast)):
        print(f"{name:32s} checkpoint {r['bytes'] / 2**20:7.1f} MiB  "
              f"median {statistics.median(r['save_s']) * 1e3:8.1f} ms/save over {len(r['save_s'])} saves  "
              f"(storage alignment {r['storage_alignment']}, patched={r['patched']}, "
              f"resumed at step {r['resumed_step']}, state equal: {r['resume_equal']})")
    ok = stock["resume_equal"] and fast["resume_equal"] and fast["patched"] and fast["storage_alignment"] == "4096"
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
