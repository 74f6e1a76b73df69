"""fastpersist.swallowed (a load error a framework catches is raised after its call) and
fastpersist.adaptersettings (the "fastpersist" section of a framework's config, checked)."""

from __future__ import annotations

import logging

import pytest

from fastpersist import adaptersettings, swallowed
from fastpersist.errors import ChecksumError


def _framework_load(paths: dict) -> str:
    """A framework load that catches every error of each file and goes on (as Accelerate's RNG file)."""
    for path, error in paths.items():
        try:
            try:
                raise error
            except BaseException as e:
                swallowed.record(path, e)  # the adapter's load routine
                raise
        except Exception:  # noqa: BLE001 - what the framework does
            pass
    return "resumed"


def test_a_swallowed_error_is_raised_after_the_call(caplog):
    bad = ChecksumError("CRC-32 mismatch in /ck/random_states_0.pkl")
    with caplog.at_level(logging.ERROR), pytest.raises(ChecksumError) as info:
        with swallowed.watching("Framework's load", hint=" (the RNG state)"):
            _framework_load({"/ck/random_states_0.pkl": bad, "/ck/other.pkl": OSError(5, "EIO")})
    assert info.value is bad
    assert any("Framework's load caught this error of /ck/random_states_0.pkl" in n and "(the RNG state)" in n
               for n in info.value.__notes__)
    assert any("random_states_0.pkl, /ck/other.pkl" in r.getMessage() for r in caplog.records)


def test_missing_files_and_loads_outside_watching_are_not_recorded():
    with swallowed.watching("Framework's load"):
        assert _framework_load({"/ck/absent.pkl": FileNotFoundError(2, "missing")}) == "resumed"
        assert _framework_load({"/ck/v.pkl": ValueError("not a load error")}) == "resumed"
    assert _framework_load({"/ck/r.pkl": ChecksumError("bad")}) == "resumed"  # not watching: nothing to raise
    with pytest.raises(KeyError):  # the call's own error propagates unchanged
        with swallowed.watching("Framework's load"):
            _framework_load({"/ck/r.pkl": ChecksumError("bad")})
            raise KeyError("own")


def test_adapter_section_parsing():
    parse = adaptersettings.parse_section
    assert parse(True, key="fp", where="X config") == {"enabled": True, "decoupled": False, "split_replicated": True,
                                                       "config": None}
    got = parse({"decoupled": True, "config": {"threads": 3}}, key="fp", where="X config")
    assert got["enabled"] and got["decoupled"] and got["config"].threads == 3
    for bad, match in (("yes", "must be true, false or an object"), ({"decouple": True}, r"unknown key\(s\)"),
                       ({"enabled": 1}, '"fp.enabled" must be true or false'), ({"config": 3}, '"fp.config"'),
                       ({"config": {"no_such": 1}}, '"fp.config"')):
        with pytest.raises(ValueError, match=match) as info:
            parse(bad, key="fp", where="X config")
        assert str(info.value).startswith("X config: ")


def test_recording_records_a_failed_load_and_raises_it_on(caplog):
    bad = ChecksumError("CRC-32 mismatch in /ck/optimizer.bin")
    with caplog.at_level(logging.ERROR), pytest.raises(ChecksumError) as info:
        with swallowed.watching("Framework's load"):
            try:
                with swallowed.recording("/ck/optimizer.bin"):
                    raise bad
            except ChecksumError:
                pass  # the framework goes on
    assert info.value is bad and any("/ck/optimizer.bin" in r.getMessage() for r in caplog.records)
    with swallowed.recording("/ck/x"):  # no error: nothing recorded
        pass


def test_find_section_of_a_framework_config():
    find = adaptersettings.find_section
    assert find({"train_batch_size": 8}, key="fp", where="X config") is None
    assert find(None, key="fp", where="X config") is None and find([("fp", True)], key="fp", where="X") is None
    assert find({"fp": {"decoupled": True}}, key="fp", where="X config")["decoupled"] is True
    with pytest.raises(ValueError, match="^X config: "):
        find({"fp": "yes"}, key="fp", where="X config")
