"""What a format planner hands to the native writer, and what a format's verifier returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastpersist.plan import PATCH_HEX8, PATCH_U32LE, WritePlan  # noqa: F401 (the formats' names for them)


@dataclass
class VerifyResult:
    """Outcome of :func:`fastpersist.verify`.

    ``status`` is one of:

    * ``"ok"``: the file is a loadable checkpoint and every byte matched the
      checksum recorded when it was written (``ok`` is true);
    * ``"corrupt"``: the file is damaged, malformed, or not a checkpoint at all
      (``problems`` says what is wrong);
    * ``"unchecked"``: the structure is valid as far as it can be checked, but the
      file carries no checksums to compare its bytes with (a ``.safetensors``
      file not written by fastpersist, or a legacy non-zip torch file);
      ``problems`` says so. ``ok`` is false: nothing vouches for the bytes.

    ``bool(result)`` is ``result.ok``.
    """

    ok: bool
    path: str
    format: str
    records: int = 0  #: zip records or safetensors tensors checked
    bytes: int = 0  #: payload bytes checksummed (0 when none were)
    problems: list[str] = field(default_factory=list)
    status: str = "ok"  #: "ok", "corrupt" or "unchecked"
    #: Remarks that do not make the file corrupt: storages whose location tag this
    #: machine cannot restore without ``map_location`` (e.g. ``cuda:7`` with fewer GPUs).
    notes: list[str] = field(default_factory=list)

    @property
    def checked(self) -> bool:
        """Whether the file's bytes could be compared with recorded checksums."""
        return self.status != "unchecked"

    def __bool__(self) -> bool:
        return self.ok
