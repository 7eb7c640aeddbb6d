"""Typed configuration of an experiment run: the one set of settings behind every entry point.

Hydra (``experiments/run.py``) composes YAML from ``experiments/conf/`` onto these dataclasses and
converts once with ``OmegaConf.to_object``; the notebook and the tests build them directly. This
module never imports hydra. Sampling is the library's own :class:`~specdec.sampling.SamplingParams`
(not a copy of its fields); drafter and verifier options are the keyword arguments of
:func:`specdec.make_drafter` / :func:`specdec.make_verifier`, validated by the drafter's own config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, NamedTuple, get_args, get_origin, get_type_hints

from specdec.data.config import DATASETS, DatasetConfig, TargetConfig
from specdec.policy import POLICIES
from specdec.registry import transformers_peers
from specdec.sampling import SamplingParams

__all__ = ["TargetConfig", "DrafterConfig", "VerifierConfig", "DatasetConfig", "MethodConfig", "RooflineConfig",
           "RunConfig", "Method", "DATASETS", "hf_methods", "MODES", "POLICY_NAMES", "check_keys"]

# what a run does: "decode" runs the dataset through every method (specdec.eval.runner); "roofline"
# times the target forward against this machine's limits (specdec.eval.roofline)
MODES = ("decode", "roofline")


def hf_methods() -> tuple[str, ...]:
    """transformers ``generate()`` peers a run may decode side by side (batch 1, ``hf_compare``):
    ``generate`` (plain, the peer of the ``ar`` loop) and every peer a drafter's room declares
    (:func:`specdec.registry.transformers_peers`); the runner names no drafter."""
    return ("generate", *transformers_peers())


# draft-length policies (specdec.policy): "fixed" verifies every proposed node (k), "adaptive" as many as pay
POLICY_NAMES = ("fixed", *POLICIES)


def _check_policy(key: str, policy: str | None) -> None:
    if policy is not None and policy not in POLICY_NAMES:
        raise ValueError(f"{key} must be one of {', '.join(POLICY_NAMES)}, got {policy!r}")


@dataclass
class DrafterConfig:
    name: str | None = None  # a key of specdec.drafters.DRAFTERS; None = autoregressive only
    options: dict[str, Any] = field(default_factory=dict)  # make_drafter(name, target, **options)


@dataclass
class VerifierConfig:
    name: str = "rejection"  # a key of specdec.verifiers.VERIFIERS
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class MethodConfig:
    """A speculative method of a run (an entry of ``RunConfig.methods``, named by its key): a drafter
    at one or more k. Every method runs in the same process, batch by batch in turn with the others."""

    drafter: str | None = None  # a key of specdec.drafters.DRAFTERS; None = the run's drafter
    options: dict[str, Any] = field(default_factory=dict)  # over the run's drafter options if the same drafter
    k: list[int] = field(default_factory=list)  # one method per k ("<key> k=<k>" if several); [] = the run's k
    policy: str | None = None  # draft-length policy (POLICY_NAMES); None = the run's


class Method(NamedTuple):
    """One speculative method of a run, as it runs."""

    drafter: DrafterConfig
    k: int  # draft tokens (tree depth) asked of the drafter per step
    policy: str  # "fixed": every proposed node verified; "adaptive": specdec.policy.AdaptivePolicy


@dataclass
class RooflineConfig:
    """The grid of ``mode: roofline`` (:mod:`specdec.eval.roofline`). Each list is one axis; the
    forward sweep runs their product, the context sweep batch 1 at the first thread count in the
    target's dtype."""

    impls: list[str] = field(default_factory=lambda: ["library", "transformers"])  # whose forward is timed (+ library_general: fast paths off; library_unpacked: no packed weights; library_gqa: heads unpacked in attention)
    batches: list[int] = field(default_factory=lambda: [1, 4, 16])
    threads: list[int] = field(default_factory=lambda: [1, 2])  # torch intra-op threads
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    new_tokens: list[int] = field(default_factory=lambda: [1, 2, 3, 5, 9, 17, 32])  # m: tokens in one forward
    masks: list[str] = field(default_factory=lambda: ["chain", "tree"])  # tree: a binary tree of m nodes (m >= 3)
    context: int = 128  # committed tokens before every timed forward of the m sweep
    max_block_tokens: int = 0  # skip forwards of more than batch * m tokens (0: none); the skipped are listed
    reps: int = 3  # forwards per point; the best is reported (the first pays any one-off cost)
    contexts: list[int] = field(default_factory=lambda: [128, 1024, 2048, 4096, 8192])  # the context sweep
    context_new_tokens: list[int] = field(default_factory=lambda: [1, 5])  # m of the context sweep
    speedup_contexts: list[int] = field(default_factory=lambda: [128, 1024, 4096])  # the run's methods at these
    stream_mib: int = 0  # MiB per STREAM array; 0: four times the last-level cache, at least 64
    linear_size: int = 1024  # n of the n x n by n x n F.linear that measures peak FLOP/s
    seed: int = 0  # token ids of the timed forwards (their values do not change the time)

    def __post_init__(self) -> None:
        if unknown := sorted(set(self.impls) - {"library", "library_general", "library_unpacked", "library_gqa",
                                                "transformers"}):
            raise ValueError("roofline.impls must be among library, library_general, library_unpacked, library_gqa"
                             f" and transformers, got {unknown}")
        if unknown := sorted(set(self.masks) - {"chain", "tree"}):
            raise ValueError(f"roofline.masks must be chain and/or tree, got {unknown}")
        if unknown := sorted(set(self.dtypes) - {"float32", "bfloat16", "float16"}):
            raise ValueError(f"roofline.dtypes must be float32, bfloat16 or float16, got {unknown}")
        sizes = {"batches": self.batches, "threads": self.threads, "new_tokens": self.new_tokens,
                 "contexts": self.contexts, "context_new_tokens": self.context_new_tokens,
                 "speedup_contexts": self.speedup_contexts, "context": [self.context], "reps": [self.reps],
                 "linear_size": [self.linear_size]}
        for name, xs in sizes.items():
            if any(x < 1 for x in xs):
                raise ValueError(f"roofline.{name} must be >= 1, got {xs}")
        if 1 not in self.new_tokens:
            raise ValueError("roofline.new_tokens needs m = 1: every ratio is t(m) / t(1)")


