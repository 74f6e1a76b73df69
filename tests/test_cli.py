"""The ``fastpersist`` command line: info, verify exit codes, and benchmark smoke runs (tiny sizes)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import fastpersist
from fastpersist.bench.fio import fio_executable
from fastpersist.cli import main

MiB = 1 << 20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PATTERN = bytes(range(7, 251)) * 64  # 15.6 KB that occur nowhere else in a checkpoint


def _checkpoint(path: str) -> None:
    state = {
        "w": torch.frombuffer(bytearray(PATTERN), dtype=torch.uint8).clone(),
        "b": torch.arange(1000, dtype=torch.float32),
        "step": 7,
    }
    fastpersist.save(state, path)


def _flip_payload_byte(path: str) -> None:
    with open(path, "r+b") as f:
        data = f.read()
        at = data.find(PATTERN)
        assert at > 0, "payload not found in the file"
        f.seek(at + 1234)
        f.write(bytes([data[at + 1234] ^ 0xFF]))


# ---- info -------------------------------------------------------------------------


def test_info(tmp_path, capsys) -> None:
    assert main(["info", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"fastpersist {fastpersist.__version__}" in out
    for word in ("Engines", "psync", "cuFile", "O_DIRECT", "Filesystem", "CPU", torch.__version__):
        assert word in out


def test_info_json(tmp_path, capsys) -> None:
    from fastpersist import _native

    assert main(["info", "--dir", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["engines"] == list(_native.available_engines())
    assert data["engines_compiled"] == list(_native.ENGINES)
    assert data["direct_io"] == _native.direct_io_supported(str(tmp_path))
    assert data["directory"] == str(tmp_path)
    assert data["filesystem"] and data["torch_version"] == torch.__version__


def test_info_missing_dir_is_a_usage_error(tmp_path, capsys) -> None:
    assert main(["info", "--dir", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err


def test_python_dash_m_and_console_script(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "fastpersist", "info", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "O_DIRECT" in proc.stdout
    script = shutil.which("fastpersist", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("console script not installed (pip install -e . creates it)")
    proc = subprocess.run([script, "verify", str(tmp_path / "missing.pt")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "missing.pt" in proc.stderr


# ---- verify -----------------------------------------------------------------------


def test_verify_good_file(tmp_path, capsys) -> None:
    path = str(tmp_path / "ckpt.pt")
    _checkpoint(path)
    assert main(["verify", path]) == 0
    assert capsys.readouterr().out.startswith("OK:")


def test_verify_file_written_by_torch_save(tmp_path, capsys) -> None:
    path = str(tmp_path / "torch.pt")
    torch.save({"x": torch.arange(5000)}, path)
    assert main(["verify", path]) == 0


def test_verify_flipped_payload_byte(tmp_path, capsys) -> None:
    path = str(tmp_path / "ckpt.pt")
    _checkpoint(path)
    _flip_payload_byte(path)
    assert main(["verify", path]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAILED:") and "  - " in out


def test_verify_json(tmp_path, capsys) -> None:
    path = str(tmp_path / "ckpt.pt")
    _checkpoint(path)
    assert main(["verify", path, "--json"]) == 0
    good = json.loads(capsys.readouterr().out)
    assert good["ok"] is True and good["problems"] == [] and good["records"] > 0 and good["bytes"] > 0
    _flip_payload_byte(path)
    assert main(["verify", path, "--json"]) == 1
    bad = json.loads(capsys.readouterr().out)
    assert bad["ok"] is False and bad["problems"]


def test_verify_not_a_checkpoint(tmp_path, capsys) -> None:
    path = tmp_path / "junk.pt"
    path.write_bytes(bytes(range(256)) * 100)
    assert main(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAILED:") and "junk.pt" in out
    trunc = tmp_path / "trunc.pt"
    torch.save({"a": torch.arange(1000)}, trunc)
    trunc.write_bytes(trunc.read_bytes()[:-100])
    assert main(["verify", str(trunc)]) == 1


def test_verify_missing_file(tmp_path, capsys) -> None:
    assert main(["verify", str(tmp_path / "missing.pt")]) == 2
    err = capsys.readouterr().err
    assert "missing.pt" in err and "Traceback" not in err


def test_verify_debug_prints_traceback(tmp_path, capsys) -> None:
    assert main(["--debug", "verify", str(tmp_path / "missing.pt")]) == 2
    assert "Traceback" in capsys.readouterr().err
    assert main(["verify", "--debug", str(tmp_path / "missing.pt")]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_verify_directory_is_a_usage_error(tmp_path) -> None:
    assert main(["verify", str(tmp_path)]) == 2


# ---- verify: several paths and whole checkpoint directories (issue 23 case 13) -------


def _tree(root) -> dict:
    """A directory holding what Lightning, Accelerate, DeepSpeed and DCP leave, plus
    fastpersist's temporary files and staging directories; returns named paths."""
    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    from fastpersist.dcp import FastPersistWriter

    lt = root / "lightning"
    lt.mkdir()
    _checkpoint(str(lt / "epoch=0-step=2.ckpt"))
    (lt / ".epoch=1-step=4.ckpt.fp-tmp-123-0011223344556677-1a-0badcafe").write_bytes(b"half a checkpoint")
    (lt / "hparams.yaml").write_text("lr: 0.1\n")
    acc = root / "accelerate" / "checkpoint_0"
    acc.mkdir(parents=True)
    fastpersist.save({"w": torch.arange(64.0)}, str(acc / "model.safetensors"))
    _checkpoint(str(acc / "optimizer.bin"))
    torch.save({"rng": torch.get_rng_state()}, str(acc / "random_states_0.pkl"))
    safetensors.torch.save_file({"x": torch.ones(3)}, str(root / "accelerate" / "plain.safetensors"))
    staging = root / "accelerate" / ".fastpersist-staging-checkpoint_1-0123456789abcdef"
    staging.mkdir()
    (staging / "optimizer.bin").write_bytes(b"not finished")
    ds = root / "deepspeed"
    (ds / "global_step1").mkdir(parents=True)
    _checkpoint(str(ds / "global_step1" / "mp_rank_00_model_states.pt"))
    (ds / "latest").write_text("global_step1")
    (ds / "zero_to_fp32.py").write_text("print('convert')\n")
    dcp_dir = root / "dcp" / "step_3"
    dcp.save({"w": torch.arange(32.0)}, storage_writer=FastPersistWriter(str(dcp_dir)), no_dist=True)
    return {"ckpt": lt / "epoch=0-step=2.ckpt", "tmp": lt / ".epoch=1-step=4.ckpt.fp-tmp-123-0011223344556677-1a-0badcafe",
            "yaml": lt / "hparams.yaml", "st": acc / "model.safetensors", "bin": acc / "optimizer.bin",
            "pkl": acc / "random_states_0.pkl", "plain": root / "accelerate" / "plain.safetensors",
            "staging": staging, "ds": ds / "global_step1" / "mp_rank_00_model_states.pt", "latest": ds / "latest",
            "script": ds / "zero_to_fp32.py", "dcp": dcp_dir}


