"""EAGLE-3 checkpoints: the speculators format (read and write), SafeAILab's layout (read), and the
serving flags for vLLM and SGLang.

**speculators** (``vllm-project/speculators``; what vLLM serves with ``"method": "eagle3"``):
``config.json`` with ``speculators_model_type: "eagle3"``, ``transformer_layer_config`` (a Llama
config of the draft layer), ``draft_vocab_size``, ``norm_before_residual``, ``norm_before_fc``,
the EAGLE-3.1 flags ``fc_norm`` and ``norm_output`` (absent: false, plain EAGLE-3),
``target_hidden_size`` (null when equal to the draft's), ``eagle_aux_hidden_state_layer_ids``
(inputs of those target layers, this library's convention) and ``speculators_config`` (proposal
methods, verifier); weights ``fc.weight``, ``layers.0.*`` (with ``hidden_norm``), ``norm.weight``,
``lm_head.weight``, ``d2t``, ``t2d``, ``input_norm.weight`` with ``norm_before_fc``,
``fc_norm.<i>.weight`` (one per feature layer) with ``fc_norm``, and ``embed_tokens.weight`` only
when the draft has its own embedding (otherwise the target's is shared, which keeps a SmolLM2 draft
under 25 MB). Field and weight names as speculators writes them (checked against
vllm-project/speculators@c05b95b, ``src/speculators/models/eagle3/{config,core}.py``, and the 0.9.0
release); ``architectures``, ``dtype``, ``speculators_version`` and the verifier block as every
speculators save writes them (:mod:`specdec.drafters.speculators_format`).

**SafeAILab** (``SafeAILab/EAGLE``, EAGLE-3 releases): a Llama-like ``config.json`` with
``draft_vocab_size``, weights ``midlayer.*`` (the decoder layer), ``fc``, ``norm``, ``lm_head``,
``d2t``, ``t2d``; the feature layers are not recorded (always ``(2, L//2, L-3)`` of the target) and
the residual is taken before ``hidden_norm`` (``norm_before_residual=False``).

Only safetensors are read: pickled ``.bin`` files are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import LlamaConfig

from specdec.drafters.eagle3.model import Eagle3Model, Eagle3Spec, default_layer_ids
from specdec.drafters.eagle3.tree import DEFAULT_STATIC_TREE, StaticTree, parse_tree
from specdec.drafters.speculators_format import SPECULATORS_VERSION, dtype_name, verifier_block
from specdec.models import safetensors_files

__all__ = ["load_eagle3", "save_eagle3", "serving_config", "read_weights"]

_LAYER_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings", "rope_parameters", "hidden_act",
               "num_hidden_layers", "attention_bias", "mlp_bias", "tie_word_embeddings")


def read_weights(folder: Path) -> dict[str, Tensor]:
    """Every tensor of the folder's safetensors files (one file or an indexed set of shards)."""
    weights: dict[str, Tensor] = {}
    for f in safetensors_files(folder):
        weights.update(load_file(str(f)))
    return weights


def load_eagle3(folder: str | Path, num_target_layers: int | None = None) -> Eagle3Model:
    """An :class:`Eagle3Model` from a speculators or SafeAILab folder.

    ``num_target_layers`` gives SafeAILab checkpoints their feature layers ``(2, L//2, L-3)``.
    """
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    w = read_weights(folder)
    if cfg.get("speculators_model_type") == "eagle3":
        layer = dict(cfg["transformer_layer_config"])
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        if not ids:
            if num_target_layers is None:
                raise ValueError("the checkpoint names no eagle_aux_hidden_state_layer_ids: give num_target_layers")
            ids = default_layer_ids(num_target_layers)
        nbr, nbf = bool(cfg.get("norm_before_residual", False)), bool(cfg.get("norm_before_fc", False))
        fcn, nout = bool(cfg.get("fc_norm", False)), bool(cfg.get("norm_output", False))
    else:
        if "draft_vocab_size" not in cfg:
            raise ValueError(f"{folder}/config.json is neither speculators eagle3 nor a SafeAILab EAGLE-3 config")
        layer = {k: v for k, v in cfg.items() if k in _LAYER_KEYS}
        layer["num_hidden_layers"] = 1
        if num_target_layers is None:
            raise ValueError("SafeAILab checkpoints do not record their feature layers: give num_target_layers")
        ids = default_layer_ids(num_target_layers)
        w = {("layers.0." + k[len("midlayer."):]) if k.startswith("midlayer.") else k: v for k, v in w.items()}
        nbr, nbf = False, "input_norm.weight" in w
        fcn, nout = False, False
    if "rope_parameters" not in layer and "rope_theta" in layer | cfg:
        layer["rope_parameters"] = {"rope_type": "default", "rope_theta": (layer | cfg)["rope_theta"]}
    layer_cfg = LlamaConfig(**{k: v for k, v in layer.items() if k != "model_type"})
    if "lm_head.weight" not in w or "fc.weight" not in w:
        raise ValueError(f"{folder}: missing fc.weight or lm_head.weight")
    D = cfg.get("target_hidden_size") or w["fc.weight"].shape[1] // len(ids)
    if w["fc.weight"].shape[1] != D * len(ids):
        raise ValueError(f"fc.weight takes {w['fc.weight'].shape[1]} features, expected {len(ids)} x {D}")
    Vd = int(cfg.get("draft_vocab_size") or w["lm_head.weight"].shape[0])
    spec = Eagle3Spec(tuple(int(i) for i in ids), int(D), Vd, norm_before_residual=nbr, norm_before_fc=nbf,
                      own_embedding="embed_tokens.weight" in w, fc_bias="fc.bias" in w, fc_norm=fcn, norm_output=nout)
    model = Eagle3Model(layer_cfg, spec)
    if "d2t" not in w:  # a full-vocabulary draft
        w["d2t"] = torch.zeros(Vd, dtype=torch.long)
        w["t2d"] = torch.ones(layer_cfg.vocab_size, dtype=torch.bool)
    if w["d2t"].numel() != Vd:
        raise ValueError(f"d2t has {w['d2t'].numel()} entries, draft_vocab_size is {Vd}")
    w["d2t"], w["t2d"] = w["d2t"].long(), w["t2d"].bool()
    dtype = w["fc.weight"].dtype
    missing, unexpected = model.load_state_dict(w, strict=False)
    if missing or unexpected:
        raise ValueError(f"{folder}: missing weights {missing}, unexpected {unexpected}")
    model.check_vocab_map()
    return model.to(dtype).eval()


