"""fastpersist.methodswitch: a class's methods wrapped for one instance (its settings stored
on it) or for every instance (the default settings where it has none), each only once; and
wrap_once."""

from __future__ import annotations

from typing import Any, Callable, Optional

from fastpersist.methodswitch import MethodSwitch
from fastpersist.wrappers import MARK, wrap_once


def _framework() -> type:
    class Trainer:
        def save(self, path: str) -> tuple:
            return ("stock", path)

    return Trainer


def _make(original: Callable[..., Any], settings: Callable[[Any], Optional[Any]]) -> Callable[..., Any]:
    def save(self: Any, path: str) -> tuple:
        s = settings(self)
        return original(self, path) if s is None else ("ours", s, path)

    return save


def test_per_instance_then_disable():
    trainer_cls = _framework()
    switch = MethodSwitch("_fp_test_settings", {"save": _make}, default=lambda: "default")
    a, b = trainer_cls(), trainer_cls()
    switch.enable(a, "mine")
    assert a.save("p") == ("ours", "mine", "p") and b.save("p") == ("stock", "p")  # b untouched
    wrapper = a.save
    switch.enable(a, "again")  # a second enable updates the settings, wraps nothing again
    assert a.save.__func__ is wrapper.__func__ and a.save("p") == ("ours", "again", "p")
    assert getattr(a.save, MARK) is trainer_cls.__dict__["save"]
    assert switch.settings(a, class_on=False) == "again" and switch.settings(b, class_on=False) is None
    switch.disable(a)
    assert a.save("p") == ("stock", "p") and switch.settings(a, class_on=True) is None


def test_class_switch_covers_instances_made_before_and_after():
    trainer_cls = _framework()
    switch = MethodSwitch("_fp_test_settings", {"save": _make}, default=lambda: "default")
    before = trainer_cls()
    own = trainer_cls()
    switch.enable(own, "own")
    switch.enable_class(trainer_cls)
    wrapped = trainer_cls.save
    switch.enable_class(trainer_cls)  # idempotent
    assert trainer_cls.save is wrapped
    assert before.save("p") == ("ours", "default", "p") and trainer_cls().save("q") == ("ours", "default", "q")
    assert own.save("p") == ("ours", "own", "p")
    switch.disable(before)
    assert before.save("p") == ("stock", "p") and switch.settings(before, class_on=True) is None


def test_wrap_once():
    class Engine:
        def load(self, path: str) -> str:
            return f"load {path}"

    engine = Engine()
    calls: list = []

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def load(path: str) -> str:
            calls.append(path)
            return original(path)
        return load

    assert wrap_once(engine, "load", make) is True
    assert wrap_once(engine, "load", make) is False  # a wrapper already
    assert engine.load("x") == "load x" and calls == ["x"]  # wrapped once: one call recorded
    assert Engine().load("y") == "load y" and calls == ["x"]  # the class untouched