def test_verify_several_files_one_exit_status(tmp_path, capsys) -> None:
    a, b = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    _checkpoint(a)
    _checkpoint(b)
    assert main(["verify", a, b]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"OK: {a}:") and out[1].startswith(f"OK: {b}:"), out
    assert out[-1].startswith("2 checked: 2 OK, 0 FAILED"), out
    _flip_payload_byte(b)
    assert main(["verify", a, b]) == 1  # one FAILED: 1, whatever the others
    out = capsys.readouterr().out
    assert f"OK: {a}:" in out and f"FAILED: {b}:" in out
    assert main(["verify", a, str(tmp_path / "missing.pt")]) == 2  # one unreadable, none FAILED: 2
    out = capsys.readouterr().out
    assert f"OK: {a}:" in out and "ERROR: " in out and "missing.pt" in out
    assert main(["verify", str(tmp_path / "missing.pt"), b]) == 1  # FAILED beats the error
    capsys.readouterr()


def test_verify_checkpoint_directories(tmp_path, capsys) -> None:
    paths = _tree(tmp_path)
    assert main(["verify", str(tmp_path / "lightning"), str(tmp_path / "deepspeed"), str(tmp_path / "dcp")]) == 0
    out = capsys.readouterr().out
    for key in ("ckpt", "ds", "dcp"):
        assert f"OK: {paths[key]}:" in out, (key, out)
    for key in ("tmp", "yaml", "latest", "script"):
        assert f"SKIPPED: {paths[key]}:" in out, (key, out)
    assert "temporary file of a fastpersist save" in out
    # Accelerate's folder holds a safetensors file without checksums: UNCHECKED (3), and the
    # staging directory of an unfinished save is skipped whole, never verified.
    assert main(["verify", "--json", str(tmp_path / "accelerate")]) == 3
    data = json.loads(capsys.readouterr().out)
    assert data["exit_status"] == 3 and data["status"] == "unchecked"
    by_path = {f["path"]: f["status"] for f in data["files"]}
    assert by_path == {str(paths["st"]): "ok", str(paths["bin"]): "ok", str(paths["pkl"]): "ok",
                       str(paths["plain"]): "unchecked"}, by_path
    skipped = {s["path"] for s in data["skipped"]}
    assert skipped == {str(paths["staging"])}, skipped
    # the whole tree: one corrupt file anywhere makes it 1, and the line names that file
    _flip_payload_byte(str(paths["ds"]))
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"FAILED: {paths['ds']}:" in out and f"OK: {paths['ckpt']}:" in out
    assert str(paths["staging"] / "optimizer.bin") not in out