def save_eagle3(model: Eagle3Model, folder: str | Path, verifier: str = "", num_speculative_tokens: int = 3,
                dtype: torch.dtype = torch.bfloat16, extra: dict | None = None,
                verifier_architectures: list[str] | None = None) -> Path:
    """Write ``model`` in the speculators format (config.json + model.safetensors), the fields as
    speculators' own ``save_pretrained`` writes them (:mod:`specdec.drafters.speculators_format`):
    ``d2t`` and ``t2d`` always, ``dtype``, ``speculators_version`` and the verifier's architectures
    (``verifier_architectures``, else read from ``verifier``'s ``config.json`` when it is a folder)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    spec, lc = model.spec, model.config
    layer = {k: v for k, v in lc.to_dict().items() if k in _LAYER_KEYS}
    layer.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False)
    config = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": spec.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(spec.layer_ids),
        "norm_before_residual": spec.norm_before_residual,
        "norm_before_fc": spec.norm_before_fc,
        "fc_norm": spec.fc_norm,
        "norm_output": spec.norm_output,
        "target_hidden_size": None if spec.target_hidden_size == lc.hidden_size else spec.target_hidden_size,
        "tie_word_embeddings": False,
        "dtype": dtype_name(dtype),
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": verifier_block(verifier, verifier_architectures),
        },
        **(extra or {}),
    }
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def serving_config(folder: str | Path, k: int = 3, tree: str = "chain", static_tree: str | list | None = None,
                   tree_top_k: int = 4, tree_budget: int = 16) -> dict[str, str]:
    """vLLM ``--speculative-config`` JSON and SGLang flags that run this checkpoint as specdec's
    ``eagle3`` drafter with the same shape (``k`` = chain length or tree depth)."""
    folder = str(folder)
    sg = f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {folder}"
    if tree == "chain":
        vllm = {"method": "eagle3", "model": folder, "num_speculative_tokens": k}
        sg += f" --speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"
        note = ""
    elif tree == "static":
        t: StaticTree = parse_tree(static_tree if static_tree is not None else DEFAULT_STATIC_TREE).cut(k)
        vllm = {"method": "eagle3", "model": folder, "num_speculative_tokens": len(t.paths),
                "speculative_token_tree": t.to_vllm()}
        width = max(t.ranks) + 1
        sg += (f" --speculative-num-steps {t.depth} --speculative-eagle-topk {width}"
               f" --speculative-num-draft-tokens {len(t.paths) + 1}")
        note = "SGLang has no static trees: these flags build its dynamic tree of the same depth, width and size."
    elif tree == "dynamic":
        vllm = {"method": "eagle3", "model": folder, "num_speculative_tokens": k}
        sg += (f" --speculative-num-steps {k} --speculative-eagle-topk {tree_top_k}"
               f" --speculative-num-draft-tokens {tree_budget + 1}")
        note = "vLLM has no dynamic (EAGLE-2) trees: the vLLM line is the chain of the same depth."
    else:
        raise ValueError(f"tree must be chain, static or dynamic, got {tree!r}")
    return {"vllm": f"--speculative-config '{json.dumps(vllm)}'", "sglang": sg, "note": note}
