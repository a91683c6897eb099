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


def tiny_llama(attn, dtype, sliding_window=None, head_dim=16, device=DEVICE):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=4 * head_dim, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=256, attn_implementation=attn)
    torch.manual_seed(1)  # same weights for every implementation
    return transformers.LlamaForCausalLM(config).to(device, dtype).eval()


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


def test_decode_steps_read_the_cache_through_the_kvcache_path(monkeypatch):
    """Without padding, each generated token's attention is one flash_attn_with_kvcache
    call per layer on transformers' own cache tensors (no gradient, a few query rows);
    the prompt's forward is not."""
    from asymflash.integrations import hf

    calls = []
    real = hf.flash_attn_with_kvcache

    def counted(q, k, v, **kw):
        calls.append((q.shape[1], k.shape[1], k.is_contiguous()))
        return real(q, k, v, **kw)

    monkeypatch.setattr(hf, "flash_attn_with_kvcache", counted)
    ids = torch.randint(1, 128, (2, 11), device=DEVICE)
    _, ref_tokens = generate("eager", ids)
    _, tokens = generate(NAME, ids)
    assert torch.equal(tokens, ref_tokens)
    # 7 decode steps (the 8th token comes from the last step's logits) x 2 layers
    assert [c[:2] for c in calls] == [(1, 11 + i) for i in range(1, 8) for _ in range(2)]
    assert not any(c[2] for c in calls)  # the cache's (batch, heads, seq, dim) tensors, viewed


def test_decode_steps_under_torch_compile_take_custom_ops(monkeypatch):
    """While torch.compile traces, an unpadded decode step is the kvcache custom op (the
    cache read in place); a padded one, whose mask is read on the host, flash_attn_func."""
    from asymflash.integrations import hf

    q = torch.randn(2, 1, 4, 16)
    k = torch.randn(2, 9, 2, 16)
    assert hf._decode_step(q, k, k, None) and hf._decode_step(q, k, k, None, reads_mask=True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert hf._decode_step(q, k, k, None)
    assert not hf._decode_step(q, k, k, None, reads_mask=True)


def test_compiled_decode_steps_match_eager_and_read_the_cache_in_place():
    """attention_forward's decode step compiled with fullgraph=True: one kvcache_attend op in
    the graph (no flash_attn_func over a copied cache), the eager values."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from asymflash.integrations import hf

    class Layer(torch.nn.Module):
        is_causal = True

    layer = Layer()
    query = torch.randn(2, 8, 1, 16)
    key = torch.randn(2, 2, 23, 16)
    value = torch.randn(2, 2, 23, 16)
    ops = []

    def record(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(q, k, v):
        return hf.attention_forward(layer, q, k, v, None, scaling=0.25)[0]

    want = step(query, key, value)
    got = torch.compile(step, fullgraph=True, backend=CompileCounterWithBackend(record))(
        query, key, value)
    torch.testing.assert_close(got, want)
    assert any("kvcache_attend" in t for t in ops) and not any("asymflash.fwd" in t for t in ops)


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


def test_left_padded_decode_passes_the_padding_as_cache_leftpad(monkeypatch):
    """Decode steps of a left-padded batch read the cache in place with each row's padding
    as cache_leftpad; a mask with a hole inside a row is not left padding: varlen path."""
    from asymflash.integrations import hf

    seen = []
    real = hf.flash_attn_with_kvcache

    def counted(q, k, v, **kw):
        seen.append(kw["cache_leftpad"].tolist() if kw.get("cache_leftpad") is not None
                    else None)
        return real(q, k, v, **kw)

    monkeypatch.setattr(hf, "flash_attn_with_kvcache", counted)
    ids = torch.randint(1, 128, (3, 13), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :12] = 0  # a one-token prompt
    ids[mask == 0] = 0
    _, ref_tokens = generate("eager", ids, mask)
    _, tokens = generate(NAME, ids, mask)
    assert torch.equal(tokens, ref_tokens)
    assert seen and all(lp == [0, 5, 12] for lp in seen)
    seen.clear()
    holed = torch.ones_like(ids)
    holed[0, 3] = 0
    assert hf._left_padding(holed) is None
    _, ref_tokens = generate("eager", ids, holed)
    _, tokens = generate(NAME, ids, holed)
    assert torch.equal(tokens, ref_tokens) and seen == []


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_greedy_generation_matches_eager(head_dim):
    """On the GPU, bf16 (the kernels are 16-bit): prompt logits close to eager's, and the
    greedy tokens of prefill + kvcache decode equal to eager's wherever eager's choice is
    clear (its top-2 logit margin above bf16 noise), up to a row's first divergence."""
    torch.manual_seed(3)
    ids = torch.randint(1, 128, (2, 37), device="cuda")
    runs = []
    for attn in ("eager", NAME):
        model = tiny_llama(attn, torch.bfloat16, head_dim=head_dim, device="cuda")
        with torch.no_grad():
            logits = model(ids).logits.float()
            out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                 output_scores=True, return_dict_in_generate=True)
        runs.append((logits, out.sequences[:, ids.shape[1]:], torch.stack(out.scores, 1)))
    (ref_logits, ref_tokens, ref_scores), (logits, tokens, _) = runs
    assert (logits - ref_logits).abs().max() < 5e-2 * max(1.0, ref_logits.abs().max().item())
    top2 = ref_scores.float().topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.06  # ~8 bf16 ulps at these logits (|x| < 2)
    checked = 0
    for b in range(ids.shape[0]):
        for t in range(tokens.shape[1]):
            if tokens[b, t] != ref_tokens[b, t]:
                assert not clear[b, t], f"row {b} step {t}: {tokens[b, t]} vs {ref_tokens[b, t]}"
                break  # the rows' histories differ from here on
            checked += int(clear[b, t])
    assert checked >= 4, "too few clear greedy choices to compare"
