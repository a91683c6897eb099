"""transformers integration: a tiny random Llama generates the same greedy tokens with
attn_implementation="asymattn" as with "eager". Skipped when transformers is absent."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from asymflash.integrations.hf import NAME, register  # noqa: E402

# CPU everywhere: fp32 end to end makes greedy tokens comparable exactly (on CUDA the
# integration runs fp32 models in bf16, since the GPU kernels are 16-bit kernels).
DEVICE = "cpu"


def tiny_llama(attn, dtype, sliding_window=None):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, attn_implementation=attn)
    torch.manual_seed(1)  # same weights for every implementation
    return transformers.LlamaForCausalLM(config).to(DEVICE, dtype).eval()


def generate(attn, ids, mask=None, dtype=torch.float32):
    model = tiny_llama(attn, dtype)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                pad_token_id=0)
    return logits, tokens


@pytest.fixture(scope="module", autouse=True)
def _registered():
    register()


def test_greedy_generation_matches_eager():
    ids = torch.randint(1, 128, (1, 17), device=DEVICE)
    ref_logits, ref_tokens = generate("eager", ids)
    logits, tokens = generate(NAME, ids)
    assert (logits - ref_logits).abs().max() < 1e-4
    assert torch.equal(tokens, ref_tokens)
    assert tokens.shape == (1, 17 + 8)


def test_left_padded_batch_matches_eager():
    """Padding goes through the varlen path; padded query rows do not disturb the rest."""
    ids = torch.randint(1, 128, (2, 13), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # the second prompt is 8 tokens, left-padded
    ids[1, :5] = 0
    ref_logits, ref_tokens = generate("eager", ids, mask)
    logits, tokens = generate(NAME, ids, mask)
    real = mask.bool()
    assert (logits[real] - ref_logits[real]).abs().max() < 1e-4
    assert torch.equal(tokens, ref_tokens)


def test_bf16_generation_runs_and_mostly_agrees():
    """bf16 rounds differently from eager's bf16 matmuls, so compare logits, not tokens."""
    ids = torch.randint(1, 128, (1, 17), device=DEVICE)
    ref_logits, _ = generate("eager", ids, dtype=torch.bfloat16)
    logits, tokens = generate(NAME, ids, dtype=torch.bfloat16)
    assert (logits.float() - ref_logits.float()).abs().max() < 5e-2
    assert tokens.shape == (1, 25)


def test_padding_offsets_are_derived_once_per_forward_pass(monkeypatch):
    """Every layer gets the same padding mask: its offsets (a host read of the mask, a wait
    for the GPU) are derived once per forward pass, not once per layer, and stay correct
    when the mask changes between passes."""
    from asymflash.integrations import hf

    derived = []
    real = hf._OFFSETS.put
    monkeypatch.setattr(hf._OFFSETS, "put", lambda *a: (derived.append(a[1]), real(*a)))
    model = tiny_llama(NAME, torch.float32)  # 2 layers
    ids = torch.randint(1, 128, (2, 13), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        first = model(ids, attention_mask=mask).logits
        assert len(derived) == 1
        again = model(ids, attention_mask=mask).logits  # a new pass: HF builds a new mask
        mask[0, :2] = 0  # in place: the offsets must be derived again
        changed = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(again, first, atol=0, rtol=0)
    assert len(derived) <= 3
    ref = tiny_llama("eager", torch.float32)
    with torch.no_grad():
        ref_changed = ref(ids, attention_mask=mask).logits
    real_rows = mask.bool()
    assert (changed[real_rows] - ref_changed[real_rows]).abs().max() < 1e-4
