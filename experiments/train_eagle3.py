"""Train an EAGLE-3 drafter for a frozen target with training-time test (:mod:`specdec.drafters.eagle3.train`), offline.

Data: :func:`specdec.training.data.recipe_data`, the target's own greedy responses to ShareGPT, MT-bench
and HumanEval prompts (benchmark items held out). Target features (inputs of layers
``(2, L//2, L-3)``) and post-norm final hidden states are computed once in bf16 and cached. The
draft vocabulary is the ``--draft-vocab`` most frequent response tokens (``d2t``/``t2d``). The
embedding is the target's (frozen, not saved). Everything else starts from PyTorch's default
initialisation: starting ``lm_head``/``norm`` from the target's rows learned more slowly in a
25-step comparison (its initial logits are far too large for the random layer below it).

    .venv/bin/python experiments/train_eagle3.py --steps 1000 --stop-after 1000   # the committed checkpoint

Deterministic from ``--seed`` on one torch thread. ``--save-every`` writes a resumable state
(model, AdamW moments, step, generator) under ``--work``; ``--resume`` continues from it. The
result is a bf16 speculators-format folder (config.json, model.safetensors) with ``train_args.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

torch.set_num_threads(1)  # the 2 cores are shared

from tqdm import tqdm  # noqa: E402

import specdec  # noqa: E402
from specdec.provenance import git_sha  # noqa: E402
from specdec.training.data import RECIPE_DATA, extract_features, recipe_data  # noqa: E402
from specdec.drafters.eagle3.checkpoint import save_eagle3  # noqa: E402
from specdec.drafters.eagle3.model import (  # noqa: E402
    Eagle3Model,
    Eagle3Spec,
    default_layer_ids,
    draft_layer_config,
    vocab_map,
)
from specdec.models import cache_dir  # noqa: E402
from specdec.drafters.eagle3.train import (  # noqa: E402
    load_train_state,
    sample_anchors,
    save_train_state,
    token_counts,
    ttt_loss,
)


def lr_at(step: int, total: int, peak: float, warmup: float = 0.03, floor: float = 0.1) -> float:
    """Linear warm-up, then cosine down to ``floor · peak``: a pure function of the step (resumable)."""
    w = max(1, int(warmup * total))
    if step < w:
        return peak * (step + 1) / w
    t = min(1.0, (step - w) / max(1, total - w))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def build_model(target, layer_ids, counts: torch.Tensor, draft_vocab: int) -> Eagle3Model:
    d2t, t2d = vocab_map(counts, draft_vocab)
    spec = Eagle3Spec(tuple(layer_ids), target.hidden_size, draft_vocab, norm_before_residual=True)
    model = Eagle3Model(draft_layer_config(target.text_config), spec)
    with torch.no_grad():
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
    return model


@torch.no_grad()
def evaluate(model, embed, head, in_draft, seqs, steps: int, anchors: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    correct, counted = [0] * steps, [0] * steps
    for s in seqs:
        r = ttt_loss(model, embed, head, in_draft, s, sample_anchors(s, anchors, gen), steps)
        correct = [a + b for a, b in zip(correct, r.correct)]
        counted = [a + b for a, b in zip(counted, r.counted)]
    return [c / max(1, n) for c, n in zip(correct, counted)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--out", default="experiments/checkpoints/smollm2-135m-eagle3")
    ap.add_argument("--work", default=str(cache_dir() / "eagle3-train"), help="resumable state and feature cache")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--heldout", type=int, default=24, help="sequences held out for the final accuracy")
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=4, help="sequences per optimizer step")
    ap.add_argument("--anchors", type=int, default=64, help="TTT anchors per sequence")
    ap.add_argument("--steps", type=int, default=1000, help="length of the learning-rate schedule")
    ap.add_argument("--stop-after", type=int, default=None, help="run only this many of the --steps")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast (autocast is ~1.6x faster on this CPU)")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    work = Path(args.work)

    target = specdec.load_target(args.target)  # fp32: the distillation cache is keyed on it
    for p in target.model.parameters():
        p.requires_grad_(False)
    seqs = recipe_data(target)
    layer_ids = default_layer_ids(target.num_layers)
    data_key = "n{n}-new{max_new_tokens}-s{seed}".format(**RECIPE_DATA)
    key = f"{args.target}-{data_key}-l{'_'.join(map(str, layer_ids))}"
    target.model.to(torch.bfloat16)  # features in bf16: about twice as fast on this CPU
    feats = extract_features(target, seqs, layer_ids, work / f"features-{key}.safetensors")
    held, train = feats[: args.heldout], feats[args.heldout:]

    model = build_model(target, layer_ids, token_counts(train, target.vocab_size), args.draft_vocab)
    embed = torch.nn.Embedding.from_pretrained(target.embed_tokens.weight.float(), freeze=True)
    head = target.lm_head.weight[model.draft_ids].float()  # the target's logits over the draft vocabulary
    in_draft = model.t2d.clone()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    step = load_train_state(work, model, opt, gen) if args.resume else 0
    stop = min(args.steps, args.stop_after or args.steps)
    counts = token_counts(train, target.vocab_size)
    coverage = float(counts[model.draft_ids].sum()) / float(counts.sum())
    print(f"draft: {sum(p.numel() for p in params) / 1e6:.2f}M trainable parameters, layers {layer_ids}, draft"
          f" vocabulary {args.draft_vocab} (covers {coverage:.1%} of response tokens), {len(train)} training"
          f" sequences; starting at step {step}")

    start = time.time()
    bar = tqdm(range(step, stop), desc="train eagle3", initial=step, total=stop)
    run_c = None
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr)
        opt.zero_grad()
        correct, counted = [0] * args.ttt_steps, [0] * args.ttt_steps
        for _ in range(args.batch):
            s = train[int(torch.randint(len(train), (1,), generator=gen))]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.fp32):
                r = ttt_loss(model, embed, head, in_draft, s, sample_anchors(s, args.anchors, gen), args.ttt_steps)
            (r.loss / args.batch).backward()
            correct = [a + b for a, b in zip(correct, r.correct)]
            counted = [a + b for a, b in zip(counted, r.counted)]
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        acc = [c / max(1, n) for c, n in zip(correct, counted)]
        run_c = acc if run_c is None else [0.95 * a + 0.05 * b for a, b in zip(run_c, acc)]
        bar.set_postfix(acc=" ".join(f"{a:.2f}" for a in run_c))
        if (step + 1) % args.save_every == 0 and step + 1 < stop:
            save_train_state(work, model, opt, step + 1, gen, {"args": vars(args)})
    minutes = (time.time() - start) / 60
    held_acc = evaluate(model, embed, head, in_draft, held, args.ttt_steps, 128, args.seed + 1)
    print("held-out accuracy per TTT step:", " ".join(f"{a:.3f}" for a in held_acc))
    out = save_eagle3(model, args.out, verifier="HuggingFaceTB/SmolLM2-135M-Instruct" if args.target == "smollm2-135m"
                      else args.target)
    (out / "train_args.json").write_text(json.dumps({
        **vars(args), "steps_run": stop, "train_minutes": round(minutes, 1), "git": git_sha(),
        "heldout_accuracy": held_acc, "data": RECIPE_DATA}, indent=2) + "\n")
    print(f"saved {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB) after {minutes:.1f} min")


if __name__ == "__main__":
    main()
