"""``fastpersist info PATH`` for checkpoints: what a file, or each checkpoint in a folder
(Lightning, Accelerate, DeepSpeed, DCP), holds.

For a torch zip or safetensors file: its format, which writer made it (fastpersist, or
``torch.save``/safetensors), its tensors (count, bytes, by dtype: from the index alone,
no tensor is read) and, unless asked not to, its checksum state from
:func:`fastpersist.verify` (which reads every byte). A DCP directory is described by its
verification. Folders are searched as ``fastpersist verify`` searches them
(:mod:`fastpersist.verifytree`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from fastpersist import verifytree
from fastpersist.api import verify
from fastpersist.units import format_bytes
from fastpersist.formats import crcpolicy
from fastpersist.formats.dcpmetadata import load_metadata
from fastpersist.formats.zipindex import fd_reader, parse_zip_index, pread_full
from fastpersist.lazy import open as open_checkpoint

__all__ = ["CheckpointSummary", "describe", "describe_file"]

_ZIP_MAGIC = b"PK\x03\x04"


@dataclass
class CheckpointSummary:
    """What one checkpoint (a file, or a DCP directory) holds."""

    path: str
    format: str  #: "torch zip", "safetensors", "DCP directory", "legacy torch" or "unknown"
    writer: str = "unknown"  #: "fastpersist", "torch.save", "safetensors", or "unknown"
    size: int = 0  #: bytes on disk (a directory: its files together)
    tensors: Optional[int] = None  #: tensors in the index (None: not read from the index)
    tensor_bytes: Optional[int] = None  #: bytes of the tensors' storages (shared storages once)
    dtypes: dict[str, list[int]] = field(default_factory=dict)  #: dtype -> [tensors, bytes]
    status: str = "not checked"  #: verify's "ok", "unchecked", "corrupt", or "not checked"
    problems: list[str] = field(default_factory=list)
    error: Optional[str] = None  #: why the index could not be read

    def count(self, dtype: Any, shape: Any) -> int:
        """Count one tensor of ``dtype`` and ``shape`` under its dtype; returns its bytes."""
        n = 1
        for d in shape:
            n *= int(d)
        nbytes = n * dtype.itemsize
        entry = self.dtypes.setdefault(_dtype_name(dtype), [0, 0])
        entry[0] += 1
        entry[1] += nbytes
        self.tensors = (self.tensors or 0) + 1
        return nbytes

    def to_dict(self) -> dict[str, Any]:
        """The summary as plain data (for ``--json``)."""
        return asdict(self)

    def lines(self) -> list[str]:
        """The summary in lines of at most 100 columns (long values wrap, indented)."""
        out = [f"Checkpoint : {self.path}", f"Format     : {self.format}, written by {self.writer}; "
               f"{format_bytes(self.size)} on disk"]
        if self.error:
            out.append(f"Index      : unreadable ({self.error})")
        if self.tensors is not None:
            out.append(f"Tensors    : {self.tensors}, {format_bytes(self.tensor_bytes or 0)}")
            if self.dtypes:
                parts = [f"{name} {n} ({format_bytes(b)})"
                         for name, (n, b) in sorted(self.dtypes.items(), key=lambda kv: -kv[1][1])]
                out.append("Dtypes     : " + ", ".join(parts))
        check = {
            "ok": "OK: every byte matches the CRC-32 recorded when it was written",
            "unchecked": "UNCHECKED: the file records no checksums to compare its bytes with",
            "corrupt": "CORRUPT: " + "; ".join(self.problems[:2]),
            "not checked": "not checked (run `fastpersist verify PATH`)",
        }.get(self.status, self.status)
        out.append(f"Checksums  : {check}")
        return [piece for line in out for piece in wrap(line)]


def wrap(line: str, width: int = 100, indent: int = 13) -> list[str]:
    """``line`` cut at spaces into lines of at most ``width`` columns, the later ones
    indented by ``indent`` (a word longer than the width stays whole)."""
    if len(line) <= width:
        return [line]
    out: list[str] = []
    cur = ""
    for word in line.split(" "):
        cand = word if not cur else f"{cur} {word}"
        if len(cand) > width and cur.strip():
            out.append(cur)
            cur = " " * indent + word
        else:
            cur = cand
    out.append(cur)
    return out


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _torch_writer(path: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        index = parse_zip_index(fd_reader(fd, path), size, path)
        e = index.find(crcpolicy.SERIALIZATION_ID)
        raw = None
        if e is not None and e.method == 0 and e.compressed_size == 40:
            raw = pread_full(fd, 40, e.data_offset, path)
        return "fastpersist" if crcpolicy.written_by_fastpersist(index.entries, raw) else "torch.save"
    finally:
        os.close(fd)


def _safetensors_writer(path: str) -> str:
    """fastpersist records CRC-32s under ``fastpersist.`` keys in the JSON header."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = f.read(min(n, 100 << 20))
    return "fastpersist" if b'"fastpersist.' in header else "safetensors"


