"""The Gemma-4-style assistant drafter: same logits and drafts as transformers'
``Gemma4AssistantForCausalLM`` driven the way its ``SinglePositionMultiTokenCandidateGenerator``
drives it, on a tiny random Gemma 4 target with KV-shared layers; the sparse ordered-embedding
head; the KV-sharing map; and clear errors for targets it cannot read."""

from __future__ import annotations

import pytest
import torch

from specdec.drafters.gemma_mtp.drafter import GemmaMTPDrafter, kv_source_layers, sparse_logits, tiny_assistant
from specdec.loop import Request, run
from specdec.target import Target
from specdec.testing import Recording
from specdec.testing.tiny import tiny_model
from specdec.verifiers import GreedyVerifier


@pytest.fixture(scope="module")
def gemma4_target() -> Target:
    return Target(tiny_model("gemma4", vocab_size=48, init_scale=0.3, seed=5))


class _KeepLogits(Recording):
    def propose(self, state, k, rows):
        p = super().propose(state, k, rows)
        if len(self.proposals) == 1:  # the first proposal: straight after the prefill
            self.inner_state_logits = state.logits.clone()
        return p


@pytest.mark.parametrize("ordered", [False, True], ids=["dense-head", "ordered-embeddings"])
def test_same_logits_and_drafts_as_transformers(gemma4_target, ordered):
    t, k = gemma4_target, 4
    assistant = tiny_assistant(t, seed=2, use_ordered_embeddings=ordered)
    drafter = GemmaMTPDrafter(assistant)
    drafter.bind(t)
    rec = _KeepLogits(drafter)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]  # longer than the sliding window of 4
    run(t, rec, GreedyVerifier(), [Request(prompt, k + 1)], k=k, eos_token_ids=set())
    ours_tokens = rec.proposals[0].tokens[0]
    # transformers, driven as SinglePositionMultiTokenCandidateGenerator drives it
    with torch.inference_mode():
        out = t.model(input_ids=torch.tensor([prompt]), output_hidden_states=True, return_shared_kv_states=True)
        token = out.logits[:, -1:].argmax(-1)
        hidden = out.hidden_states[-1][:, -1:]
        ref_tokens, ref_logits = [], []
        for _ in range(k):
            emb = t.model.get_input_embeddings()(token)
            o = assistant(inputs_embeds=torch.cat([emb, hidden], -1), position_ids=torch.tensor([[len(prompt)]]),
                          shared_kv_states=out.shared_kv_states, use_cache=False)
            token, hidden = o.logits.argmax(-1), o.last_hidden_state
            ref_tokens.append(int(token)), ref_logits.append(o.logits[0, 0])
    assert ours_tokens.tolist() == ref_tokens
    # logits of every step, from the state the drafter kept after that proposal
    torch.testing.assert_close(rec.inner_state_logits[0], torch.stack(ref_logits).float(), atol=1e-4, rtol=1e-4)


def test_kv_sharing_map_uses_last_owner_of_each_type(gemma4_target):
    # 4 layers [sliding, full, sliding, full], the last 2 KV-shared: owners are layers 0 and 1
    assert kv_source_layers(gemma4_target) == {"sliding_attention": 0, "full_attention": 1}
    llama = Target(tiny_model("llama", vocab_size=32))
    assert kv_source_layers(llama) == {"full_attention": llama.num_layers - 1}


def test_sparse_head_scores_only_the_selected_clusters():
    torch.manual_seed(0)
    V, d, C = 12, 5, 4
    centroids = torch.nn.Linear(d, C, bias=False)
    ordering = torch.randperm(V)
    w = torch.randn(V, d)
    h = torch.randn(3, d)
    logits = sparse_logits(h, centroids, ordering, w, top_k=2)
    dense = h @ w.T
    clusters = centroids(h).topk(2, -1).indices
    for b in range(3):
        members = ordering.view(C, V // C)[clusters[b]].flatten()
        torch.testing.assert_close(logits[b, members], dense[b, members])
        others = torch.ones(V, dtype=torch.bool)
        others[members] = False
        assert bool((logits[b, others] == dense[b, members].min() - 1).all())  # per-row fill value


def test_targets_it_cannot_read_are_refused():
    ds = Target(tiny_model("deepseek_v3", vocab_size=32))
    with pytest.raises(ValueError, match="MLA"):
        GemmaMTPDrafter.tiny(ds)
    llama = Target(tiny_model("llama", vocab_size=32))
    other = Target(tiny_model("llama", vocab_size=32, hidden_size=48))
    with pytest.raises(ValueError, match="backbone_hidden_size"):
        GemmaMTPDrafter(tiny_assistant(other)).bind(llama)


def test_loads_a_gemma4_assistant_checkpoint_from_safetensors(gemma4_target, tmp_path):
    assistant = tiny_assistant(gemma4_target, seed=4, use_ordered_embeddings=True)
    assistant.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert '"model_type": "gemma4_assistant"' in (tmp_path / "config.json").read_text()
    loaded = GemmaMTPDrafter.create(gemma4_target, checkpoint=str(tmp_path))
    for name, p in assistant.state_dict().items():
        torch.testing.assert_close(loaded.assistant.state_dict()[name], p)
    res = run(gemma4_target, loaded, GreedyVerifier(), [Request([1, 2, 3], 6)], k=3, eos_token_ids=set())
    assert len(res.requests[0].tokens) == 6


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "gemma4"])
def test_assistant_queries_use_the_targets_rope(family):
    """The queries are rotated like the keys the target cached, for any target family."""
    t = Target(tiny_model(family, vocab_size=48))
    a = tiny_assistant(t)
    pos, x = torch.arange(20)[None], torch.zeros(1, 20, 8)
    args = () if family in ("llama", "qwen3") else ("full_attention",)
    for ours, theirs in zip(a.model.rotary_emb(x, pos, "full_attention"), t.decoder.rotary_emb(x, pos, *args)):
        torch.testing.assert_close(ours, theirs)
