"""MTP / NextN modules in the DeepSeek-V3 checkpoint layout: read only their tensors, write them.

Layout (``deepseek-ai/DeepSeek-V3:README_WEIGHTS.md``): with ``num_hidden_layers = L`` and
``num_nextn_predict_layers = D`` (transformers' alias ``num_mtp_layers``), module ``d`` is stored
as ``model.layers.{L+d}.`` + ``enorm.weight``, ``hnorm.weight``, ``eh_proj.weight``,
``shared_head.norm.weight``, the decoder block's own keys (``self_attn.*``, ``mlp.*``,
``input_layernorm``, ``post_attention_layernorm``) and, in the released files, copies of the
shared ``embed_tokens.weight`` and ``shared_head.head.weight``, which are skipped (the target's
are used; our own checkpoints omit them). Routed experts are per expert
(``mlp.experts.{e}.{gate,up,down}_proj.weight``); transformers' modules hold them fused
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), converted here both ways. FP8 weights with
128×128 block scales (``weight_scale_inv``) are dequantised on read.

Only keys under the MTP prefixes are read: through ``model.safetensors.index.json``'s
``weight_map`` when sharded (so only the shards holding them are opened), else by listing the
keys of each ``*.safetensors`` file. Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from specdec.drafters.mtp.modules import build_mtp_modules
from specdec.target import Target

__all__ = ["read_mtp_layout", "mtp_keys", "load_mtp_modules", "from_checkpoint_layout", "to_checkpoint_layout",
           "save_mtp_checkpoint"]

_SKIP = ("embed_tokens.weight", "shared_head.head.weight")  # shared with the target
_EXPERT = re.compile(r"^mtp_block\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def read_mtp_layout(folder: str | Path) -> tuple[int, int]:
    """(num_hidden_layers, number of MTP modules) from ``config.json``."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    depth = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers"))
    if not depth:
        raise ValueError(f"{folder}/config.json declares no MTP modules (num_nextn_predict_layers / num_mtp_layers)")
    return int(cfg["num_hidden_layers"]), int(depth)


def mtp_keys(folder: str | Path, num_hidden_layers: int, depth: int) -> dict[str, Path]:
    """Every checkpoint key of the MTP modules → the file that holds it (no tensor is read).

    The copies of the shared embedding and LM head stored with each module are left out."""
    folder = Path(folder)
    prefixes = tuple(f"model.layers.{num_hidden_layers + d}." for d in range(depth))
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: folder / f for k, f in weight_map.items() if _wanted(k, prefixes)}
    found: dict[str, Path] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            found.update({k: file for k in f.keys() if _wanted(k, prefixes)})
    return found


def _wanted(key: str, prefixes: tuple[str, ...]) -> bool:
    """Under an MTP prefix and not a copy of the shared embedding / LM head (never read)."""
    return key.startswith(prefixes) and not key.endswith(_SKIP)


def _read(keys: dict[str, Path]) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for k, f in keys.items():
        by_file.setdefault(f, []).append(k)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for k in names:
                out[k] = f.get_tensor(k)
    return out


def _dequant_fp8(w: Tensor, scale_inv: Tensor, block: int = 128) -> Tensor:
    """DeepSeek-V3 FP8 weight [N, M] with per-128×128-block scales [ceil(N/128), ceil(M/128)]."""
    s = scale_inv.float().repeat_interleave(block, 0).repeat_interleave(block, 1)
    return w.float() * s[: w.shape[0], : w.shape[1]]


def from_checkpoint_layout(raw: dict[str, Tensor]) -> dict[str, Tensor]:
    """Checkpoint keys of one module (prefix stripped) → :class:`MTPModule` state-dict keys."""
    scales = {k[: -len("_scale_inv")]: v for k, v in raw.items() if k.endswith("weight_scale_inv")}
    sd: dict[str, Tensor] = {}
    experts: dict[int, dict[str, Tensor]] = {}
    for k, v in raw.items():
        if k.endswith("weight_scale_inv") or k in _SKIP:
            continue
        if k in scales:
            v = _dequant_fp8(v, scales[k])
        if not k.startswith(("enorm.", "hnorm.", "eh_proj.", "shared_head.")):
            k = "mtp_block." + k
        m = _EXPERT.match(k)
        if m:
            experts.setdefault(int(m.group(1)), {})[m.group(2)] = v
        else:
            sd[k] = v
    if experts:
        order = sorted(experts)
        if order != list(range(len(order))):
            raise ValueError(f"expert ids are not 0..E-1: {order}")
        sd["mtp_block.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate"], experts[e]["up"]]) for e in order])
        sd["mtp_block.mlp.experts.down_proj"] = torch.stack([experts[e]["down"] for e in order])
    return sd


def to_checkpoint_layout(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """:class:`MTPModule` state dict → checkpoint keys of one module (prefix not added)."""
    out: dict[str, Tensor] = {}
    for k, v in sd.items():
        name = k.removeprefix("mtp_block.")
        if name == "mlp.experts.gate_up_proj":
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"mlp.experts.{e}.gate_proj.weight"] = v[e, :inter]
                out[f"mlp.experts.{e}.up_proj.weight"] = v[e, inter:]
        elif name == "mlp.experts.down_proj":
            for e in range(v.shape[0]):
                out[f"mlp.experts.{e}.down_proj.weight"] = v[e]
        else:
            out[name] = v
    return out


def load_mtp_modules(target: Target, folder: str | Path) -> nn.ModuleList:
    """The MTP modules stored in ``folder`` for ``target``, reading only their tensors."""
    L, depth = read_mtp_layout(folder)
    if L != target.num_layers:
        raise ValueError(f"{folder}: MTP modules follow {L} layers, the target has {target.num_layers}")
    keys = mtp_keys(folder, L, depth)
    modules = build_mtp_modules(target, depth)
    raw = _read(keys)
    for d, module in enumerate(modules):
        prefix = f"model.layers.{L + d}."
        sd = from_checkpoint_layout({k[len(prefix):]: v for k, v in raw.items() if k.startswith(prefix)})
        if not sd:
            raise ValueError(f"{folder}: no tensors under {prefix}")
        dtype = module.eh_proj.weight.dtype
        missing, unexpected = module.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=False)
        missing = [m for m in missing if not m.endswith("e_score_correction_bias")]  # buffer, may be absent
        if missing or unexpected:
            raise ValueError(f"{folder}: MTP module {d} missing {missing}, unexpected {unexpected}")
    return modules


def save_mtp_checkpoint(modules: nn.ModuleList, file: str | Path, num_hidden_layers: int,
                        main: dict[str, Tensor] | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write ``main`` (already in checkpoint layout) plus the modules at ``model.layers.{L+d}.``."""
    tensors = dict(main or {})
    for d, module in enumerate(modules):
        for k, v in to_checkpoint_layout(module.state_dict()).items():
            tensors[f"model.layers.{num_hidden_layers + d}.{k}"] = v.detach().to(dtype).contiguous()
    save_file(tensors, str(file), metadata={"format": "pt"})
