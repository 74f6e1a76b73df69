"""fastpersist.routing: a module's functions replaced by routers that act only while a routed
call runs in this thread (the others, and calls outside, get the module's own), given back
by uninstall; and a framework object's attributes set for one call."""

from __future__ import annotations

import threading
import types

import pytest

from fastpersist.routing import Routes, setting


def _module() -> types.ModuleType:
    lib = types.ModuleType("fp_routing_test_lib")
    lib.save = lambda obj, path: ("lib", obj, path)
    lib.load = lambda path: ("lib", path)
    return lib


def test_routers_act_only_inside_a_routed_call_of_this_thread():
    lib = _module()
    own_save, own_load = lib.save, lib.load
    routes = Routes("fp_routing_test")

    def save(obj, path):  # noqa: ANN001, ANN202 - a router: ours while routed, the library's otherwise
        s = routes.settings()
        return ("ours", s, obj, path) if s is not None else routes.original("save")(obj, path)

    assert not routes.installed()
    assert routes.install(lib, save=save) is True
    assert routes.install(lib, save=lambda *a: None) is False  # installed already: nothing replaced
    assert routes.installed() and lib.save is save and lib.load is own_load
    assert routes.original("save") is own_save
    assert lib.save(1, "p") == ("lib", 1, "p")  # installing alone changes nothing
    other: list = []
    with routes.active("settings"):
        assert lib.save(2, "q") == ("ours", "settings", 2, "q")
        t = threading.Thread(target=lambda: other.append(lib.save(3, "r")))
        t.start()
        t.join()
        with routes.active("inner"):
            assert routes.settings() == "inner"
        assert routes.settings() == "settings"
    assert other == [("lib", 3, "r")]  # another thread is not routed
    assert routes.settings() is None and lib.save(4, "s") == ("lib", 4, "s")
    routes.uninstall(lib)
    assert lib.save is own_save and not routes.installed()


def test_setting_restores_the_attributes_also_when_the_block_raises():
    config = types.SimpleNamespace(total_limit=3, automatic_checkpoint_naming=True)
    with setting(config, total_limit=None, automatic_checkpoint_naming=False):
        assert config.total_limit is None and config.automatic_checkpoint_naming is False
    assert (config.total_limit, config.automatic_checkpoint_naming) == (3, True)
    routes = Routes("fp_routing_test_raise")
    with pytest.raises(RuntimeError), routes.active("s"), setting(config, total_limit=0):
        raise RuntimeError("the framework's call failed")
    assert config.total_limit == 3 and routes.settings() is None
