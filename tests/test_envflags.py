"""fastpersist.envflags.adapter_enabled: an adapter's own variable wins, else the torch.save switch."""

from __future__ import annotations

import pytest

from fastpersist import envflags

VAR = "FASTPERSIST_TEST_ADAPTER"


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.delenv(envflags.SWITCH, raising=False)


@pytest.mark.parametrize("own, switch, want", [
    (None, None, False),
    ("1", None, True),
    ("0", "1", False),       # the adapter's own =0 keeps the framework stock under the switch
    (None, "yes", True),     # unset: the switch decides
    ("  ", "on", True),      # blank counts as unset
    ("TRUE", "0", True),
    (None, "off", False),
])
def test_precedence(monkeypatch, own, switch, want):
    if own is not None:
        monkeypatch.setenv(VAR, own)
    if switch is not None:
        monkeypatch.setenv(envflags.SWITCH, switch)
    assert envflags.adapter_enabled(VAR) is want


def test_switch_name():
    assert envflags.SWITCH == "FASTPERSIST_PATCH_TORCH_SAVE"


@pytest.mark.parametrize("which", [VAR, envflags.SWITCH])
def test_bad_value_names_the_variable(monkeypatch, which):
    monkeypatch.setenv(which, "maybe")
    with pytest.raises(ValueError, match=which):
        envflags.adapter_enabled(VAR)
