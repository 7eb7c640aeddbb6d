"""Train a DFlash or DSpark block drafter for a frozen target, offline, on one CPU thread.

Data: the target's own greedy answers to offline prompts (:func:`specdec.training.data.self_distill`,
cached). The target runs once over each sequence for its layer outputs at ``target_layer_ids``
and its post-norm final hidden state (cached under ``cache_dir()/block_features/``, shared by both
methods). Each step takes ``--batch`` sequences and ``--anchors`` random anchors in each
response and runs all blocks in one masked forward (:mod:`specdec.drafters.dflash.train`).

    # the committed checkpoints (about 20 and 27 min on one shared thread)
    .venv/bin/python experiments/train_dflash.py --method dflash --steps 250 --lr 1.5e-3
    .venv/bin/python experiments/train_dflash.py --method dspark --steps 250 --lr 1.5e-3

Softmaxes (draft and target) run over the tokens the training data uses (9,333 of SmolLM2's
49,152): the LM head is most of a step's cost. The checkpoint stores that set as the draft
vocabulary ``t2d`` ([V] bool), masked into the logits at inference, since the other rows were
never trained down.

Deterministic from ``--seed`` (one torch thread, fixed step count). Writes a bf16 checkpoint
without embeddings or LM head (z-lab layout for DFlash, DeepSpec layout for DSpark, whose
``config.json`` also records the calibrated confidence temperatures) and ``train_args.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from torch import nn

import specdec
from specdec.provenance import git_sha
from specdec.drafters.dflash.train import BlockBatch, block_loss, sample_anchors
from specdec.training.data import FeatureSeq, extract_features, self_distill
from specdec.drafters.dflash.checkpoint import save_block_draft
from specdec.drafters.dflash.model import BlockDraftConfig, BlockDraftModel, build_target_layer_ids
from specdec.drafters.dspark.heads import calibrate_temperatures, expected_calibration_error
from specdec.models import cache_dir
from specdec.target import layer_output_ids

MASK_TOKEN = 16  # SmolLM2's <empty_output>: a Jupyter marker the chat model never emits


def feature_scale(items: list[FeatureSeq]) -> torch.Tensor:
    """Per-channel RMS of the target features [m·D]. A few residual channels of SmolLM2 carry
    massive activations (RMS ~1500 against a median ~5) that would swamp ``fc`` early in a short
    run; training reads ``features / scale`` and the scale is folded into ``fc`` before saving
    (``fc(x / s) = (W / s)·x``), so the checkpoint is a plain DFlash ``fc``."""
    sq = sum(f.features.float().pow(2).sum(0) for f in items)
    n = sum(f.features.shape[0] for f in items)
    return (sq / n).sqrt().clamp(min=1e-3)


def make_batch(items: list[FeatureSeq], scale: torch.Tensor) -> BlockBatch:
    T = max(f.tokens.numel() for f in items)
    B, F, D = len(items), items[0].features.shape[-1], items[0].final.shape[-1]
    tokens = torch.zeros(B, T, dtype=torch.long)
    feats, final = torch.zeros(B, T, F), torch.zeros(B, T, D)
    for b, f in enumerate(items):
        n = f.tokens.numel()
        tokens[b, :n], feats[b, :n], final[b, :n] = f.tokens, f.features.float() / scale, f.final.float()
    return BlockBatch(tokens, feats, final, torch.tensor([f.tokens.numel() for f in items]),
                      torch.tensor([f.response_start for f in items]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", choices=("dflash", "dspark"), required=True)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--out", default=None, help="default experiments/checkpoints/smollm2-135m-<method>")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sequences", type=int, default=512, help="self-distilled sequences (the shared cache)")
    ap.add_argument("--use", type=int, default=144, help="how many of them to extract features for")
    ap.add_argument("--held-out", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--features", type=int, default=3, help="target layers read (evenly spaced 1..L-3)")
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--markov-rank", type=int, default=48)
    ap.add_argument("--markov-type", default="vanilla", choices=("vanilla", "gated", "rnn"))
    ap.add_argument("--gamma", type=float, default=4.0, help="loss decay exp(-(k-1)/gamma)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--stop-after", type=int, default=None, help="run only this many steps of the --steps schedule")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    out = Path(args.out or f"experiments/checkpoints/smollm2-135m-{args.method}")
    t_start = time.time()

    target = specdec.load_target(args.target)  # fp32: the distill cache is keyed by these weights
    seqs = self_distill(target, args.sequences, max_new_tokens=256)
    target.model.to(torch.bfloat16)  # features: twice as fast on this CPU
    L, D = target.num_layers, target.hidden_size
    ids = build_target_layer_ids(L, args.features)
    key = f"{args.target}-n{args.sequences}-use{args.use}-len{args.max_len}-ids{'_'.join(map(str, ids))}"
    data = extract_features(target, seqs[: args.use], layer_output_ids(ids),
                            cache_dir() / "block_features" / f"{key}.safetensors", max_len=args.max_len)
    data = [f for f in data if f.tokens.numel() - f.response_start >= 8]
    held, train = data[: args.held_out], data[args.held_out:]
    scale = feature_scale(train)
    # the LM head is most of a step: softmaxes run over the tokens the data uses (all of them)
    vocab = torch.cat([s.tokens for s in seqs]).unique()
    print(f"training vocabulary: {vocab.numel()} of {target.vocab_size} tokens", flush=True)
    print(f"{len(train)} train / {len(held)} held-out sequences; features in {time.time() - t_start:.0f}s", flush=True)

    embed = nn.Embedding.from_pretrained(target.embed_tokens.weight.detach().float(), freeze=True)
    lm_head = nn.Linear(D, target.vocab_size, bias=False)
    lm_head.weight = nn.Parameter(target.lm_head.weight.detach().float(), requires_grad=False)
    tc = target.text_config
    dspark = args.method == "dspark"
    cfg = BlockDraftConfig(
        hidden_size=D, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
        head_dim=getattr(tc, "head_dim", D // tc.num_attention_heads), vocab_size=target.vocab_size,
        num_target_layers=L, target_layer_ids=ids, mask_token_id=MASK_TOKEN, block_size=args.block,
        rms_norm_eps=tc.rms_norm_eps, rope_parameters=dict(tc.rope_parameters),
        max_position_embeddings=tc.max_position_embeddings, anchor_predicts=dspark,
        markov_rank=args.markov_rank if dspark else 0, markov_head_type=args.markov_type,
        enable_confidence_head=dspark)
    model = BlockDraftModel(cfg)
    model.init_weights(0.02)
    with torch.no_grad():  # start the output norm where the target's is: its LM head expects that scale
        model.norm.weight.copy_(target.final_norm.weight.float())
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    print(f"draft parameters: {sum(p.numel() for p in params) / 1e6:.2f}M", flush=True)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    warm = max(1, int(0.04 * args.steps))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (args.steps - warm))))

    steps = args.stop_after or args.steps
    order = torch.randperm(len(train), generator=gen).tolist()
    cursor, t0, log = 0, time.time(), []
    for step in range(steps):
        if cursor + args.batch > len(order):
            order, cursor = torch.randperm(len(train), generator=gen).tolist(), 0
        batch = make_batch([train[i] for i in order[cursor: cursor + args.batch]], scale)
        cursor += args.batch
        anchors, keep = sample_anchors(batch, args.anchors, gen)
        res = block_loss(model, embed, lm_head, batch, anchors, keep, gamma=args.gamma, vocab=vocab)
        opt.zero_grad(set_to_none=True)
        res.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 20 == 0 or step == steps - 1:
            acc = " ".join(f"{a:.2f}" for a in res.accept)
            print(f"step {step} loss {float(res.loss):.3f} ce {res.ce:.3f} l1 {res.l1:.3f} bce {res.bce:.3f}"
                  f" acc [{acc}] {time.time() - t0:.0f}s", flush=True)
            log.append({"step": step, "loss": float(res.loss), "ce": res.ce, "accept": res.accept})

    # held-out evaluation (and DSpark's confidence calibration on it)
    model.eval()
    hgen = torch.Generator().manual_seed(args.seed + 1)
    accs, conf_l, conf_t = [], [], []
    with torch.no_grad():
        for lo in range(0, len(held), args.batch):
            batch = make_batch(held[lo: lo + args.batch], scale)
            anchors, keep = sample_anchors(batch, 64, hgen)
            res = block_loss(model, embed, lm_head, batch, anchors, keep, gamma=args.gamma, vocab=vocab)
            accs.append(res.accept)
            if res.conf_logits is not None:
                conf_l.append(res.conf_logits)
                conf_t.append(res.conf_target)
    held_acc = [sum(a[j] for a in accs) / len(accs) for j in range(len(accs[0]))]
    extra: dict = {}
    if conf_l:
        z, c = torch.cat(conf_l), torch.cat(conf_t)
        temps = calibrate_temperatures(z, c)
        model.cfg.confidence_temperatures = temps
        surv = c.cumprod(-1)
        ece_before = [expected_calibration_error(torch.sigmoid(z).cumprod(-1)[:, j], surv[:, j]) for j in range(z.shape[1])]
        ece_after = [expected_calibration_error(torch.sigmoid(z / torch.tensor(temps)).cumprod(-1)[:, j], surv[:, j])
                     for j in range(z.shape[1])]
        extra = {"calibration_ece_before": ece_before, "calibration_ece_after": ece_after, "calibration_blocks": int(z.shape[0])}
        print(f"calibration temperatures {[round(t, 3) for t in temps]}; survival ECE "
              f"{sum(ece_before) / len(ece_before):.4f} -> {sum(ece_after) / len(ece_after):.4f}", flush=True)
    with torch.no_grad():
        model.fc.weight.div_(scale)  # fold the feature scaling: the checkpoint reads raw features
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    model.set_draft_vocab(t2d)  # trained over these tokens only: draft only these
    save_block_draft(model, out)
    size = (out / "model.safetensors").stat().st_size
    info = {"args": vars(args), "steps_run": steps, "train_seconds": round(time.time() - t0, 1),
            "total_seconds": round(time.time() - t_start, 1), "held_out_accept_per_position": held_acc,
            "checkpoint_bytes": size, "git_sha": git_sha(), "log": log, **extra}
    (out / "train_args.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"held-out per-position acceptance {[round(a, 3) for a in held_acc]}; {size / 1e6:.1f} MB -> {out}", flush=True)


if __name__ == "__main__":
    main()