def test_verify_directory_without_checkpoints(tmp_path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("no checkpoint here")
    assert main(["verify", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert f"SKIPPED: {tmp_path / 'notes.txt'}:" in out and "No checkpoint file" in out


def test_info_takes_the_directory_as_an_argument(tmp_path, capsys) -> None:
    """``fastpersist info DIR``, as README writes it (was: only --dir)."""
    assert main(["info", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["directory"] == str(tmp_path)
    assert main(["info", str(tmp_path), "--dir", str(tmp_path / "other")]) == 2


def _documented_commands() -> list[tuple[str, str]]:
    """Every ``fastpersist info|verify|bench ...`` invocation README.md and docs/ show:
    inline code spans and lines of code blocks (spans that are only a command's name,
    such as `fastpersist bench save`, and synopses with [optional] parts are left out)."""
    import glob
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = []
    for path in [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "**", "*.md"),
                                                                     recursive=True)):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        cmds = re.findall(r"`(fastpersist (?:info|verify|bench)[^`]*)`", text)
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():  # continuation lines, as the shell joins them
                m = re.search(r"(?:^|\s)(fastpersist (?:info|verify|bench)\b.*)$", line.strip())
                if m:
                    cmds.append(m.group(1).split(" #")[0])
        for cmd in cmds:
            words = cmd.split()
            if "[" in cmd or "$" in cmd or len(words) <= (3 if words[1] == "bench" else 2):
                continue  # a name, a synopsis, or a line of a shell loop
            if any(re.fullmatch(r"[A-Z]{1,3}", w) and w not in ("DIR", "D") and prev != "--dir"
                   for prev, w in zip(words, words[1:])):
                continue  # a synopsis with placeholders for typed values (--ranks N)
            found.append((os.path.relpath(path, root), cmd))
    return found


def test_documented_commands_parse() -> None:
    """What README and docs tell users to type is accepted by the CLI."""
    import contextlib
    import io
    import shlex

    from fastpersist.cli import build_parser

    cmds = _documented_commands()
    assert any(cmd.startswith("fastpersist info ") for _, cmd in cmds)
    bad = []
    for where, cmd in cmds:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                build_parser().parse_args(shlex.split(cmd)[1:])
        except SystemExit:
            bad.append(f"{where}: {cmd}: {err.getvalue().strip().splitlines()[-1:]}")
    assert not bad, "\n".join(bad)


# ---- usage errors -----------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["bench"],
        ["bench", "save"],  # --dir is required
        ["bench", "save", "--dir", ".", "--size", "12XB"],
        ["bench", "save", "--dir", ".", "--repeat", "0"],
        ["bench", "io", "--dir", ".", "--block-sizes", "1000"],
        ["bench", "io", "--dir", ".", "--direct", "maybe"],
        ["bench", "io", "--dir", ".", "--read-staging", "sometimes"],
        ["bench", "io", "--dir", ".", "--queue-depths", "4,x"],
    ],
)
def test_usage_errors(argv, capsys) -> None:
    assert main(argv) == 2
    assert "usage:" in capsys.readouterr().err


def test_bad_values_checked_before_running(tmp_path, capsys) -> None:
    assert main(["bench", "save", "--dir", str(tmp_path), "--peers", "torch,pickle"]) == 2
    assert "pickle" in capsys.readouterr().err
    assert main(["bench", "io", "--dir", str(tmp_path), "--engines", "turbo"]) == 2
    assert "turbo" in capsys.readouterr().err
    assert main(["bench", "save", "--dir", str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


# ---- benchmarks -------------------------------------------------------------------


def _peers() -> str:
    return "torch,safetensors,dcp" + (",fio" if fio_executable() else "")


def test_bench_save_smoke(tmp_path, capsys) -> None:
    js, png = str(tmp_path / "r.json"), str(tmp_path / "r.png")
    work = tmp_path / "disk"
    work.mkdir()
    argv = ["bench", "save", "--dir", str(work), "--size", "8MiB", "--repeat", "1", "--peers", _peers(),
            "--json", js, "--plot", png, "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.index("CPU") < out.index("O_DIRECT") < out.index("Durable save")  # header first
    assert "Verified   : fastpersist load equals the original state" in out
    with open(js, encoding="utf-8") as f:
        data = json.load(f)
    assert data["benchmark"] == "save"
    assert [m["name"] for m in data["methods"]] == ["fastpersist", "torch", "safetensors", "dcp"]
    for m in data["methods"]:
        assert m["error"] is None
        assert len(m["save_gbps"]) == 1 and m["save_gbps"][0] > 0 and m["load_gbps"][0] > 0
        assert m["save_vs_torch"] > 0 and m["load_vs_torch"] > 0
    assert data["workload"]["kind"] == "gpt-training-state" and data["workload"]["tensors"] > 100
    assert data["verification"]["ok"] is True
    assert set(data["machine"]) >= {"cpu_model", "filesystem", "direct_io", "engines", "torch_version"}
    if fio_executable():
        assert data["fio"]["write_gbps"] > 0 and data["fio"]["read_gbps"] > 0
    with open(png, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    assert os.listdir(work) == []  # checkpoint files cleaned up


def test_bench_save_small_tensors_json_to_stdout(tmp_path, capsys) -> None:
    argv = ["bench", "save", "--dir", str(tmp_path), "--small-tensors", "50", "--repeat", "1",
            "--peers", "torch", "--json", "-", "--no-progress", "--load-process", "same", "--no-plot"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)  # stdout holds the JSON alone
    assert data["workload"]["kind"] == "small-tensors" and data["workload"]["tensors"] == 50
    assert [m["name"] for m in data["methods"]] == ["fastpersist", "torch"]
    assert data["fio"] is None
    assert "Durable save" in captured.err  # the table went to stderr


def test_bench_save_keep(tmp_path, capsys) -> None:
    argv = ["bench", "save", "--dir", str(tmp_path), "--small-tensors", "20", "--repeat", "1",
            "--peers", "none", "--keep", "--no-progress", "--load-process", "same", "--no-plot"]
    assert main(argv) == 0
    (workdir,) = os.listdir(tmp_path)
    assert os.listdir(tmp_path / workdir) == ["fastpersist.pt"]
    assert main(["verify", str(tmp_path / workdir / "fastpersist.pt")]) == 0


def test_bench_io_smoke(tmp_path, capsys) -> None:
    from fastpersist.io import available_engines

    engines = ",".join(e for e in available_engines() if e != "cufile")
    js, png = str(tmp_path / "io.json"), str(tmp_path / "io.png")
    work = tmp_path / "disk"
    work.mkdir()
    argv = ["bench", "io", "--dir", str(work), "--size", "2MiB", "--engines", engines, "--block-sizes", "1M",
            "--queue-depths", "4", "--threads", "1,2", "--direct", "both", "--read-staging", "both", "--repeat", "1",
            "--json", js, "--plot", png, "--no-progress"]
    if not fio_executable():
        argv.append("--no-fio")
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "posix_fadvise" in out and "Best write" in out
    with open(js, encoding="utf-8") as f:
        data = json.load(f)
    assert data["benchmark"] == "io" and data["size_bytes"] == 2 * MiB
    assert len(data["runs"]) == len(engines.split(",")) * 2 * 2 * 2
    assert sorted(r["stage_reads"] for r in data["runs"]).count(True) == len(data["runs"]) // 2
    for r in data["runs"]:
        assert r["error"] is None and r["verified"] is True
        assert r["write_gbps"][0] > 0 and r["read_gbps"][0] > 0
    if fio_executable():
        assert data["fio"]["write_gbps"] > 0
        assert all(r["write_vs_fio"] > 0 for r in data["runs"])
    with open(png, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    assert os.listdir(work) == []


def test_bench_io_no_fio(tmp_path, capsys) -> None:
    argv = ["bench", "io", "--dir", str(tmp_path), "--size", "1MiB", "--engines", "psync", "--block-sizes", "1M",
            "--queue-depths", "2", "--threads", "1", "--repeat", "1", "--no-fio", "--json", "-", "--no-progress"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fio"] is None and data["runs"][0]["write_vs_fio"] is None


# ---- the benchmarks are not part of the library -------------------------------------


_BENCH_LOADED = ("import sys\n"
                 "def bench_loaded():\n"
                 "    return sorted(m for m in sys.modules if m.split('.')[:2] == ['fastpersist', 'bench'])\n")


def test_cli_and_its_non_bench_commands_do_not_load_the_benchmarks(tmp_path) -> None:
    """fastpersist.bench is loaded by ``fastpersist bench ...`` only: not by importing the
    package or the CLI, nor by ``info`` (a checkpoint or a directory), ``verify`` or ``--help``."""
    ckpt = tmp_path / "c.pt"
    fastpersist.save({"w": torch.ones(4)}, ckpt)
    calls = [["info", str(ckpt)], ["info", str(tmp_path)], ["info", "--dir", str(tmp_path)],
             ["verify", str(ckpt)], ["--help"], ["verify", "--help"], ["bench", "save", "--help"]]
    code = _BENCH_LOADED + (
        "import contextlib, io, json\n"
        "import fastpersist, fastpersist.cli\n"
        "print(json.dumps(['import', bench_loaded()]))\n"
        f"for args in {calls!r}:\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        fastpersist.cli.main(args)\n"
        "    print(json.dumps([args, bench_loaded()]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    seen = [json.loads(line) for line in out.stdout.splitlines()]
    assert [args for args, _ in seen] == ["import"] + calls
    for args, loaded in seen[:-1]:
        assert loaded == [], (args, loaded)
    # the bench command does load them, and its subcommands parse as before
    assert "fastpersist.bench.save_bench" in seen[-1][1]
