"""The one-line delegations of a facade to its collaborators (``ps_server.shard.shard.Shard``).

``locked(lock_of, part, Collaborator.method)`` is a method of the facade that takes the facade's
lock and calls ``method`` of the collaborator in its attribute ``part``; ``delegated`` calls it as
it is (the caller holds the lock, or the method needs none); ``part_property`` shows an attribute
of a collaborator as the facade's. Each carries the collaborator's docstring.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Concatenate, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")
C = TypeVar("C")


def locked(
    lock_of: Callable[[Any], AbstractContextManager[Any]], part: str, method: Callable[Concatenate[C, P], R]
) -> Callable[Concatenate[Any, P], R]:
    """``method`` of the facade's collaborator ``part``, called under ``lock_of(facade)`` (the
    collaborator's methods assume the lock is held)."""

    @functools.wraps(method)
    def call(facade: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with lock_of(facade):
            return method(getattr(facade, part), *args, **kwargs)

    return call


def delegated(part: str, method: Callable[Concatenate[C, P], R]) -> Callable[Concatenate[Any, P], R]:
    """``method`` of the facade's collaborator ``part``, called as it is: the caller holds the
    lock (a consistency policy's hook), or the method needs none."""

    @functools.wraps(method)
    def call(facade: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return method(getattr(facade, part), *args, **kwargs)

    return call


def part_property(part: str, name: str, doc: str, settable: bool = False) -> Any:
    """A property of the facade that is attribute ``name`` of its collaborator ``part``."""

    def get(facade: Any) -> Any:
        return getattr(getattr(facade, part), name)

    def put(facade: Any, value: Any) -> None:
        setattr(getattr(facade, part), name, value)

    return property(get, put if settable else None, doc=doc)
