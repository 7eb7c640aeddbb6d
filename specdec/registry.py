"""Drafters and verifiers by name, for this package's own and for any other package's alike.

A name resolves, in order, to a class registered in this process (:func:`register_drafter`, a
decorator) or to an entry point of the group ``specdec.drafters`` (``specdec.verifiers`` for
verifiers) that an installed package declares in its ``pyproject.toml``::

    [project.entry-points."specdec.drafters"]
    my_drafter = "my_package.drafter:MyDrafter"

specdec declares its own drafters the same way, so the core names none of them and
``import specdec`` imports none: an entry point is loaded only when its name is asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from importlib.metadata import EntryPoint, entry_points
from typing import Generic, TypeVar

from specdec.drafter import Drafter
from specdec.verifier import Verifier

__all__ = ["Registry", "DRAFTERS", "VERIFIERS", "register_drafter", "register_verifier", "drafter_class",
           "verifier_class", "transformers_peers", "transformers_peer"]

T = TypeVar("T")


@lru_cache(maxsize=None)
def _entry_points(group: str) -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=group)}


class Registry(Generic[T]):
    """Names → classes of one kind (drafter or verifier): registered ones, then entry points."""

    def __init__(self, kind: str, group: str, base: type[T]):
        self.kind, self.group, self.base = kind, group, base
        self._classes: dict[str, type[T]] = {}

    def register(self, cls: type[T] | None = None, *, name: str | None = None,
                 replace: bool = False) -> type[T] | Callable[[type[T]], type[T]]:
        """Register ``cls`` under ``name`` (default: its ``name`` attribute); usable as a decorator."""
        def add(c: type[T]) -> type[T]:
            if not (isinstance(c, type) and issubclass(c, self.base)):
                raise TypeError(f"a {self.kind} must be a subclass of {self.base.__name__}, got {c!r}")
            key = name or getattr(c, "name", None)
            if not isinstance(key, str) or not key:
                raise ValueError(f"{c.__name__} needs a `name` class attribute (or pass name=...)")
            known = self._classes.get(key)
            if known is not None and known is not c and not replace:
                raise ValueError(f"{self.kind} {key!r} is already registered as {known.__module__}.{known.__name__};"
                                 " pass replace=True to override it")
            self._classes[key] = c
            return c

        return add(cls) if cls is not None else add

    def unregister(self, name: str) -> None:
        """Forget a class registered in this process (entry points stay)."""
        self._classes.pop(name, None)

    def names(self) -> list[str]:
        """Every known name: registered in this process or declared by an installed package."""
        return sorted(set(self._classes) | set(_entry_points(self.group)))

    def get(self, name: str) -> type[T]:
        """The class for ``name``; a clear error listing the known names when there is none."""
        if not isinstance(name, str):
            raise TypeError(f"a {self.kind} name must be a string, got {type(name).__name__}")
        if name in self._classes:
            return self._classes[name]
        ep = _entry_points(self.group).get(name)
        if ep is None:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {self.names()}")
        cls = ep.load()
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(f"entry point {name!r} = {ep.value} of group {self.group!r} is not a {self.base.__name__}")
        self._classes[name] = cls
        return cls

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._classes or name in _entry_points(self.group))


def transformers_peers() -> list[str]:
    """Names of the transformers ``generate()`` peers that installed packages declare (entry-point
    group ``specdec.transformers_peers``), each mirroring one drafter: what the runner may run side
    by side, naming no drafter itself."""
    return sorted(_entry_points("specdec.transformers_peers"))


def transformers_peer(name: str) -> Callable[..., dict]:
    """The hook of peer ``name``: ``(target, drafter, k) -> generate()``'s extra keyword arguments;
    it lives in the mirrored drafter's room and checks that the run's drafter is the one it mirrors."""
    ep = _entry_points("specdec.transformers_peers").get(name)
    if ep is None:
        raise ValueError(f"unknown transformers peer {name!r}; known: {transformers_peers()}")
    return ep.load()


DRAFTERS: Registry[Drafter] = Registry("drafter", "specdec.drafters", Drafter)
VERIFIERS: Registry[Verifier] = Registry("verifier", "specdec.verifiers", Verifier)
register_drafter = DRAFTERS.register
register_verifier = VERIFIERS.register
drafter_class = DRAFTERS.get
verifier_class = VERIFIERS.get