def _dcp_tensors(s: CheckpointSummary, metadata_path: str) -> None:
    """Writer and tensors of a DCP checkpoint from its ``.metadata`` (fastpersist seals it)."""
    try:
        md, sealed = load_metadata(metadata_path)
    except Exception as e:  # noqa: BLE001 - described; verify says the rest
        s.error = f"{type(e).__name__}: {e}"
        return
    s.writer = "fastpersist" if sealed else "torch.distributed.checkpoint"
    s.tensors, s.tensor_bytes = 0, 0
    for item in getattr(md, "state_dict_metadata", {}).values():
        props, size = getattr(item, "properties", None), getattr(item, "size", None)
        if props is None or size is None:
            continue  # a bytes item
        s.tensor_bytes += s.count(props.dtype, size)


def describe_file(path: str, *, check: bool = True) -> CheckpointSummary:
    """The summary of one checkpoint file (or DCP directory); ``check``: run
    :func:`fastpersist.verify` for the checksum state (reads every byte)."""
    st = os.stat(path)
    if os.path.isdir(path):
        size = 0
        for base, _dirs, files in os.walk(path):
            for n in files:
                try:
                    size += os.lstat(os.path.join(base, n)).st_size
                except OSError:
                    pass
        s = CheckpointSummary(path, "DCP directory", "unknown", size)
        _dcp_tensors(s, os.path.join(path, ".metadata"))
    else:
        with open(path, "rb") as f:
            head = f.read(16)
        if head.startswith(_ZIP_MAGIC):
            fmt = "torch zip"
        elif len(head) >= 9 and head[8:9] == b"{":
            fmt = "safetensors"
        elif head[:1] == b"\x80":
            fmt = "legacy torch"
        else:
            fmt = "unknown"
        s = CheckpointSummary(path, fmt, "unknown", st.st_size)
        if fmt in ("torch zip", "safetensors"):
            try:
                with open_checkpoint(path) as r:
                    seen: set[tuple[str, int]] = set()
                    s.tensors, s.tensor_bytes = 0, 0
                    for name in r.keys():
                        info = r.info(name)
                        nbytes = s.count(info.dtype, info.shape)
                        key = (info.record, int(getattr(info, "record_offset", 0)))
                        if key not in seen:
                            seen.add(key)
                            s.tensor_bytes += int(getattr(info, "record_nbytes", nbytes))
                s.writer = _torch_writer(path) if fmt == "torch zip" else _safetensors_writer(path)
            except Exception as e:  # noqa: BLE001 - a damaged index is described, verify says the rest
                s.error = f"{type(e).__name__}: {e}"
    if check:
        res = verify(path)
        s.status = res.status
        s.problems = list(res.problems)
    return s


def describe(path: str, *, check: bool = True) -> tuple[list[CheckpointSummary], list[tuple[str, str]]]:
    """The checkpoints at ``path`` (a file, a DCP directory, or a folder searched as
    ``fastpersist verify`` searches it) and the entries skipped with the reason."""
    if not os.path.isdir(path) or verifytree.is_dcp_dir(path):
        return [describe_file(path, check=check)], []
    tree = verifytree.collect(path)
    return [describe_file(t, check=check) for t in tree.targets], list(tree.skipped)


def is_checkpoint_path(path: str) -> bool:
    """Whether ``fastpersist info`` should describe ``path`` as checkpoints: a file, a DCP
    directory, or a folder holding checkpoint files."""
    if os.path.isfile(path) or verifytree.is_dcp_dir(path):
        return True
    if not os.path.isdir(path):
        return False
    return bool(verifytree.collect(path).targets)
