"""The target feature store: one pass of the target over a token stream, read by every recipe.

A drafter recipe trains on what the target computes for its data: hidden states of some layers
(EAGLE-3's three, DFlash's and DSpark's evenly spaced ones), the final hidden state (through the
target's LM head: its full next-token distribution, the forward-KL label at every position), and
for an assistant-style drafter (``gemma_mtp``) the K/V rows of the layers it attends to. Running
the target is most of a recipe's cost, so the store runs it once for the union of what the recipes
declare (:meth:`specdec.training.recipe.Recipe.store_needs`) and keeps it on disk, as SpecForge's
offline mode and speculators' data generation do on GPUs.

Layout of a store folder:

- ``manifest.json``: the target (id and a SHA-256 of its weights), the stored hidden-state ids
  (layer inputs, :meth:`specdec.target.Target.features` numbering), the K/V layers, the dtype, the
  data sources with their settings and the command that made it, the held-out rule, and per shard
  its sequences and tokens;
- ``shard-NNNNN.safetensors``: ``tokens`` int32 [N], ``offsets`` int64 [n+1] (sequence ``i`` is rows
  ``offsets[i]:offsets[i+1]``), ``response_start`` [n], ``held_out`` [n] (uint8), ``source`` [n]
  (an index into the manifest's sources), ``hidden.<id>`` and ``final`` bf16 [N, D], and
  ``k.<layer>`` / ``v.<layer>`` bf16 [N, H_kv·d].

Shards are read memory-mapped (``safe_open``): a batch reads its own rows only, so a store far
larger than memory trains. The writer resumes at the first missing shard (a shard is written to a
temporary name and renamed), refuses a folder made for another target or other layers, and shards
its work over processes with ``accelerate`` (process ``p`` of ``P`` writes shards ``p, p+P, ...``),
so several GPUs fill one store. The lab's ``store`` mode fills one (docs/training.md)::

    python experiments/run.py --config-name lab/store out=outputs/store/smollm2 sources=[corpus,sharegpt,stdlib]

While a recipe trains from a store its target never runs (:class:`StoredRow` refuses every forward):
the target's weights still serve its head (``target.logits``) and embeddings.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from specdec.data.sequences import TokenSeq
from specdec.data.sources import StoreItem
from specdec.target import Target
from specdec.timing import Stopwatch, now
from specdec.transformers_versions import output_cache

__all__ = ["FORMAT", "StoreItem", "StoreNeeds", "FeatureStore", "StoredRow", "StoreMismatch", "weights_hash", "write_store",
           "target_kv", "forward_with_kv", "store_bytes_per_token", "throughput", "recipe_needs",
           "DEFAULT_RECIPES"]

FORMAT = "specdec-feature-store/1"
MANIFEST = "manifest.json"


class StoreMismatch(ValueError):
    """A store made for another target, other layers or another held-out rule than this run asks for."""


@dataclass(frozen=True)
class StoreNeeds:
    """What one recipe reads from its target: hidden-state ids (layer inputs) and K/V layer indices.
    The final hidden state is always stored."""

    layers: tuple[int, ...] = ()
    kv: tuple[int, ...] = ()

    def union(self, other: StoreNeeds) -> StoreNeeds:
        return StoreNeeds(tuple(sorted(set(self.layers) | set(other.layers))), tuple(sorted(set(self.kv) | set(other.kv))))


def weights_hash(target: Target) -> str:
    """SHA-256 over the target's parameters (names, shapes and float32 bytes): the store's identity
    of its target, independent of the dtype the target happens to run in."""
    h = hashlib.sha256()
    for name, p in sorted(target.model.state_dict().items()):
        h.update(name.encode())
        h.update(str(tuple(p.shape)).encode())
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def forward_with_kv(target: Target, tokens: Tensor, layers: Iterable[int], kv: Iterable[int]
                    ) -> tuple[dict[int, Tensor], Tensor, dict[int, tuple[Tensor, Tensor]]]:
    """One cache-free forward over ``tokens`` [B, T]: {layer-input id: [B, T, D]}, the post-norm final
    hidden state [B, T, D] and {layer: (K, V)} each [B, T, H_kv, d] (keys after RoPE, as the target
    caches them). K/V come from the same forward's cache, so a store costs one target pass."""
    layers, kv = tuple(layers), tuple(kv)
    if any(not 0 <= i <= target.num_layers for i in layers):
        raise ValueError(f"hidden-state ids {list(layers)} outside [0, {target.num_layers}]")
    if any(not 0 <= i < target.num_layers for i in kv):
        raise ValueError(f"K/V layers {list(kv)} outside [0, {target.num_layers})")
    with torch.no_grad(), target.norm_input(target.num_layers in layers) as norm_input:
        out = target.decoder(input_ids=tokens.to(target.device), output_hidden_states=bool(layers),
                             use_cache=bool(kv))
    hidden = target.layer_inputs(out.hidden_states, norm_input, layers) if layers else {}
    rows = {}
    cache = output_cache(out) if kv else None
    for i in kv:
        layer = cache.layers[i]
        if layer.keys.shape[-2] != tokens.shape[1]:  # a sliding-window cache keeps only its window
            raise ValueError(f"layer {i} caches {layer.keys.shape[-2]} of {tokens.shape[1]} positions (a sliding "
                             f"window): its K/V rows cannot be stored whole; cut sequences to the window")
        rows[i] = (layer.keys.transpose(1, 2), layer.values.transpose(1, 2))
    return hidden, out.last_hidden_state, rows


