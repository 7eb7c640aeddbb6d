"""Train a tiny DeepSeek-V3 (MLA + MoE) from scratch jointly with D MTP modules, on CPU, offline.

Data: CPython's standard library source (top-level ``*.py``; one file in 20 held out), a
byte-level BPE tokenizer trained on the training files. Loss: DeepSeek-V3's
``CE_main + λ/D · Σ_d CE_d`` (arXiv 2412.19437 §2.2), AdamW, warmup + cosine. Deterministic from
``--seed`` (one torch thread). Saved in the real DeepSeek-V3 layout: ``config.json`` with
``num_nextn_predict_layers``, bf16 ``model.safetensors`` with the main model in transformers'
checkpoint format plus the MTP modules at ``model.layers.{L}`` … ``{L+D-1}``, tokenizer files and
``training_info.json`` (arguments, git SHA, final metrics).

    .venv/bin/python experiments/train_mtp.py --out experiments/checkpoints/tiny-deepseek-v3-mtp

``--post-hoc smollm2-135m`` instead trains MTP modules for a frozen target that has none (only
the MTP loss; ``eh_proj`` starts as ``[0 | I]``, so the module first echoes the target), saving just
``model.layers.{L+d}.*`` plus the target's config with ``num_nextn_predict_layers``:

    .venv/bin/python experiments/train_mtp.py --post-hoc smollm2-135m --depth 1 --steps 200 --batch 4 \
        --seq-len 64 --lr 1e-3 --out experiments/checkpoints/smollm2-135m-mtp
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

torch.set_num_threads(1)  # the 2 cores are shared; 2 threads under contention are ~10x slower

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

from specdec.provenance import git_sha  # noqa: E402
from specdec.drafters.mtp.drafter import build_mtp_modules  # noqa: E402
from specdec.drafters.mtp.checkpoint import save_mtp_checkpoint  # noqa: E402
from specdec.training.text import encode_files, mtp_loss, random_windows, stdlib_files, train_tokenizer  # noqa: E402

# Sized so that bf16 weights (main + 2 MTP modules) stay well under 30 MB: ~8.5M parameters.
TINY_DEEPSEEK_V3 = dict(
    hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
    n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.0,
    q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    max_position_embeddings=2048, tie_word_embeddings=False, rope_interleave=True,
)


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def build(args, vocab_size: int, eos: int):
    if args.post_hoc:
        from specdec.api import load_target

        target = load_target(args.post_hoc)
        for p in target.model.parameters():
            p.requires_grad_(False)
        return target.model, target.tokenizer
    config = DeepseekV3Config(vocab_size=vocab_size, num_nextn_predict_layers=args.depth, bos_token_id=eos,
                              eos_token_id=eos, pad_token_id=eos, **TINY_DEEPSEEK_V3)
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    return DeepseekV3ForCausalLM(config), None


def evaluate(model, modules, stream, args, gen) -> dict:
    model.eval(), modules.eval()
    tot = None
    with torch.no_grad():
        for _ in range(args.eval_batches):
            r = step_loss(model, modules, random_windows(stream, args.batch, args.seq_len + 1, gen), args)
            vals = [r.main_ce, r.main_acc, *r.mtp_ce, *r.mtp_acc]
            tot = vals if tot is None else [a + b for a, b in zip(tot, vals)]
    model.train(), modules.train()
    v = [x / args.eval_batches for x in tot]
    D = len(modules)
    return {"main_ce": v[0], "main_acc": v[1], "mtp_ce": v[2: 2 + D], "mtp_acc": v[2 + D:]}


def step_loss(model, modules, window, args):
    decoder = model.get_decoder()
    inputs = window[:, :-1]
    if args.post_hoc:
        with torch.no_grad():
            hidden = decoder(input_ids=inputs).last_hidden_state
        logits = None
    else:
        hidden = decoder(input_ids=inputs).last_hidden_state  # post final norm
        logits = model.lm_head(hidden)
    return mtp_loss(window, hidden, modules, model.get_input_embeddings(), model.get_output_embeddings(),
                    decoder.rotary_emb, lam=args.lam, main_logits=logits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="experiments/checkpoints/tiny-deepseek-v3-mtp")
    ap.add_argument("--post-hoc", default="", help="a frozen target (alias or folder) to train MTP modules for")
    ap.add_argument("--depth", type=int, default=2, help="number of MTP modules D")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--lam", type=float, default=0.3, help="MTP loss weight λ (DeepSeek-V3: 0.3, then 0.1)")
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--max-files", type=int, default=0, help="use only the first N training files (0 = all)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    t0 = time.time()
    files, held = stdlib_files("train"), stdlib_files("heldout")
    if args.max_files:
        files = files[: args.max_files]
    if args.post_hoc:
        model, tok = build(args, 0, 0)
    else:
        tok = train_tokenizer(files, args.vocab_size)
        model, _ = build(args, len(tok), tok.eos_token_id)
    train_stream, held_stream = encode_files(tok, files), encode_files(tok, held)
    print(f"{len(files)} train files ({train_stream.numel()} tokens), {len(held)} held out "
          f"({held_stream.numel()} tokens); data ready in {time.time() - t0:.0f}s")
    torch.manual_seed(args.seed + 1)
    modules = build_mtp_modules(model, args.depth).float()
    if args.post_hoc:  # warm start: x = hnorm(h), so the module first predicts what the target does
        H = model.config.get_text_config().hidden_size
        with torch.no_grad():
            for m in modules:
                m.eh_proj.weight.zero_()
                m.eh_proj.weight[:, H:] = torch.eye(H)
    model.train(), modules.train()
    params = [p for p in [*model.parameters(), *modules.parameters()] if p.requires_grad]
    n_main = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in modules.parameters())
    print(f"parameters: main {n_main / 1e6:.2f}M, {args.depth} MTP modules {n_mtp / 1e6:.2f}M")
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    bar = tqdm(range(args.steps), desc="train", mininterval=5)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        r = step_loss(model, modules, random_windows(train_stream, args.batch, args.seq_len + 1, gen), args)
        opt.zero_grad(set_to_none=True)
        r.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        bar.set_postfix(loss=f"{float(r.loss):.3f}", main=f"{r.main_ce:.2f}",
                        mtp="/".join(f"{c:.2f}" for c in r.mtp_ce), acc="/".join(f"{a:.2f}" for a in r.mtp_acc))
    train_s = time.time() - t0
    metrics = evaluate(model, modules, held_stream, args, torch.Generator().manual_seed(args.seed + 2))
    print("held-out:", json.dumps(metrics))
    save(model, modules, tok, args, metrics, train_s)


def save(model, modules, tok, args, metrics: dict, train_s: float) -> None:
    from safetensors import safe_open

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    L = model.config.get_text_config().num_hidden_layers
    main: dict = {}
    if not args.post_hoc:
        model.config.num_nextn_predict_layers = args.depth
        model.to(torch.bfloat16).save_pretrained(out)  # transformers writes the checkpoint layout
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            main = {k: f.get_tensor(k) for k in f.keys()}
        tok.save_pretrained(out)
    else:  # only the MTP layers, and a config that names the layout
        cfg = model.config.to_dict()
        cfg.update(num_nextn_predict_layers=args.depth)
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_mtp_checkpoint(modules, out / "model.safetensors", L, main)
    info = {"args": vars(args), "git_sha": git_sha(), "train_seconds": round(train_s), "heldout": metrics,
            "torch": torch.__version__}
    (out / "training_info.json").write_text(json.dumps(info, indent=2))
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    print(f"saved {out} ({size:.1f} MiB)")


if __name__ == "__main__":
    main()
