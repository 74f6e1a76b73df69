"""Functions of one module of a framework, routed to fastpersist only while a call of ours runs.

A framework whose checkpoint code calls its own module globals for every file
(``accelerate.checkpointing``'s ``save``, ``load``, ``torch.save``) is hooked by replacing
those globals *in that module only* with routers (:meth:`Routes.install`). A router asks
:meth:`Routes.settings`: inside :meth:`Routes.active` (the framework's save or load that
the adapter wraps, in this thread or task) it gets the adapter's settings and calls
fastpersist; anywhere else it gets None and calls :meth:`Routes.original`, so installing
alone changes nothing. :func:`setting` sets a framework object's attributes for the
duration of a call (its own options turned off while fastpersist does their work).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Optional

__all__ = ["Routes", "setting"]


class Routes:
    """The routers of one module and the settings of the routed call running (``name``: the
    context variable's)."""

    def __init__(self, name: str) -> None:
        self._active: contextvars.ContextVar[Optional[Any]] = contextvars.ContextVar(name, default=None)
        self._originals: dict[str, Any] = {}

    def installed(self) -> bool:
        """Whether :meth:`install` replaced the module's names (and :meth:`uninstall` did not
        give them back)."""
        return bool(self._originals)

    def install(self, module: Any, **routers: Any) -> bool:
        """Replace each ``module.NAME`` by ``routers[NAME]``, keeping the originals; a no-op
        when installed already. Returns whether it replaced them."""
        if self._originals:
            return False
        self._originals.update({name: getattr(module, name) for name in routers})
        for name, router in routers.items():
            setattr(module, name, router)
        return True

    def uninstall(self, module: Any) -> None:
        """Give ``module`` its names back."""
        for name, value in self._originals.items():
            setattr(module, name, value)
        self._originals.clear()

    def original(self, name: str) -> Any:
        """The module's own ``name``, as it was before :meth:`install`."""
        return self._originals[name]

    def settings(self) -> Optional[Any]:
        """The settings of the routed call running in this thread or task; None outside one."""
        return self._active.get()

    @contextlib.contextmanager
    def active(self, settings: Any) -> Iterator[None]:
        """Route this thread's (task's) calls with ``settings`` in the block."""
        token = self._active.set(settings)
        try:
            yield
        finally:
            self._active.reset(token)


@contextlib.contextmanager
def setting(owner: Any, **values: Any) -> Iterator[None]:
    """Set the attributes ``values`` of ``owner`` in the block; the previous values come back
    after it, also when it raises."""
    saved = {name: getattr(owner, name) for name in values}
    for name, value in values.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(owner, name, value)
