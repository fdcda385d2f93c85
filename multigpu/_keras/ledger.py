"""One ledger per parallel model: every attribute multigpu sets on a Keras object, with what was there.

multigpu changes no Keras class for a plain model: it gives the objects of
one model their own attributes (the model's steps and loops, its optimizers'
``apply`` and update, its BatchNorm layers' ``_moments``, a
``BackupAndRestore``'s writing, and, for a model class with its own ``fit``,
a subclass of that class made by multigpu).  Each such change goes through
:meth:`Ledger.set`, which notes whether the object had an attribute of its own
by that name and what it held; :meth:`Ledger.undo` puts everything back in
reverse order, so that ``multigpu.unparallelize`` returns a plain Keras model.
"""

from __future__ import annotations

__all__ = ["Ledger"]

_ABSENT = object()


class Ledger:
    """The attributes set on Keras objects for one parallel model, oldest first."""

    def __init__(self) -> None:
        self._entries: list[tuple[object, str, object]] = []

    def set(self, obj, name: str, value) -> None:
        """Sets ``obj.name = value`` on the instance (no Keras ``__setattr__`` tracking), noting what it had."""
        own = vars(obj).get(name, _ABSENT) if hasattr(obj, "__dict__") else _ABSENT
        self._entries.append((obj, name, own))
        object.__setattr__(obj, name, value)

    def set_class(self, obj, cls: type) -> None:
        """Gives ``obj`` the class ``cls`` (a subclass of its own, made by multigpu), noting the class it had."""
        self._entries.append((obj, "__class__", type(obj)))
        object.__setattr__(obj, "__class__", cls)

    def owns(self, obj, name: str) -> bool:
        """Whether this ledger set ``obj.name``."""
        return any(o is obj and n == name for o, n, _ in self._entries)

    def undo(self) -> None:
        """Puts back every attribute in reverse order: the object's own value, or none (the class's again)."""
        for obj, name, own in reversed(self._entries):
            if name == "__class__":
                object.__setattr__(obj, "__class__", own)
            elif own is _ABSENT:
                try:
                    object.__delattr__(obj, name)
                except AttributeError:
                    pass
            else:
                object.__setattr__(obj, name, own)
        self._entries.clear()

    def entries(self) -> list[tuple[str, str]]:
        """``(type name, attribute)`` of every entry, oldest first."""
        return [(type(o).__name__, n) for o, n, _ in self._entries]

    def __len__(self) -> int:
        return len(self._entries)