def target_kv(target: Target | StoredRow, tokens: Tensor, sources: dict[str, int]) -> dict[str, tuple[Tensor, Tensor]]:
    """The keys and values the target caches for ``tokens`` [B, T] at the layer of each attention type
    {type: layer}: {type: (K, V)}, each [B, T, H_kv, d]. From the store when ``target`` is a stored
    row; else one forward (right padding is harmless: a causal model's real positions never see it)."""
    if isinstance(target, StoredRow):
        return {t: target.kv(tokens, i) for t, i in sources.items()}
    _, _, rows = forward_with_kv(target, tokens, (), sorted(set(sources.values())))
    return {t: rows[i] for t, i in sources.items()}


def store_bytes_per_token(target: Target, needs: StoreNeeds, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one token takes in a store: hidden states, the final one, K/V rows, its id (int32)."""
    d = target.text_config.hidden_size
    kv = sum(2 * target.layer_specs()[i].num_kv_heads * target.layer_specs()[i].head_dim for i in needs.kv)
    return (len(needs.layers) + 1) * d * dtype.itemsize + kv * dtype.itemsize + 4


# --- reading ----------------------------------------------------------------------------------------

class FeatureStore:
    """A store folder, read memory-mapped: its sequences and each sequence's stored rows."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        file = self.path / MANIFEST
        if not file.is_file():
            raise FileNotFoundError(f"{self.path} is not a feature store (no {MANIFEST}); make one "
                                    f"(the lab's store mode: `experiments/run.py --config-name lab/store out={self.path} ...`)")
        self.manifest: dict[str, Any] = json.loads(file.read_text())
        if self.manifest.get("format") != FORMAT:
            raise StoreMismatch(f"{file}: format {self.manifest.get('format')!r}, this library reads {FORMAT!r}")
        self.layers = tuple(self.manifest["layers"])
        self.kv_layers = tuple(self.manifest["kv_layers"])
        self.shards = _finished_shards(self.path)  # the contiguous prefix on disk: another process may be behind
        self._open: dict[int, Any] = {}
        self._index: list[tuple[int, int, int]] = []  # sequence -> (shard, row start, row end)
        self.sequences: list[TokenSeq] = []
        self.held: list[bool] = []
        self.source: list[str] = []
        names = [s["name"] for s in self.manifest["sources"]]
        for si, shard in enumerate(self.shards):
            f = self._file(si)
            tokens, off = f.get_tensor("tokens").long(), f.get_tensor("offsets").tolist()
            starts, held, src = (f.get_tensor(k).tolist() for k in ("response_start", "held_out", "source"))
            for j, (a, b) in enumerate(zip(off[:-1], off[1:])):
                self._index.append((si, a, b))
                self.sequences.append(TokenSeq(tokens[a:b], int(starts[j])))
                self.held.append(bool(held[j]))
                self.source.append(names[int(src[j])])

    @property
    def num_tokens(self) -> int:
        return sum(int(s.tokens.numel()) for s in self.sequences)

    def _file(self, shard: int):
        if shard not in self._open:
            self._open[shard] = safe_open(str(self.path / self.shards[shard]["file"]), framework="pt")
        return self._open[shard]

    def rows(self, i: int, name: str) -> Tensor:
        """Sequence ``i``'s stored rows of tensor ``name`` (``hidden.<id>``, ``final``, ``k.<layer>`` ...)."""
        shard, a, b = self._index[i]
        return self._file(shard).get_slice(name)[a:b]

    def check(self, target: Target, needs: StoreNeeds | None = None, held_out_every: int | None = None) -> None:
        """Refuse this store for ``target`` unless it was made by the same weights, holds every layer
        ``needs`` names and follows the run's held-out rule: a clear error before any training."""
        want = self.manifest["target"]
        got = weights_hash(target)
        if got != want["hash"]:
            raise StoreMismatch(f"{self.path} was made for another target ({want['id']}, weights {want['hash'][:12]}), "
                                f"this run's target has weights {got[:12]}: make a store for it "
                                f"(the lab's store mode: `experiments/run.py --config-name lab/store out=<folder> ...`)")
        if needs is not None:
            missing = sorted(set(needs.layers) - set(self.layers))
            missing_kv = sorted(set(needs.kv) - set(self.kv_layers))
            if missing or missing_kv:
                raise StoreMismatch(f"{self.path} holds hidden states {list(self.layers)} and K/V of layers "
                                    f"{list(self.kv_layers)}; this recipe also reads hidden states {missing} and K/V "
                                    f"{missing_kv}: make a store with those layers (--layers/--kv-layers)")
        every = self.manifest["held_out"]["every"]
        if held_out_every is not None and held_out_every != every:
            raise StoreMismatch(f"{self.path} marks held-out items by 1 in {every} (data.held_out_every), "
                                f"this run asks for 1 in {held_out_every}")


class StoredRow:
    """One stored sequence, standing in for the target in a recipe's ``featurize``: its ``features``
    and :func:`target_kv` read the store, everything that would run the target raises, and every
    other attribute (the LM head, embeddings, config) is the real target's."""

    _RUNS = frozenset({"forward", "prefill", "new_session", "hidden", "decoder", "model", "layers", "generate"})

    def __init__(self, target: Target, store: FeatureStore, index: int):
        self._target, self._store, self._index = target, store, index

    def __getattr__(self, name: str):
        if name in StoredRow._RUNS:
            raise RuntimeError(f"training from the store {self._store.path}: the target does not run "
                               f"(the recipe asked for target.{name}); read features through target_features/target_kv")
        return getattr(self._target, name)

    def _check(self, tokens: Tensor) -> None:
        own = self._store.sequences[self._index].tokens
        if tokens.shape[0] != 1 or not torch.equal(tokens[0].cpu(), own):
            raise ValueError("a stored row answers for its own sequence only (one row, the stored tokens)")

    def _read(self, name: str) -> Tensor:
        """Rows of ``name`` as the target would have computed them: on its device, in its dtype (a bf16
        store gives bf16-rounded values), so its head applies to them as to its own output."""
        return self._store.rows(self._index, name).to(self._target.device, self._target.dtype).unsqueeze(0)

    def features(self, tokens: Tensor, layer_inputs: list[int] | tuple[int, ...] = ()) -> tuple[dict[int, Tensor], Tensor]:
        """What :meth:`Target.features` returns, read from the store."""
        self._check(tokens)
        missing = sorted(set(layer_inputs) - set(self._store.layers))
        if missing:
            raise StoreMismatch(f"{self._store.path} holds no hidden states {missing} (it has {list(self._store.layers)})")
        return {i: self._read(f"hidden.{i}") for i in layer_inputs}, self._read("final")

    def kv(self, tokens: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        """Layer ``layer``'s (K, V) for the row, each [1, T, H_kv, d]."""
        self._check(tokens)
        if layer not in self._store.kv_layers:
            raise StoreMismatch(f"{self._store.path} holds no K/V of layer {layer} (it has {list(self._store.kv_layers)})")
        spec = self._store.manifest["kv_shape"][str(layer)]
        k, v = self._read(f"k.{layer}"), self._read(f"v.{layer}")
        return k.unflatten(-1, tuple(spec)), v.unflatten(-1, tuple(spec))


# --- writing ----------------------------------------------------------------------------------------

def _shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def _write_shard(target: Target, items: list[StoreItem], path: Path, needs: StoreNeeds, batch_tokens: int,
                 dtype: torch.dtype, forward=forward_with_kv) -> int:
    """Run the target over ``items`` (length-sorted batches of about ``batch_tokens`` padded tokens)
    and write one shard; returns its token count."""
    n = len(items)
    lengths = [int(it.seq.tokens.numel()) for it in items]
    out: dict[str, list[Tensor | None]] = {}
    order = sorted(range(n), key=lambda i: lengths[i])
    lo = 0
    while lo < n:
        hi = lo + 1
        while hi < n and lengths[order[hi]] * (hi + 1 - lo) <= batch_tokens:
            hi += 1
        idx = order[lo:hi]
        T = max(lengths[i] for i in idx)
        tokens = torch.zeros(len(idx), T, dtype=torch.long)
        for r, i in enumerate(idx):
            tokens[r, : lengths[i]] = items[i].seq.tokens
        hidden, final, kv = forward(target, tokens, needs.layers, needs.kv)
        named = {**{f"hidden.{i}": h for i, h in hidden.items()}, "final": final}
        for layer, (k, v) in kv.items():
            named[f"k.{layer}"], named[f"v.{layer}"] = k.flatten(-2), v.flatten(-2)
        for name, t in named.items():
            rows = out.setdefault(name, [None] * n)
            for r, i in enumerate(idx):
                rows[i] = t[r, : lengths[i]].to("cpu", dtype)
        lo = hi
    offsets = torch.tensor([0] + lengths).cumsum(0)
    tensors = {name: torch.cat(rows).contiguous() for name, rows in out.items()}  # type: ignore[arg-type]
    tensors.update(tokens=torch.cat([it.seq.tokens for it in items]).to(torch.int32), offsets=offsets,
                   response_start=torch.tensor([it.seq.response_start for it in items]),
                   held_out=torch.tensor([it.held_out for it in items], dtype=torch.uint8),
                   source=torch.tensor([it.source for it in items], dtype=torch.int16))
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)
    return int(offsets[-1])


def _chunks(items: Iterator[StoreItem], size: int) -> Iterator[list[StoreItem]]:
    chunk: list[StoreItem] = []
    for it in items:
        chunk.append(it)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def write_store(target: Target, target_id: str, items: Iterable[StoreItem], out: str | Path, needs: StoreNeeds,
                sources: list[dict[str, Any]], held_out_every: int, shard_sequences: int = 64,
                batch_tokens: int = 2048, dtype: torch.dtype = torch.bfloat16, command: str | None = None,
                max_tokens: int | None = None, progress: bool = False, target_hash: str | None = None) -> FeatureStore:
    """Fill (or resume) the store at ``out`` from ``items`` (a deterministic stream: resuming walks it
    again and skips the shards on disk). Under ``accelerate launch`` process ``p`` of ``P`` writes
    shards ``p, p+P, ...``; the main process writes the manifest. ``max_tokens`` stops after the shard
    that reaches it (counting every shard of the stream, written now or before). ``target_hash``: the
    checkpoint's :func:`weights_hash` taken before the target was cast to a compute dtype (default: of
    ``target`` as it is), so a store computed in bf16 still names the fp32 weights that train from it."""
    from accelerate import PartialState

    state = PartialState(cpu=target.device.type == "cpu")  # a CPU target: gloo processes, not one process each
    out = Path(out)
    spec = {"format": FORMAT, "target": {"id": target_id, "hash": target_hash or weights_hash(target)},
            "layers": list(needs.layers), "kv_layers": list(needs.kv), "dtype": str(dtype).removeprefix("torch."),
            "compute_dtype": str(target.dtype).removeprefix("torch."),
            "hidden_size": target.text_config.hidden_size,
            "kv_shape": {str(i): [target.layer_specs()[i].num_kv_heads, target.layer_specs()[i].head_dim] for i in needs.kv},
            "sources": sources, "held_out": {"rule": "specdec.data.sources: an item whose identity hashes to 0 mod every "
                                                     "(specdec.data.datasets.held_out); benchmark items never enter",
                                             "every": held_out_every},
            "shard_sequences": shard_sequences}
    file = out / MANIFEST
    if file.is_file():
        old = {"compute_dtype": "float32", **json.loads(file.read_text())}  # stores before the key ran fp32
        for key in ("format", "target", "layers", "kv_layers", "dtype", "compute_dtype", "sources", "held_out",
                    "shard_sequences"):
            if old.get(key) != spec[key]:
                raise StoreMismatch(f"{out} was made with {key}={old.get(key)!r}; this command asks for "
                                    f"{spec[key]!r}: use another --out (or delete the folder)")
    state.wait_for_everyone()
    if state.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        if not file.is_file():
            file.write_text(json.dumps({**spec, "command": command, "shards": [], "tokens": 0, "sequences": 0}, indent=1))
    state.wait_for_everyone()
    before = len(_finished_shards(out))
    seen, t0, made = 0, now(), 0
    target.model.eval()
    for i, chunk in enumerate(_chunks(iter(items), shard_sequences)):
        path = out / _shard_name(i)
        if i % state.num_processes == state.process_index and not path.is_file():
            _write_shard(target, chunk, path, needs, batch_tokens, dtype)
            made += sum(int(c.seq.tokens.numel()) for c in chunk)
            if progress:
                rate = made / max(1e-9, now() - t0)
                print(f"[store p{state.process_index}] {path.name}: {seen:,} tokens before it, "
                      f"{rate:.0f} tokens/s", file=sys.stderr, flush=True)
        seen += sum(int(c.seq.tokens.numel()) for c in chunk)
        if state.is_main_process:
            _write_manifest(out)
        if max_tokens is not None and seen >= max_tokens:
            break
    state.wait_for_everyone()
    if state.is_main_process:
        _write_manifest(out, command, before)
    state.wait_for_everyone()
    return FeatureStore(out)


def _finished_shards(out: Path) -> list[dict[str, Any]]:
    """Shards 0, 1, ... up to the first one not on disk, with their sequence and token counts: a store
    reads only this prefix, so its sequence order never changes while processes fill it out of order."""
    found, i = [], 0
    while (out / _shard_name(i)).is_file():
        with safe_open(str(out / _shard_name(i)), framework="pt") as f:
            off = f.get_tensor("offsets")
        found.append({"file": _shard_name(i), "sequences": int(off.numel() - 1), "tokens": int(off[-1])})
        i += 1
    return found


def _write_manifest(out: Path, command: str | None = None, before: int = 0) -> None:
    """The manifest with the contiguous shards on disk (an interrupted run lists what it finished).
    ``command`` replaces the recorded one when the contiguous shards now reach past the ``before``
    there were: the fill that extended the store (a larger ``--tokens``) is the one command that
    remakes all of it, the first shards alike."""
    file = out / MANIFEST
    man = json.loads(file.read_text())
    done = _finished_shards(out)
    man.update(shards=done, tokens=sum(s["tokens"] for s in done), sequences=sum(s["sequences"] for s in done))
    if command is not None and len(done) > before:
        man["command"] = command
    tmp = file.with_suffix(".tmp")
    tmp.write_text(json.dumps(man, indent=1))
    tmp.replace(file)


def throughput(target: Target, items: list[StoreItem], needs: StoreNeeds, dtypes: tuple[str, ...] = ("float32", "bfloat16"),
               rounds: int = 2, batch_tokens: int = 2048) -> list[dict[str, Any]]:
    """Tokens per second of filling a shard of ``items`` with the target in each compute dtype (rows
    stored in bf16 either way), the dtypes interleaved ``rounds`` times so a busy machine's drift
    hits each alike; each row splits the time into the target's forward and the rest (casting,
    copying, writing the shard)."""
    rows = []
    tokens = sum(int(it.seq.tokens.numel()) for it in items)
    for r in range(rounds):
        for name in dtypes:
            target.model.to(getattr(torch, name))
            forward_s = 0.0

            def timed_forward(*a, **k):
                nonlocal forward_s
                with Stopwatch() as sw:
                    out = forward_with_kv(*a, **k)
                forward_s += sw.seconds
                return out

            with tempfile.TemporaryDirectory() as tmp, Stopwatch() as total:
                _write_shard(target, items, Path(tmp) / "shard.safetensors", needs, batch_tokens, torch.bfloat16,
                             timed_forward)
            rows.append({"round": r, "compute_dtype": name, "tokens": tokens, "seconds": round(total.seconds, 3),
                         "tokens_per_s": round(tokens / total.seconds, 1),
                         "forward_share": round(forward_s / total.seconds, 3)})
    target.model.to(torch.float32)
    return rows


# --- the command --------------------------------------------------------------------------------------

def recipe_needs(target: Target, recipes: Iterable[str]) -> StoreNeeds:
    """The union of what the named recipes (dotted paths, default options) read from ``target``."""
    import importlib

    needs = StoreNeeds()
    for path in recipes:  # the recipes are found by name: the data layer imports no trainer
        module, _, name = path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        needs = needs.union(cls(cls.Options()).store_needs(target))
    return needs


DEFAULT_RECIPES = ("specdec.drafters.eagle3.train.Eagle3Recipe", "specdec.drafters.dflash.train.DFlashRecipe",
                   "specdec.drafters.dspark.train.DSparkRecipe", "specdec.drafters.gemma_mtp.train.GemmaMTPRecipe",
                   "specdec.drafters.mtp.train.PostHocMTPRecipe")
