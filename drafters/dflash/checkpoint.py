"""Reading and writing block-draft checkpoints (DFlash, DSpark) in the published layouts.

All three layouts share the backbone's weight names (``layers.{i}.self_attn.{q,k,v,o}_proj``,
``q_norm``, ``k_norm``, ``mlp.{gate,up,down}_proj``, ``input_layernorm``,
``post_attention_layernorm``, ``fc``, ``hidden_norm``, ``norm``); they differ in ``config.json``:

- **z-lab** (``architectures: ["DFlashDraftModel"]``): the draft's transformer fields at top level,
  ``block_size``, ``num_target_layers`` and ``dflash_config: {mask_token_id, target_layer_ids}``
  (older files put the last two at top level). Written by :func:`save_block_draft` for DFlash.
- **z-lab DFlash 2** (``architectures: ["DFlash2DraftModel"]``): the z-lab layout with DFlash 2's
  fields in ``dflash_config`` and its weights beside the backbone's; read and written by the
  family :mod:`specdec.drafters.dflash2.model` registers. A file without them is plain DFlash.
- **speculators** (``speculators_model_type: "dflash" | "dspark"``): the transformer fields under
  ``transformer_layer_config``, ids in ``aux_hidden_state_layer_ids``, ``mask_token_id``,
  ``block_size``, and ``sample_from_anchor`` (the anchor drafts too, as DSpark). Its ids index
  ``hidden_states`` (0 = the embeddings), so each is the z-lab id + 1 (speculators' converter adds
  one; vLLM subtracts it). A draft vocabulary is speculators' reduced one: ``draft_vocab_size``
  rows, ``t2d`` [V] bool, ``d2t`` [Vd] offsets and the LM head's rows (the verifier's, which
  speculators freezes), read back as a ``t2d`` mask over the target's own head. Written by
  :func:`save_block_draft` with ``layout="speculators"``, field by field as speculators 0.9.0 saves
  (``architectures`` ``DFlashDraftModel``/``DSparkDraftModel``, ``dtype``, ``speculators_version``,
  the verifier's architectures; :mod:`specdec.drafters.speculators_format`), and its converter's
  layer rule: a layer id naming the verifier's last layer (hidden_states index L) is dropped.
- **DeepSpec** (``architectures: ["Qwen3DSparkModel"]``): a copy of the target's config plus
  ``block_size``, ``mask_token_id``, ``target_layer_ids``, ``markov_rank``, ``markov_head_type``,
  ``enable_confidence_head``, ``confidence_head_with_markov``; weights add
  ``markov_head.markov_w{1,2}.weight`` and ``confidence_head.proj.*``. DFlash checkpoints of
  DeepSpec are the same with ``markov_rank: 0`` and no confidence head. Written for DSpark.

This module reads the backbone's fields of every layout and writes the z-lab and speculators ones. Which family a
file holds follows from its layout (z-lab: DFlash; DeepSpec, and speculators files whose anchor
drafts: DSpark); a family that extends the backbone registers how it reads its own fields and
writes its layout (:func:`register_block_family`; DSpark does in
:mod:`specdec.drafters.dspark.model`), so this room imports nothing of DSpark's.

Embeddings and LM head, when a file carries them, are skipped: the target's are used. An
optional ``t2d`` tensor ([V] bool) restricts drafts to a draft vocabulary
(:meth:`~specdec.drafters.dflash.model.BlockDraftModel.set_draft_vocab`); exports write no
``draft_vocab_size`` beside it in z-lab/DeepSpec files (vLLM would read it as the row count of a
draft LM head with a ``d2t`` map) and the reduced one's in speculators files. Weights are
read with safetensors only; nothing is unpickled.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdec.drafters.dflash.model import BlockDraftConfig, BlockDraftModel
from specdec.drafters.speculators_format import SPECULATORS_VERSION, dtype_name, verifier_block
from specdec.models import safetensors_files

__all__ = ["BlockFamily", "register_block_family", "config_from_dict", "checkpoint_family", "load_block_draft",
           "save_block_draft"]

_SKIP = ("embed_tokens.", "lm_head.", "verifier_")
_ARCH_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings")


@dataclass(frozen=True)
class BlockFamily:
    """How the checkpoint layouts hold one family of drafters on the block backbone."""

    model_class: type[BlockDraftModel]
    # (config.json, layout, the backbone's fields read from it) → the family's config
    read: Callable[[dict[str, Any], str, dict[str, Any]], BlockDraftConfig]
    # (config, the backbone's architecture fields) → the config.json the family writes
    write: Callable[[Any, dict[str, Any]], dict[str, Any]]
    # config → the family's own fields of a speculators config.json (its architectures, its heads)
    speculators: Callable[[Any], dict[str, Any]] = lambda cfg: {"architectures": ["DFlashDraftModel"]}
    # fields of _NEUTRAL the family implements (its read takes them), so they are not refused
    implements: frozenset[str] = frozenset()
    # weights whose rows span the drafted vocabulary: speculators keeps only a draft vocabulary's rows
    draft_vocab_rows: tuple[str, ...] = ()


def _zlab_config(cfg: BlockDraftConfig, arch: dict[str, Any]) -> dict[str, Any]:
    return {"architectures": ["DFlashDraftModel"], **arch,
            "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": cfg.target_layer_ids}}


_FAMILIES: dict[str, BlockFamily] = {
    "dflash": BlockFamily(BlockDraftModel, lambda c, layout, backbone: BlockDraftConfig(**backbone), _zlab_config),
}


def register_block_family(name: str, family: BlockFamily) -> None:
    """Let :func:`load_block_draft` and :func:`save_block_draft` handle ``name``'s checkpoints."""
    _FAMILIES[name] = family


