"""What ``fastpersist verify`` checks when given directories: the checkpoint files in a
tree (Lightning, Accelerate and DeepSpeed folders, DCP checkpoint directories).

A directory is walked (symbolic links to directories are not followed) and each entry
is sorted into one of:

* a **DCP checkpoint directory** (``.metadata``, ``__N.metadata`` or ``__*.distcp``
  inside): verified as one unit, not descended into;
* a **checkpoint file**: a name ending in ``.pt``, ``.pth``, ``.ckpt``, ``.bin``,
  ``.pkl`` or ``.safetensors`` (Lightning's ``*.ckpt``, Accelerate's
  ``pytorch_model.bin``/``optimizer.bin``/``random_states_0.pkl``/``model.safetensors``,
  DeepSpeed's ``*_states.pt``), or any other file that starts like a zip archive
  (``PK\\x03\\x04``: torch's format, whatever its name);
* **skipped, said so**: fastpersist's own temporary files and staging directories of
  saves that are in flight or were interrupted (``.fp-tmp-*``,
  ``.fastpersist-staging-*``, ``.fastpersist-old-*``: never checkpoints, never
  descended into), and every other file (DeepSpeed's ``latest``, ``zero_to_fp32.py``,
  ``hparams.yaml``, logs), with the reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from fastpersist import dircommit
from fastpersist.commit import TMP_MARKER
from fastpersist.formats.dcpverify import looks_like_dcp
from fastpersist.formats.zipindex import starts_like_zip

#: Names ending so are checkpoint files (verified even when damaged beyond recognition).
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".pkl", ".safetensors")


@dataclass
class Tree:
    """The entries found under the paths given: ``targets`` to verify (files and DCP
    directories, in order), ``skipped`` as ``(path, reason)``."""

    targets: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def fastpersist_temp_reason(name: str) -> str | None:
    """Why ``name`` (a directory entry) is a temporary file or directory of fastpersist,
    or None when it is not one."""
    if TMP_MARKER in name:
        return "temporary file of a fastpersist save in flight or interrupted"
    if name.startswith(dircommit.STAGING_PREFIX):
        return "staging directory of a fastpersist save in flight or interrupted"
    if name.startswith(dircommit.OLD_PREFIX):
        return "previous copy kept by an interrupted fastpersist directory swap"
    return None


def is_dcp_dir(path: str) -> bool:
    """Whether ``path`` is a directory holding a DCP checkpoint (damaged ones too)."""
    return os.path.isdir(path) and looks_like_dcp(path)


def classify_file(path: str) -> str | None:
    """None when ``path`` (a file) is a checkpoint file to verify, else why it is skipped."""
    name = os.path.basename(path)
    reason = fastpersist_temp_reason(name)
    if reason is not None:
        return reason
    if name.endswith(CHECKPOINT_SUFFIXES) or starts_like_zip(path):
        return None
    return "not a checkpoint file (not torch's zip format, no checkpoint suffix)"


def collect(directory: str) -> Tree:
    """The checkpoint files and DCP directories under ``directory`` (itself a DCP
    directory: just that), and what was skipped, in a stable (sorted) order."""
    tree = Tree()
    if is_dcp_dir(directory):
        tree.targets.append(directory)
        return tree
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        kept = []
        for d in dirs:
            full = os.path.join(root, d)
            reason = fastpersist_temp_reason(d)
            if reason is not None:
                tree.skipped.append((full, reason))
            elif os.path.islink(full):
                tree.skipped.append((full, "symbolic link to a directory (not followed)"))
            elif is_dcp_dir(full):
                tree.targets.append(full)
            else:
                kept.append(d)
        dirs[:] = kept
        for f in sorted(files):
            full = os.path.join(root, f)
            reason = classify_file(full)
            if reason is None:
                tree.targets.append(full)
            else:
                tree.skipped.append((full, reason))
    return tree
