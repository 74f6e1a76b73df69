"""fastpersist.wrappers: the adapters' reversible wrappers of a framework's functions."""

from __future__ import annotations

import inspect

import pytest


class _Owner:
    @staticmethod
    def static(x):
        return ("static", x)

    def method(self, x):
        return ("method", x)


def test_wrappers_wrap_once_rebind_aliases_and_undo():
    import sys
    import types

    from fastpersist.wrappers import Wrappers, is_wrapper

    module = types.ModuleType("fp_wrappers_test_lib")
    module.load = lambda x: ("load", x)
    alias = types.ModuleType("fp_wrappers_test_lib.user")
    alias.pl_load = module.load  # "from lib import load as pl_load"
    sys.modules.update({module.__name__: module, alias.__name__: alias})
    calls = []

    def make(original):
        def wrapper(*args):
            calls.append(args[-1])
            return original(*args)
        return wrapper

    w = Wrappers()
    try:
        original_load, original_static = module.load, _Owner.static
        assert w.wrap(_Owner, "static", make) and w.wrap(_Owner, "method", make)
        assert not w.wrap(_Owner, "static", make)  # a second install is a no-op
        assert not w.wrap(_Owner, "missing", make)
        assert isinstance(_Owner.__dict__["static"], staticmethod) and is_wrapper(_Owner.static)
        assert _Owner.static(1) == ("static", 1) and _Owner().method(2) == ("method", 2) and calls == [1, 2]
        assert w.wrap(module, "load", make)
        w.rebind(original_load, module.load, ("fp_wrappers_test_lib",), skip=module)
        assert alias.pl_load is module.load and alias.pl_load(3) == ("load", 3) and calls[-1] == 3
        w.undo()
        assert _Owner.static is original_static and not is_wrapper(_Owner.method)
        assert module.load is original_load and alias.pl_load is original_load
    finally:
        w.undo()
        for name in (module.__name__, alias.__name__):
            sys.modules.pop(name, None)


def test_module_with_routes_the_replaced_names_only():
    import types

    from fastpersist.wrappers import ModuleWith

    module = types.ModuleType("fp_module_with_test")
    module.save = lambda obj: ("stock", obj)
    module.other = 1
    proxy = ModuleWith(module, save=lambda obj: ("routed", obj))
    assert proxy.save(3) == ("routed", 3) and module.save(3) == ("stock", 3)
    assert proxy.other == 1
    proxy.other = 2  # written through to the module
    assert module.other == 2 and "save" in repr(proxy)


def test_calling_first_runs_the_hook_then_the_original():
    from fastpersist.wrappers import Wrappers, calling_first, is_wrapper

    class Owner:
        @staticmethod
        def static(path, flag=False):
            return ("static", path, flag)

        def method(self, path):
            return ("method", path)

    seen = []
    w = Wrappers()
    assert w.wrap(Owner, "static", calling_first(lambda path, *a, **k: seen.append(("static", path, k))))
    assert w.wrap(Owner, "method", calling_first(lambda self, path: seen.append(("method", path))))
    assert isinstance(Owner.__dict__["static"], staticmethod) and is_wrapper(Owner.static)
    assert Owner.static.__name__ == "static" and Owner.static.__wrapped__.__name__ == "static"
    assert Owner.static("a", flag=True) == ("static", "a", True) and Owner().method("b") == ("method", "b")
    assert seen == [("static", "a", {"flag": True}), ("method", "b")]
    w.undo()
    assert not is_wrapper(Owner.static) and Owner().method("c") == ("method", "c") and len(seen) == 2


def test_calling_after_runs_the_original_then_the_hook():
    from fastpersist.wrappers import calling_after

    seen = []

    def configure(self, n):  # noqa: ANN001, ANN202
        seen.append(("original", n))
        if n < 0:
            raise ValueError("bad")
        return n * 2

    wrapped = calling_after(lambda self, n: seen.append(("hook", n)))(configure)
    assert wrapped("engine", 3) == 6 and seen == [("original", 3), ("hook", 3)]
    assert wrapped.__name__ == "configure"
    seen.clear()
    try:
        wrapped("engine", -1)
    except ValueError:
        pass
    assert seen == [("original", -1)]  # the original raised: no hook


def test_take_first():
    from fastpersist.wrappers import take_first

    assert take_first(("s3://b/run", 1), {"strict": True}, "input_dir") == ("s3://b/run", (1,), {"strict": True})
    assert take_first((), {"input_dir": "d", "strict": True}, "input_dir") == ("d", (), {"strict": True})
    assert take_first((), {}, "tag") == (None, (), {})


def test_on_failure_and_lazy_attributes():
    import pytest

    from fastpersist.wrappers import lazy_attributes, on_failure

    seen: list = []
    with on_failure(seen.append):
        pass
    with pytest.raises(KeyError) as info, on_failure(seen.append):
        raise KeyError("save_checkpoint raised")
    assert seen == [info.value]  # told, then raised on unchanged
    with pytest.raises(KeyError), on_failure(None):
        raise KeyError("no callback")
    made: list = []
    getter = lazy_attributes("fp_lazy_test", Engine=lambda: made.append(1) or "the class")
    assert made == [] and getter("Engine") == "the class" and made == [1]
    with pytest.raises(AttributeError, match="module 'fp_lazy_test' has no attribute 'Other'"):
        getter("Other")


def test_replace_argument_by_position_keyword_or_default():
    from fastpersist.wrappers import replace_argument

    def save(save_dir, tag=None, client_state={}, save_latest=True):  # noqa: ANN001, ANN202, B006
        return save_dir, tag, client_state, save_latest

    sig = inspect.signature(save)
    for args, kwargs, caller in [(("d", "t", {}, False), {}, False), (("d",), {"save_latest": False}, False),
                                 (("d", "t"), {}, True)]:
        given, a, k = replace_argument(sig, args, kwargs, "save_latest", "forced")
        assert given is caller and save(*a, **k) == ("d", "t" if len(args) > 1 else None, {}, "forced")
    with pytest.raises(TypeError):
        replace_argument(sig, ("d",), {"nope": 1}, "save_latest", False)
    assert replace_argument(sig, ("d",), {}, "missing", 1) == (None, ("d",), {})