# z-lab fields of newer DFlash drafts this backbone does not implement, with their neutral values
_NEUTRAL = {"input_embedding_scale": (None, 1, 1.0), "output_multiplier": (None, 1, 1.0),
            "final_logit_softcapping": (None,), "is_causal": (None, False), "causal": (None, False),
            "use_swa": (None, False), "attention_sink_bias": (None, False)}


def _check_unsupported(c: dict[str, Any], where: str, implemented: frozenset[str] = frozenset()) -> None:
    """Refuse fields whose non-neutral value would change what the draft computes (unless the
    family ``implemented`` them)."""
    for key, neutral in _NEUTRAL.items():
        if key not in implemented and c.get(key) not in neutral:
            raise ValueError(f"{where}{key} = {c[key]!r} is not supported (only {neutral[-1]!r}): this draft"
                             " network does not implement it")
    if any(t != "full_attention" for t in c.get("layer_types") or []):
        raise ValueError(f"{where}layer_types = {c['layer_types']!r} is not supported: sliding-window draft layers"
                         " are not implemented (every layer must be full_attention)")


def _rope(c: dict[str, Any]) -> dict[str, Any]:
    if c.get("rope_parameters"):
        return dict(c["rope_parameters"])
    rope = dict(c.get("rope_scaling") or {"rope_type": "default"})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope["rope_theta"] = float(c.get("rope_theta", 10000.0))
    return rope


