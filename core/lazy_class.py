"""A named class given by qualified name (``"module:Class"``) and imported on first use.

Registries whose entries plugins provide (attention backends, quantization methods) name each
class by a string so that listing them and choosing among them imports nothing until one is
used. ``LazyClass`` is one such entry: it imports the class once, checks that it subclasses the
registry's base class and that its ``name`` attribute agrees with the name it is registered
under, and raises the registry's own error type with a message that says where the entry came
from. The registries subclass it and say how to describe an entry and what to advise.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

C = TypeVar("C")


def qualified_name(cls: type) -> str:
    """``module:Class`` for a class."""
    return f"{cls.__module__}:{cls.__qualname__}"


def import_qualified(qualname: str) -> Any:
    """The object ``"package.module:Attr.attr"`` names (imports the module)."""
    module_name, _, attr = qualname.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(eq=False)
class LazyClass(Generic[C]):
    """A registry entry: ``name`` and the class registered under it, or its ``module:Class``.

    Subclasses set ``base`` (what the class must subclass) and ``error`` (the exception type
    raised), and implement ``label`` (the entry in a message: what it is, its qualified name
    and who provides it).
    """

    base: ClassVar[type]
    error: ClassVar[type[Exception]]

    name: str
    target: type[C] | str
    _cls: type[C] | None = field(default=None, init=False, repr=False)

    @property
    def qualname(self) -> str:
        return self.target if isinstance(self.target, str) else qualified_name(self.target)

    def label(self) -> str:
        raise NotImplementedError

    def advice(self) -> str:
        """What a user can do when the entry cannot load (appended to the message)."""
        return ""

    def load(self) -> type[C]:
        """The class, imported and checked on the first call. Raises ``error`` naming the entry
        when the import fails, the object is not a ``base`` subclass or its ``name`` differs."""
        if self._cls is not None:
            return self._cls
        cls: Any = self.target
        if isinstance(cls, str):
            try:
                cls = import_qualified(cls)
            except Exception as exc:
                raise self.error(
                    f"Could not import {self.label()}: {type(exc).__name__}: {exc}.{self.advice()}"
                ) from exc
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise self.error(
                f"{self.label()} is {cls!r}, not a subclass of "
                f"{self.base.__module__}.{self.base.__qualname__}.{self.advice()}"
            )
        if cls.name != self.name:
            raise self.error(
                f"{self.label()} is registered as {self.name!r} but its class says "
                f"name = {cls.name!r}. The two must agree.{self.advice()}"
            )
        self._cls = cls
        return cls
