"""One registry per extension point: the names a params key accepts, in one place (docs/extending.md).

The six extension points (augmentation presets, data sources, models, compression variants, export
formats, notification formats) each keep a `Registry`: a dict of frozen dataclasses, name -> what the
config, the docs and the implementation need to know of it, in the order the docs list them. It lives
in tasks/core/config/ beside the config section that names it, for two reasons: params.yaml is validated
before torch (or Prefect) is imported, and tasks/core imports nothing from the packages above it. So
the implementation, which does need torch, registers *against* the registry rather than holding it:

    # tasks/core/config/train.py: the entry (the one list)
    AUGMENT_PRESETS = Registry("train.augment", {"affine": AugmentPreset("...", shifts=True), ...})
    # tasks/train/augment.py: the implementation, under the entry's name
    POLICIES = Implementations(AUGMENT_PRESETS)
    @POLICIES.register("affine")
    def _affine(image_size): ...

From the registry alone come the values the config accepts (`Registry.named`: validated when params.yaml
is read, with pydantic's own "Input should be ..." message), the docs' tables (docs/hooks/registries.py
renders them at build time into the pages' `<!-- registry: NAME -->` markers) and, through the imports
the implementation makes, dvc.yaml's code deps (tests/flows/test_dvc_yaml.py). `Implementations.register`
refuses a name the registry does not hold when its module is imported, and tests/extending/ asserts
that every registry entry has its implementation: adding one is one entry, its implementation under
that name, and its test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Annotated, Generic, TypeVar

from pydantic import AfterValidator

E = TypeVar("E")  # a registry's entry: a frozen dataclass
F = TypeVar("F", bound=Callable[..., object])  # an implementation


class Registry(dict[str, E], Generic[E]):
    """The entries of one extension point, by name, in the order the docs list them.

    `key` is the params key that names an entry (`train.augment`); `summary_of` gives an entry's one
    line for the docs (its `summary` field). A plain dict, so that a test or a plug-in adds an entry the
    ordinary way (`REGISTRY[name] = Entry(...)`, or `monkeypatch.setitem`), and validation sees it at once.
    """

    def __init__(self, key: str, entries: dict[str, E]) -> None:
        super().__init__(entries)
        self.key = key

    def names(self) -> tuple[str, ...]:
        return tuple(self)

    def check(self, value: str, also: Iterable[str] = ()) -> str:
        """`value` if it names an entry (or is one of `also`, e.g. `auto`); else a ValueError worded as a
        Literal's error, which params.yaml's errors show as `key: Input should be 'a', 'b' or 'c' (got x)`."""
        allowed = [*self, *also]
        if value in allowed:
            return value
        quoted = [repr(name) for name in allowed]
        raise ValueError(
            "Input should be " + (quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}")
        )

    def named(self, *also: str) -> object:
        """The type of a config field holding one of these names (or of `also`): a string checked
        against the registry as it is when the config is validated."""
        return Annotated[str, AfterValidator(lambda value: self.check(value, also))]


class Implementations(dict[str, F], Generic[F]):
    """What an implementing module keeps per registry name: filled by `@IMPLEMENTATIONS.register(name)`.

    A name the registry lacks is refused when the module is imported (a typo, or an entry not added),
    not when a run first asks for it.
    """

    def __init__(self, registry: Registry, elsewhere: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.registry = registry
        self.elsewhere = elsewhere  # entries this module does not implement (it says where they are)

    def register(self, name: str) -> Callable[[F], F]:
        def add(implementation: F) -> F:
            if name not in self.registry:
                raise KeyError(
                    f"{name!r} is not in the {self.registry.key} registry: add its entry first (docs/extending.md)"
                )
            self[name] = implementation
            return implementation

        return add

    def missing(self) -> list[str]:
        """Registry entries without an implementation here (tests/extending/ keeps this empty)."""
        return [name for name in self.registry if name not in self and name not in self.elsewhere]