def _arch(c: dict[str, Any]) -> dict[str, Any]:
    out = {k: c[k] for k in _ARCH_FIELDS if c.get(k) is not None}
    out.setdefault("num_key_value_heads", c["num_attention_heads"])
    out.setdefault("head_dim", c["hidden_size"] // c["num_attention_heads"])
    out["rope_parameters"] = _rope(c)
    return out


def detect_layout(c: dict[str, Any]) -> str:
    if c.get("speculators_model_type") in ("dflash", "dspark"):
        return "speculators"
    archs = " ".join(c.get("architectures") or [])
    if "DSpark" in archs or "markov_rank" in c:
        return "deepspec"
    if "DFlash" in archs or "dflash_config" in c or "target_layer_ids" in c:
        return "zlab"
    raise ValueError(f"not a DFlash/DSpark checkpoint config (architectures {c.get('architectures')})")


def checkpoint_family(c: dict[str, Any]) -> tuple[str, str]:
    """The family a ``config.json`` holds (``"dflash"``, ``"dflash2"`` or ``"dspark"``) and the field
    that shows it. A z-lab file is DFlash 2 when its architectures say so (``DFlash2DraftModel``,
    as vLLM dispatches) or, naming none, when ``dflash_config`` carries a ``selector_rank``."""
    layout = detect_layout(c)
    if layout == "speculators":
        if c["speculators_model_type"] == "dspark":
            return "dspark", 'speculators_model_type: "dspark"'
        anchored = bool(c.get("sample_from_anchor", False))
        return ("dspark" if anchored else "dflash"), f"sample_from_anchor: {str(anchored).lower()}"
    if layout == "deepspec":
        return "dspark", (f"architectures: {c['architectures']}" if c.get("architectures") else "markov_rank")
    archs = c.get("architectures") or []
    if any("DFlash2" in a for a in archs):
        return "dflash2", f"architectures: {archs}"
    if not archs and "selector_rank" in (c.get("dflash_config") or {}):
        return "dflash2", "dflash_config.selector_rank"
    return "dflash", (f"architectures: {archs}" if archs else "dflash_config")


def _backbone(c: dict[str, Any], layout: str, implemented: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The backbone's fields in a ``config.json`` (``implemented``: the family's own of :data:`_NEUTRAL`)."""
    if layout == "speculators":
        t = c["transformer_layer_config"]
        _check_unsupported(t, "transformer_layer_config.")
        draft_vocab = c.get("draft_vocab_size")
        if draft_vocab is not None and not 0 < int(draft_vocab) <= int(t["vocab_size"]):
            raise ValueError(f"speculators draft_vocab_size {draft_vocab} outside [1, {t['vocab_size']}]")
        if c.get("projector_type", "dflash") != "dflash":
            raise ValueError(f"speculators projector_type {c['projector_type']!r} is not supported")
        # speculators' ids index hidden_states (0 = embeddings): one more than the layer whose output they name
        return dict(**_arch(t), num_target_layers=c.get("num_target_layers"),
                    target_layer_ids=[int(i) - 1 for i in c["aux_hidden_state_layer_ids"]],
                    mask_token_id=int(c["mask_token_id"]), block_size=int(c["block_size"]))
    if layout == "deepspec":
        return dict(**_arch(c), num_target_layers=c.get("num_target_layers"),
                    target_layer_ids=list(c["target_layer_ids"]), mask_token_id=int(c["mask_token_id"]),
                    block_size=int(c["block_size"]))
    dc = c.get("dflash_config") or {}
    _check_unsupported(c, "", implemented)
    _check_unsupported(dc, "dflash_config.", implemented)
    blocks = {int(b) for b in (c.get("block_size"), dc.get("block_size")) if b is not None}
    if len(blocks) > 1:
        raise ValueError(f"block_size {c['block_size']} and dflash_config.block_size {dc['block_size']} disagree")
    return dict(**_arch(c), num_target_layers=c.get("num_target_layers"),
                target_layer_ids=list(dc.get("target_layer_ids", c.get("target_layer_ids"))),
                mask_token_id=int(dc.get("mask_token_id", c.get("mask_token_id"))),
                block_size=blocks.pop() if blocks else 16)


def _read(c: dict[str, Any]) -> tuple[BlockFamily, BlockDraftConfig]:
    layout, name = detect_layout(c), checkpoint_family(c)[0]
    if name not in _FAMILIES:
        raise ValueError(f"a {name} checkpoint, but no {name} drafter registered its layouts")
    family = _FAMILIES[name]
    return family, family.read(c, layout, _backbone(c, layout, family.implements))


def config_from_dict(c: dict[str, Any]) -> BlockDraftConfig:
    """The config (:class:`BlockDraftConfig`, or the family's own) from any of the three
    ``config.json`` layouts."""
    return _read(c)[1]


def load_block_draft(folder: str | Path, dtype: torch.dtype = torch.float32) -> BlockDraftModel:
    """The draft network of a checkpoint folder in any supported layout, of the family the
    layout holds (a DSpark file gives a DSpark model)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    family, cfg = _read(config)
    model = family.model_class(cfg)
    state: dict[str, torch.Tensor] = {}
    for f in safetensors_files(folder):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                name = key.removeprefix("model.")
                if not name.startswith(_SKIP):
                    state[name] = sf.get_tensor(key)
    _draft_vocab(model, family, state, folder, config.get("draft_vocab_size") if "speculators_model_type" in config
                 else None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {folder} does not match its config: missing {missing}, unexpected {unexpected}")
    return model.to(dtype).eval()


def _draft_vocab(model: BlockDraftModel, family: BlockFamily, state: dict[str, torch.Tensor], folder: Path,
                 draft_vocab_size: int | None) -> None:
    """A file's draft vocabulary (``t2d``, and speculators' ``d2t`` and reduced rows) as the model's
    mask over the full vocabulary: rows a reduced file leaves out are zero, and never drafted."""
    t2d, d2t = state.get("t2d"), state.pop("d2t", None)
    if t2d is None:
        if draft_vocab_size is not None and int(draft_vocab_size) != model.cfg.vocab_size:
            raise ValueError(f"{folder}: draft_vocab_size {draft_vocab_size} without a t2d map")
        return
    t2d = state["t2d"] = t2d.bool()
    ids = t2d.nonzero().squeeze(1)
    if draft_vocab_size is not None and ids.numel() != int(draft_vocab_size):
        raise ValueError(f"{folder}: t2d marks {ids.numel()} ids, draft_vocab_size is {draft_vocab_size}")
    if d2t is not None and not torch.equal(torch.arange(d2t.numel()) + d2t.long(), ids):
        raise ValueError(f"{folder}: d2t does not map the draft ids onto the target ids t2d marks")
    V = model.cfg.vocab_size
    for name in family.draft_vocab_rows:
        w = state.get(name)
        if w is not None and w.shape[0] == ids.numel() != V:
            state[name] = w.new_zeros(V, *w.shape[1:]).index_copy_(0, ids, w)
    model.set_draft_vocab(t2d)


def _speculators_layer_ids(cfg: BlockDraftConfig, fc: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """``aux_hidden_state_layer_ids`` (hidden_states indices: z-lab id + 1) and ``fc.weight``, by
    speculators' converter's rule: index L (the verifier's last layer, which speculators' data
    carries as ``verifier_last_hidden_states``, never as a feature) is dropped, with its columns of
    ``fc`` (speculators slices ``fc.weight`` to the ids it keeps)."""
    aux = [i + 1 for i in cfg.target_layer_ids]
    L = cfg.num_target_layers
    if L is None or L not in aux:
        return aux, fc
    j, D = aux.index(L), cfg.hidden_size
    warnings.warn(f"layer id {L - 1} (hidden_states index {L}, the verifier's last layer) is dropped from the"
                  " speculators export, as speculators' converter drops it: the exported draft reads one feature"
                  " fewer than this one", UserWarning, stacklevel=3)
    return aux[:j] + aux[j + 1:], torch.cat([fc[:, :j * D], fc[:, (j + 1) * D:]], 1)


def _speculators_config(name: str, family: BlockFamily, cfg: BlockDraftConfig, arch: dict[str, Any],
                        verifier: str | None, verifier_architectures: list[str] | None, dtype: torch.dtype,
                        aux: list[int], draft_vocab: int) -> dict[str, Any]:
    """speculators' layout (``DFlashSpeculatorConfig`` / ``DSparkSpeculatorConfig`` field names)."""
    layer = {k: v for k, v in arch.items() if k not in ("num_target_layers", "block_size")}
    return {"speculators_model_type": name, **family.speculators(cfg), "transformer_layer_config": layer,
            "draft_vocab_size": draft_vocab, "dtype": dtype_name(dtype), "speculators_version": SPECULATORS_VERSION,
            "block_size": cfg.block_size, "num_target_layers": cfg.num_target_layers,
            "aux_hidden_state_layer_ids": aux,  # hidden_states indices
            "mask_token_id": cfg.mask_token_id, "sample_from_anchor": cfg.anchor_predicts,
            "speculators_config": {"algorithm": name, "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy",
                                                         "speculative_tokens": cfg.num_drafts}],
                                   "verifier": verifier_block(verifier, verifier_architectures)}}


def save_block_draft(model: BlockDraftModel, folder: str | Path, dtype: torch.dtype = torch.bfloat16,
                     extra: dict[str, Any] | None = None, layout: str = "native",
                     verifier: str | None = None, verifier_architectures: list[str] | None = None,
                     lm_head: torch.Tensor | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors``: ``layout="native"`` is the family's own
    (z-lab for DFlash, DeepSpec for DSpark), ``"speculators"`` speculators' (``verifier``, the
    target's hub id or path, is recorded there with its architectures: ``verifier_architectures``,
    else its folder's ``config.json``). No embedding or LM head is stored, except in a speculators
    file of a draft vocabulary: speculators reads that as a reduced LM head, so the target's head
    rows go in (``lm_head``, the target's ``lm_head.weight`` [V, D]) beside ``t2d`` and ``d2t``."""
    if layout not in ("native", "speculators"):
        raise ValueError(f"layout must be 'native' or 'speculators', got {layout!r}")
    folder = Path(folder)
    cfg = model.cfg
    rope = dict(cfg.rope_parameters)
    arch = {k: getattr(cfg, k) for k in _ARCH_FIELDS} | {"rope_parameters": rope, "rope_theta": rope["rope_theta"],
                                                         "num_target_layers": cfg.num_target_layers,
                                                         "block_size": cfg.block_size, "model_type": "qwen3",
                                                         "tie_word_embeddings": False}
    name, family = next(((n, f) for n, f in _FAMILIES.items() if type(model) is f.model_class), (None, None))
    if family is None:
        raise ValueError(f"no block-draft family registered for {type(model).__name__}")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if layout == "native":
        config = family.write(cfg, arch)
    else:
        aux, state["fc.weight"] = _speculators_layer_ids(cfg, state["fc.weight"])
        draft_vocab = cfg.vocab_size
        if model.t2d is not None:  # speculators' reduced vocabulary: t2d, d2t, and the head's and bias' rows
            if lm_head is None or tuple(lm_head.shape) != (cfg.vocab_size, cfg.hidden_size):
                raise ValueError("a speculators export of a draft vocabulary carries its LM head rows: pass lm_head,"
                                 f" the target's lm_head.weight [{cfg.vocab_size}, {cfg.hidden_size}]")
            ids = model.t2d.nonzero().squeeze(1).cpu()
            draft_vocab = ids.numel()
            state["d2t"] = ids - torch.arange(draft_vocab)
            state["lm_head.weight"] = lm_head.detach().cpu()[ids]
            for row_name in family.draft_vocab_rows:
                if row_name in state:
                    state[row_name] = state[row_name].cpu()[ids]
        config = _speculators_config(name, family, cfg, arch, verifier, verifier_architectures, dtype, aux,
                                     draft_vocab)
    config.update(extra or {})
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
