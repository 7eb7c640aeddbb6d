"""Everything in specdec that depends on which transformers release is installed, and the releases
each difference spans. Nothing else in specdec (or its drafters) tests the version.

Supported: transformers :data:`FLOOR` (5.8.0, the first release with Gemma 4's assistant, which the
``gemma_mtp`` drafter builds on) and every later 5.x release but those in :data:`EXCLUDED`;
pyproject.toml declares the same range, and ``make test-floor`` runs the conformance cases at the
floor (docs/testing.md, "Supported transformers").

- The cache a model reads and writes is passed as ``past_key_values=`` up to 5.23 and as ``cache=``
  from 5.24.0 on (the old name is still accepted there, with a deprecation warning, until 5.40). A
  name the model does not take is swallowed by its ``**kwargs`` without a word: the model then runs
  with a fresh cache of its own, and the KV store's keys never reach attention. So every call that
  hands a cache to a transformers module spells it :func:`cache_kwargs`, and every read of a cache
  from a model's output goes through :func:`output_cache` (the output field was renamed with it).
- A cache layer's abstract length method is ``get_max_cache_shape`` up to 5.12 and ``get_max_length``
  from 5.13.0 on: :class:`CacheLayer` implements both.
- The transformers features two drafters' peers mirror (``specdec.registry.transformers_peer``, what
  the runner's ``hf_compare`` runs side by side) arrived inside the range: :data:`FEATURES` says
  from which release, and :func:`require` refuses by name on an older one.
"""

from __future__ import annotations

import warnings
from typing import Any

import transformers
from packaging.version import Version
from transformers.cache_utils import CacheLayerMixin

__all__ = ["FLOOR", "EXCLUDED", "CACHE_ARG", "cache_kwargs", "output_cache", "installed", "check_supported", "CacheLayer", "FEATURES", "require"]

FLOOR = Version("5.8.0")  # the oldest release the conformance cases pass on (pyproject.toml says the same)
# releases inside the range that break a drafter, and what breaks (pyproject.toml excludes them too)
EXCLUDED = {Version("5.23.0"): "its Gemma 4 config refuses a model whose every layer reads shared K/V, as a Gemma 4 "
                               "assistant's do: the gemma_mtp drafter cannot build its assistant (fixed in 5.24.0)"}
_CACHE_RENAMED = Version("5.24.0")  # past_key_values= -> cache= (argument and output field)
# transformers features a drafter's transformers peer runs, by the first release that has them
FEATURES = {"generate(use_mtp=True)": Version("5.14.0"),  # the mtp drafter's peer
            "MuseGlimmerAssistantModel (DFlash)": Version("5.15.0")}  # the dflash drafter's peer


def installed() -> Version:
    """The installed transformers release (a dev or rc build counts as its release)."""
    return Version(Version(transformers.__version__).base_version)


def check_supported() -> None:
    """Raise ``ImportError`` naming the supported range when the installed transformers is older than
    :data:`FLOOR`, warn (once) on an :data:`EXCLUDED` release: pip enforces both, but a ``PYTHONPATH``
    or an image's own copy does not."""
    if installed() < FLOOR:
        raise ImportError(f"specdec needs transformers >= {FLOOR}; found {transformers.__version__} "
                          f"at {transformers.__file__} (docs/testing.md, \"Supported transformers\")")
    if installed() in EXCLUDED:
        warnings.warn(f"transformers {transformers.__version__} is outside specdec's range: {EXCLUDED[installed()]}",
                      stacklevel=2)


check_supported()

CACHE_ARG: str = "cache" if installed() >= _CACHE_RENAMED else "past_key_values"


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """``cache`` as the keyword argument this release's models and decoder layers take it by."""
    return {CACHE_ARG: cache}


def output_cache(output: Any) -> Any:
    """The cache a model's output carries (None when it carries none)."""
    return getattr(output, CACHE_ARG, None)


def require(feature: str) -> None:
    """Raise ``RuntimeError`` when the installed transformers predates ``feature`` (a :data:`FEATURES` key)."""
    if installed() < FEATURES[feature]:
        raise RuntimeError(f"{feature} needs transformers >= {FEATURES[feature]}; found {transformers.__version__}")


class CacheLayer(CacheLayerMixin):
    """transformers' cache-layer base with its length method under both of its names; a layer
    that grows on demand has no maximum (-1)."""

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return self.get_max_length()
