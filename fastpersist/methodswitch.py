"""Methods of a framework's class that go through fastpersist for one instance, or for every one.

An adapter turns fastpersist on for one framework object (``enable(accelerator)``: its
settings stored on the object, its methods wrapped on the object alone) or for every object
of the class (a switch variable: the methods wrapped on the class, the objects without
settings of their own getting the default ones). :class:`MethodSwitch` does both, once
each: every wrapper carries :data:`fastpersist.wrappers.MARK` (the original), so a second enable wraps nothing
again, and a wrapper asks its ``settings(obj)`` on every call (None: the original
behaviour, as after :meth:`MethodSwitch.disable`).
"""

from __future__ import annotations

import types
from typing import Any, Callable, Optional

from fastpersist.wrappers import MARK, is_wrapper, wrap_once

__all__ = ["MethodSwitch"]

#: ``make(original, settings)`` -> the wrapper of a method, calling ``settings(self)``
Make = Callable[[Callable[..., Any], Callable[[Any], Optional[Any]]], Callable[..., Any]]


class MethodSwitch:
    """The methods ``wraps`` (name -> ``make``) of a class, wrapped per instance or on the class;
    ``attr``: the instance attribute that holds an instance's settings (None: off);
    ``default()``: the settings of an instance without its own when the class is switched on."""

    def __init__(self, attr: str, wraps: dict[str, Make], default: Callable[[], Any]) -> None:
        self.attr = attr
        self.wraps = wraps
        self.default = default

    def own_settings(self, obj: Any) -> Optional[Any]:
        """``obj``'s settings given by :meth:`enable`; None without (or after :meth:`disable`)."""
        return getattr(obj, self.attr, None)

    def class_settings(self, obj: Any) -> Optional[Any]:
        """``obj``'s settings where the class is switched on: its own, else the default ones
        (None after :meth:`disable`)."""
        return getattr(obj, self.attr, self.default())

    def settings(self, obj: Any, *, class_on: bool) -> Optional[Any]:
        """``obj``'s settings (None: off): :meth:`class_settings` if ``class_on``, else
        :meth:`own_settings`."""
        return self.class_settings(obj) if class_on else self.own_settings(obj)

    def enable(self, obj: Any, settings: Any) -> None:
        """Store ``settings`` on ``obj`` and wrap its methods on ``obj`` alone (those that are not
        wrappers already, on the object or on its class)."""
        object.__setattr__(obj, self.attr, settings)
        for name, make in self.wraps.items():
            if not is_wrapper(getattr(obj, name)):
                original = getattr(type(obj), name)
                wrapped = make(original, self.own_settings)
                setattr(wrapped, MARK, original)
                object.__setattr__(obj, name, types.MethodType(wrapped, obj))

    def disable(self, obj: Any) -> None:
        """``obj`` goes back to the framework's own methods (the wrappers stay, and pass through)."""
        object.__setattr__(obj, self.attr, None)

    def enable_class(self, cls: type) -> None:
        """Wrap the methods on ``cls`` (those that are not wrappers already), with
        :meth:`class_settings`: every instance, made before or after, goes through them."""
        for name, make in self.wraps.items():
            wrap_once(cls, name, lambda original, make=make: make(original, self.class_settings))
