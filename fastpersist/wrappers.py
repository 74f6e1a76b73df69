"""Reversible wrappers around another library's functions: the adapters' hook points.

An adapter that must run code before a framework's own function (wait for pending saves
before Lightning lists a folder) replaces the function by a wrapper, once, and must be
able to put every original back. :class:`Wrappers` does the bookkeeping: each wrapper
is marked (``MARK``, holding the original) so that a second install is a no-op, static methods stay static,
aliases of a module-level function that other modules imported by name are rebound too
(``from cloud_io import _load as pl_load``), and :meth:`Wrappers.undo` restores every
original in reverse order. :func:`calling_first` makes the common wrapper: run a hook with
the call's arguments, then the original (:func:`calling_after`: the original, then the
hook). :class:`ModuleWith` stands for a module inside one other module
(``accelerate.checkpointing``'s ``torch``) with some of its functions replaced there only.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from typing import Any, Callable, Iterator, Optional

__all__ = ["MARK", "ModuleWith", "Wrappers", "calling_after", "calling_first", "is_wrapper", "lazy_attributes",
           "on_failure", "replace_argument", "take_first", "wrap_once"]

#: the attribute of every wrapper fastpersist installs (:class:`Wrappers`, :func:`wrap_once`,
#: :class:`fastpersist.methodswitch.MethodSwitch`, the ``torch.save`` switch): the function
#: it replaced
MARK = "_fastpersist_original"


def is_wrapper(func: Any) -> bool:
    """Whether ``func`` is a wrapper fastpersist installed (it carries ``MARK``)."""
    return hasattr(func, MARK)


def wrap_once(owner: Any, name: str, make: Callable[[Any], Callable[..., Any]]) -> bool:
    """Replace ``owner.name`` (a class's function, or an object's bound method) by
    ``make(original)``, marked ``MARK``, unless it is such a wrapper already; for good (an
    object's wrappers go with the object; :class:`Wrappers` keeps what it replaced, to undo).
    Returns whether it replaced it."""
    original = getattr(owner, name)
    if is_wrapper(original):
        return False
    wrapped = make(original)
    setattr(wrapped, MARK, original)
    setattr(owner, name, wrapped)
    return True


def calling_first(hook: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A ``make`` for :meth:`Wrappers.wrap`: the wrapper calls ``hook`` with the call's
    arguments (``self`` included for a method), then the original, whose result it returns."""
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            hook(*args, **kwargs)
            return original(*args, **kwargs)
        return wrapper
    return make


def calling_after(hook: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A ``make`` whose wrapper calls the original, then ``hook`` with the call's arguments
    (``self`` included for a method; not when the original raised); it returns the
    original's result."""
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            hook(*args, **kwargs)
            return result
        return wrapper
    return make


@contextlib.contextmanager
def on_failure(callback: Optional[Callable[[BaseException], object]]) -> Iterator[None]:
    """Run the block; when it raises, ``callback(error)`` first (None: nothing), then the
    error goes on unchanged."""
    try:
        yield
    except BaseException as e:
        if callback is not None:
            callback(e)
        raise


def lazy_attributes(module: str, **makers: Callable[[], Any]) -> Callable[[str], Any]:
    """A module's ``__getattr__`` (PEP 562) giving each name of ``makers`` as ``makers[name]()``,
    made on first use (a class that subclasses an optional framework's); ``AttributeError``
    naming ``module`` for any other name."""

    def __getattr__(name: str) -> Any:
        if name in makers:
            return makers[name]()
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def take_first(args: tuple, kwargs: dict, name: str) -> tuple[Any, tuple, dict]:
    """A call's first argument, given by position or as the keyword ``name`` (None when not
    given), and the call's other arguments: ``(value, args, kwargs)``."""
    return (args[0] if args else kwargs.get(name)), args[1:], {k: v for k, v in kwargs.items() if k != name}


def replace_argument(signature: inspect.Signature, args: tuple, kwargs: dict, name: str,
                     value: Any) -> tuple[Any, tuple, dict]:
    """A call ``(args, kwargs)`` of a function of ``signature`` with its argument ``name`` (given
    by position, by keyword or left to its default) set to ``value``: ``(the caller's value,
    args, kwargs)``; a call the signature refuses raises its ``TypeError``. Where the function
    has no such parameter: ``(None, args, kwargs)`` unchanged."""
    call = signature.bind(*args, **kwargs)
    if name not in signature.parameters:
        return None, args, kwargs
    call.apply_defaults()
    given = call.arguments[name]
    call.arguments[name] = value
    return given, call.args, call.kwargs


class Wrappers:
    """The wrappers one adapter installed, to undo them all."""

    def __init__(self) -> None:
        #: (owner, attribute, original value) of every replacement, in order
        self._done: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attr: str, make: Callable[[Any], Any]) -> bool:
        """Replace ``owner.attr`` (a class's own attribute, or a module's) by ``make(original)``,
        unless it is missing or a wrapper already. A static method stays one. Returns whether
        it replaced it."""
        raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if raw is None:
            return False
        func = raw.__func__ if isinstance(raw, staticmethod) else raw
        if is_wrapper(func):
            return False
        wrapped = make(func)
        setattr(wrapped, MARK, func)
        wrapped.__wrapped__ = func
        setattr(owner, attr, staticmethod(wrapped) if isinstance(raw, staticmethod) else wrapped)
        self._done.append((owner, attr, raw))
        return True

    def rebind(self, original: Any, replacement: Any, prefixes: tuple[str, ...], skip: Any = None) -> None:
        """Every module-level name bound to ``original`` in the loaded modules whose names
        start with one of ``prefixes`` (except the module ``skip``) now names ``replacement``."""
        if replacement is original:
            return
        for name, module in list(sys.modules.items()):
            if module is None or not name.startswith(prefixes) or module is skip:
                continue
            for attr, value in list(vars(module).items()):
                if value is original:
                    setattr(module, attr, replacement)
                    self._done.append((module, attr, original))

    def undo(self) -> None:
        """Put every original back (the last replacement first)."""
        while self._done:
            owner, attr, original = self._done.pop()
            setattr(owner, attr, original)


class ModuleWith:
    """Stands for ``module`` with the attributes ``replaced`` given instead of its own (to
    bind in one other module's globals, where that module's calls should be routed);
    every other attribute is read from and written to ``module``."""

    def __init__(self, module: Any, **replaced: Any) -> None:
        self.__dict__.update(replaced, _module=module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._module, name, value)

    def __repr__(self) -> str:
        names = ", ".join(k for k in self.__dict__ if k != "_module")
        return f"<{self._module!r}, with {names} routed by fastpersist>"
