"""``SessionField``: an attribute of an object that is its session's (``PSClient.clock``, ``.version``...)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

V = TypeVar("V")


class SessionField(Generic[V]):
    """A class attribute that reads and writes the same-named attribute of ``obj.session`` (``obj``: an
    object holding a worker session, :class:`~ps_worker.session.Session`, as ``session``).

    ``clock: SessionField[int] = SessionField()`` in a class body makes ``obj.clock`` the session's
    clock: reads go to ``obj.session.clock``, and so do writes (tests and tools set counters).
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> V:
        if obj is None:
            return self  # type: ignore[return-value]
        return getattr(obj.session, self.name)

    def __set__(self, obj: Any, value: V) -> None:
        setattr(obj.session, self.name, value)