@dataclass
class RunConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)  # its seed, if set, replaces `seed`
    num_speculative_tokens: int = 4  # k: draft tokens (tree nodes) per step
    policy: str = "fixed"  # how many of the k drafts each row verifies per step: POLICY_NAMES
    concurrency: int = 1  # requests decoded together as one batch
    seed: int = 0  # request i samples with seed + i; the random dataset and shuffling use it too
    baseline: bool = True  # also decode autoregressively in the same run (speedups need it)
    methods: dict[str, MethodConfig] = field(default_factory=dict)  # {} = one method "spec": the drafter at k
    hf_compare: list[str] = field(default_factory=list)  # hf_methods() run side by side
    warmup: bool = True  # one short untimed run of every method first
    progress: bool = True  # tqdm bars
    threads: int = 1  # torch intra-op CPU threads (experiments/run.py sets them): one keeps timings stable on a shared CPU
    mode: str = "decode"  # one of MODES
    roofline: RooflineConfig = field(default_factory=RooflineConfig)  # mode: roofline only
    # the checkpoints this run reads that are recorded but not committed (a fresh clone makes them
    # first: specdec.models.unmade_checkpoints names the commands); a preset declares them
    needs_remake: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        unknown = sorted(set(self.hf_compare) - set(hf_methods()))
        if unknown:
            raise ValueError(f"unknown hf_compare methods {unknown}; known: {sorted(hf_methods())}")
        _check_policy("policy", self.policy)
        for key, m in self.methods.items():
            _check_policy(f"methods.{key}.policy", m.policy)
            if m.drafter is None and self.drafter.name is None:
                raise ValueError(f"methods.{key} names no drafter and the run has none: set methods.{key}.drafter")
            if any(k < 1 for k in m.k):
                raise ValueError(f"methods.{key}.k must be >= 1, got {m.k}")

    def speculative_methods(self) -> dict[str, Method]:
        """Every speculative method, in order: its name -> (its drafter, its k, its policy). Without
        ``methods``, the run's drafter at ``num_speculative_tokens`` as ``spec`` (none without a drafter)."""
        if not self.methods:
            return {"spec": Method(self.drafter, self.num_speculative_tokens, self.policy)} if self.drafter.name else {}
        out: dict[str, Method] = {}
        for key, m in self.methods.items():
            same = m.drafter in (None, self.drafter.name)
            drafter = DrafterConfig(m.drafter or self.drafter.name, {**(self.drafter.options if same else {}),
                                                                     **m.options})
            ks = m.k or [self.num_speculative_tokens]
            for k in ks:
                out[key if len(ks) == 1 else f"{key} k={k}"] = Method(drafter, k, m.policy or self.policy)
        return out

    @property
    def request_seed_base(self) -> int:
        return self.sampling.seed if self.sampling.seed is not None else self.seed


def check_keys(data: Mapping[str, Any], schema: type = RunConfig, prefix: str = "") -> None:
    """Raise ``ValueError`` naming the first key of ``data`` (a config as plain mappings) that is no
    field of ``schema``, with the valid ones. Run before converting: a key added with Hydra's ``+``
    (``+sampling.temprature=0.5``) would otherwise become a stray attribute, or fail inside the
    conversion on a frozen dataclass without saying which key is wrong. Free-form option dicts
    (``drafter.options``, ``target.tiny``) are not checked here; their consumers validate them."""
    hints, names = get_type_hints(schema), [f.name for f in fields(schema)]
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in names:
            where = f" of {prefix[:-1]}" if prefix else ""
            raise ValueError(f"unknown config key {path!r}; the valid keys{where} are: {', '.join(names)}")
        tp = hints[key]
        if not isinstance(value, Mapping):
            continue
        if is_dataclass(tp):
            check_keys(value, tp, f"{path}.")
        elif get_origin(tp) is dict and is_dataclass(get_args(tp)[1]):
            for name, item in value.items():
                if isinstance(item, Mapping):
                    check_keys(item, get_args(tp)[1], f"{path}.{name}.")
