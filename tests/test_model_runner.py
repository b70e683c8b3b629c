"""The reference runner against Hugging Face transformers on tiny random models.

Every comparison runs HF's eager implementation on the full token sequence and the runner
on paged KV: suffix-only prefill over a prefix cached by an earlier prefill, full hits,
greedy decode steps and mixed batches. The pool starts filled with NaN, so any read of a
slot that was never written shows up in the logits.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence

import pytest
import torch
from transformers import (
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engine_client import PageLayout
from gpu_worker.attention import AttentionBatch, paged_attention
from gpu_worker.model import DecodeRequest, ModelRunner, PrefillRequest
from gpu_worker.model_config import LayerAttention, UnsupportedModelError, parse_config
from gpu_worker.weights import load_directory, load_model

PAGE = 4
VOCAB = 96
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    initializer_range=0.1,
    attn_implementation="eager",
)


def _build_hf(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(intermediate_size=128, **SMALL))
    if family == "llama3_rope_tied":
        rope = dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        )
        config = LlamaConfig(intermediate_size=128, rope_parameters=rope, tie_word_embeddings=True, **SMALL)
        return LlamaForCausalLM(config)
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(intermediate_size=128, **SMALL))
    if family == "mistral":
        return MistralForCausalLM(MistralConfig(intermediate_size=128, sliding_window=5, **SMALL))
    assert family == "gpt_oss"
    config = GptOssConfig(
        intermediate_size=32,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=5,
        swiglu_limit=1.0,
        max_position_embeddings=131072,
        **SMALL,
    )  # layer_types default to sliding, full; swiglu_limit 1.0 makes the clamp bite
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)  # HF's init (std 0.1) barely moves the softmax
    return model


@functools.cache
def hf_model(family: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return _build_hf(family).to(dtype).eval()


@functools.cache
def runner(family: str, dtype: torch.dtype = torch.float32) -> ModelRunner:
    spec, weights = load_model(hf_model(family))
    return ModelRunner(spec, weights, device="cpu", dtype=dtype)


def hf_logits(family: str, ids: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """HF logits [len(ids), vocab] (float32) of the full sequence."""
    with torch.no_grad():
        return hf_model(family, dtype)(torch.tensor([list(ids)])).logits[0].float()


def assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    assert got.shape == ref.shape, (got.shape, ref.shape)
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err <= TOL[dtype], f"max|d|/max|ref| = {err:.2e} > {TOL[dtype]:.0e}"


class Pages:
    """Hands out pool page ids in shuffled order, so page tables are never contiguous."""

    def __init__(self, num_pages: int, seed: int = 0) -> None:
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        assert len(taken) == n, "test pool too small"
        return taken


def nan_pool(r: ModelRunner, num_pages: int = 32) -> torch.Tensor:
    shape = r.spec.page_layout(PAGE, r.dtype).page_shape
    return torch.full((num_pages, *shape), float("nan"), dtype=r.dtype)


def page_bytes(pool: torch.Tensor, pages: Sequence[int]) -> bytes:
    return pool[list(pages)].view(torch.uint8).numpy().tobytes()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def pages_for(tokens: int) -> int:
    return -(-tokens // PAGE)


def run_prefix_suffix_decode(family: str, prefix: int, suffix: int, dtype: torch.dtype, steps: int = 3) -> None:
    """Prefill the prefix, then the suffix over it, a full hit, then greedy decode; vs HF."""
    r = runner(family, dtype)
    pool = nan_pool(r)
    ids = prompt(prefix + suffix, seed=prefix * 100 + suffix)
    table = Pages(len(pool)).take(pages_for(prefix + suffix + steps))
    if prefix:
        r.prefill([PrefillRequest(table, 0, ids[:prefix])], pool)
    cached = page_bytes(pool, table[: prefix // PAGE])
    ref = hf_logits(family, ids, dtype)
    out = r.prefill([PrefillRequest(table, prefix, ids[prefix:])], pool, all_logits=True)
    assert_close(out.token_logits[0], ref[prefix:], dtype)
    assert_close(out.last_logits[0], ref[-1], dtype)
    assert page_bytes(pool, table[: prefix // PAGE]) == cached, "a cached prefix page was written"

    before = page_bytes(pool, range(len(pool)))
    hit = r.prefill([PrefillRequest(table, len(ids), [], full_hit_last_token=ids[-1])], pool)
    assert_close(hit.last_logits[0], ref[-1], dtype)
    assert page_bytes(pool, range(len(pool))) == before, "a full hit wrote into the pool"

    logits = ref[-1]
    for _ in range(steps):
        ids.append(int(logits.argmax()))  # HF's greedy choice, so both sides see the same tokens
        got = r.decode([DecodeRequest(table, len(ids) - 1, ids[-1])], pool)
        logits = hf_logits(family, ids, dtype)[-1]
        assert_close(got[0], logits, dtype)


# (prefix, suffix) with 4-token pages: prefix k whole pages; suffix shorter than a page,
# whole pages, one token; a miss; a prefix ending mid-page.
CASES = [(8, 3), (8, 8), (8, 1), (0, 11), (6, 5)]


@pytest.mark.parametrize("family", ["llama", "llama3_rope_tied", "qwen2", "mistral", "gpt_oss"])
@pytest.mark.parametrize("prefix,suffix", CASES)
def test_suffix_prefill_full_hit_and_decode_match_hf(family: str, prefix: int, suffix: int) -> None:
    run_prefix_suffix_decode(family, prefix, suffix, torch.float32)


@pytest.mark.parametrize("prefix,suffix", [(8, 6), (12, 1)])
def test_bfloat16_llama_matches_hf(prefix: int, suffix: int) -> None:
    run_prefix_suffix_decode("llama", prefix, suffix, torch.bfloat16)


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_mixed_batch_of_hits_misses_and_full_hits(family: str) -> None:
    r = runner(family)
    pool = nan_pool(r, 48)
    pages = Pages(len(pool), seed=1)
    shared = prompt(12, seed=7)  # three whole pages, prefilled once by sequence a
    table_a = pages.take(3)
    r.prefill([PrefillRequest(table_a, 0, shared)], pool)
    cached = page_bytes(pool, table_a)

    prompts = {
        "hit": shared[:8] + prompt(5, seed=8),  # two shared pages + a 5-token suffix
        "miss": prompt(9, seed=9),
        "full": list(shared),  # every token cached
        "one": shared[:4] + prompt(1, seed=10),  # one shared page + a 1-token suffix
    }
    tables = {
        "hit": table_a[:2] + pages.take(3),
        "miss": pages.take(4),
        "full": table_a + pages.take(1),
        "one": table_a[:1] + pages.take(2),
    }
    shared_tokens = {"hit": 8, "miss": 0, "full": 12, "one": 4}
    requests = [
        PrefillRequest(
            tables[name],
            shared_tokens[name],
            prompts[name][shared_tokens[name] :],
            full_hit_last_token=prompts[name][-1] if name == "full" else None,
        )
        for name in prompts
    ]
    out = r.prefill(requests, pool, all_logits=True)
    assert page_bytes(pool, table_a) == cached, "a shared page was written by the batch"
    for i, name in enumerate(prompts):
        ref = hf_logits(family, prompts[name])
        assert_close(out.last_logits[i], ref[-1])
        assert_close(out.token_logits[i], ref[-len(out.token_logits[i]) :])

    for _ in range(2):  # mixed decode batch, "full" decodes into its private tail page
        for name in prompts:
            prompts[name].append(int(hf_logits(family, prompts[name])[-1].argmax()))
        got = r.decode([DecodeRequest(tables[n], len(prompts[n]) - 1, prompts[n][-1]) for n in prompts], pool)
        for i, name in enumerate(prompts):
            assert_close(got[i], hf_logits(family, prompts[name])[-1])
    assert page_bytes(pool, table_a) == cached


def test_full_hit_writes_no_slot_and_suffix_writes_only_its_own(monkeypatch) -> None:
    import gpu_worker.model as model_module

    written: list[list[tuple[int, int]]] = []

    def spy(kv_pool, layer, slot_pages, slot_offsets, k, v):
        written.append(list(zip(slot_pages.tolist(), slot_offsets.tolist())))
        real_write_kv(kv_pool, layer, slot_pages, slot_offsets, k, v)

    real_write_kv = model_module.write_kv
    monkeypatch.setattr(model_module, "write_kv", spy)
    r = runner("llama")
    pool = nan_pool(r)
    table = Pages(len(pool)).take(4)
    ids = prompt(14, seed=4)
    r.prefill([PrefillRequest(table, 0, ids[:8])], pool)
    written.clear()
    r.prefill([PrefillRequest(table, 8, ids[8:])], pool)
    suffix_slots = [(table[p // PAGE], p % PAGE) for p in range(8, 14)]
    assert written == [suffix_slots] * r.spec.num_layers
    written.clear()
    r.prefill([PrefillRequest(table, 14, [], full_hit_last_token=ids[-1])], pool)
    assert written == [[]] * r.spec.num_layers


def test_layer_callback_sees_each_layer_written_in_order() -> None:
    r = runner("gpt_oss")
    pool = nan_pool(r)
    table = Pages(len(pool)).take(3)
    seen: list[int] = []

    def on_layer_written(layer: int) -> None:
        page, slot = table[9 // PAGE], 9 % PAGE  # last new token
        assert not pool[page, layer, :, slot].isnan().any(), f"layer {layer} K/V not yet in the pool"
        if layer + 1 < r.spec.num_layers:
            assert pool[page, layer + 1, :, slot].isnan().all(), f"layer {layer + 1} written early"
        seen.append(layer)

    r.prefill([PrefillRequest(table, 0, prompt(10, seed=3))], pool, on_layer_written=on_layer_written)
    assert seen == list(range(r.spec.num_layers))


def dense_attention(q, k, v, positions, window, sinks, scale):
    """Plain masked softmax over one sequence's contiguous keys, for checking paged_attention."""
    # q: [n, heads, d]; k, v: [context, kv_heads, d]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,khd->hnk", q, k) * scale  # [heads, n, context]
    key_pos = torch.arange(k.shape[0])
    visible = key_pos[None, :] <= positions[:, None]
    if window is not None:
        visible &= key_pos[None, :] > positions[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks[:, None, None].expand(-1, scores.shape[1], 1)], dim=-1)
    probs = scores.softmax(-1)[..., : k.shape[0]]
    return torch.einsum("hnk,khd->nhd", probs, v)


@pytest.mark.parametrize("window", [None, 6])
def test_paged_attention_matches_dense_and_reads_only_window_pages(window: int | None) -> None:
    torch.manual_seed(1)
    layers, kv_heads, heads, d = 2, 2, 6, 8
    pool = torch.randn(24, layers, 2, PAGE, kv_heads, d)
    pages = Pages(len(pool), seed=2)
    # (start, query_len): decode deep into the context, a suffix, a prefill from 0
    seqs = [(21, 1), (9, 7), (0, 13)]
    tables = [pages.take(pages_for(s + n)) for s, n in seqs]
    batch = AttentionBatch.build(tables, [s for s, _ in seqs], [n for _, n in seqs], [True] * 3, PAGE, "cpu")
    q = torch.randn(batch.num_tokens, heads, d)
    sinks = torch.randn(heads)
    out = paged_attention(q, pool, 1, batch, scale=0.3, window=window, sinks=sinks)
    row = 0
    for table, (start, n) in zip(tables, seqs):
        kv = pool[table, 1]  # [pages, 2, page, kv_heads, d]
        k, v = (kv[:, i].reshape(-1, kv_heads, d)[: start + n] for i in (0, 1))
        ref = dense_attention(q[row : row + n], k, v, torch.arange(start, start + n), window, sinks, 0.3)
        torch.testing.assert_close(out[row : row + n], ref, rtol=1e-5, atol=1e-5)
        row += n
    if window is not None:
        poisoned = pool.clone()
        for table, (start, _) in zip(tables, seqs):
            first_needed_page = max(0, start - window + 1) // PAGE
            poisoned[table[:first_needed_page]] = float("nan")
        again = paged_attention(q, poisoned, 1, batch, scale=0.3, window=window, sinks=sinks)
        assert torch.equal(again, out), "a sliding layer read a page outside its window"
        assert not torch.equal(out, paged_attention(q, pool, 1, batch, scale=0.3, window=None, sinks=sinks))


DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    hidden_size=7168,
    num_attention_heads=128,
    num_key_value_heads=128,
    num_hidden_layers=61,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    vocab_size=129280,
    intermediate_size=18432,
)


@pytest.mark.parametrize(
    "config,words",
    [
        (DEEPSEEK_V3, "kv_lora_rank"),
        ({**DEEPSEEK_V3, "model_type": "llama"}, "MLA"),  # an MLA config is refused whatever its type says
        (
            {
                **DEEPSEEK_V3,
                "model_type": "deepseek_v32",
                "kv_lora_rank": None,
                "q_lora_rank": None,
                "index_topk": 2048,
            },
            "indexer",
        ),
        ({"model_type": "mamba", "hidden_size": 64}, "'mamba' is not supported"),
        ({**LlamaConfig(**SMALL).to_dict(), "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({**GptOssConfig(**SMALL).to_dict(), "quantization_config": {"quant_method": "mxfp4"}}, "quantised"),
    ],
)
def test_unsupported_configs_raise(config: dict, words: str) -> None:
    with pytest.raises(UnsupportedModelError, match=words):
        parse_config(config)


DEEPSEEK_V32 = {
    **DEEPSEEK_V3,
    "model_type": "deepseek_v32",
    "index_topk": 2048,
    "index_n_heads": 64,
    "index_head_dim": 128,
}
DEEPSEEK_V4 = dict(  # the shape of deepseek-ai/DeepSeek-V4-Flash's config.json: no kv_lora_rank, K = V
    model_type="deepseek_v4",
    hidden_size=4096,
    num_attention_heads=64,
    num_key_value_heads=1,
    head_dim=512,
    num_hidden_layers=4,
    q_lora_rank=1024,
    o_lora_rank=1024,
    o_groups=8,
    compress_ratios=[0, 0, 4, 128],
    compress_rope_theta=160000,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    sliding_window=128,
    vocab_size=129280,
    intermediate_size=2048,
)


@pytest.mark.parametrize(
    "config,features,not_named",
    [
        (  # DSA = MLA + an indexer: both are named, not just the first found
            DEEPSEEK_V32,
            [
                "multi-head latent attention (MLA) (kv_lora_rank)",
                "indexer (DSA) (index_topk, index_n_heads, index_head_dim)",
            ],
            [],
        ),
        (  # compressed sparse, shared-KV attention is not MLA
            DEEPSEEK_V4,
            [
                "shared K = V head (CSA/HCA) (compress_ratios, compress_rope_theta)",
                "indexer (DSA)",
                "low-rank query projection (q_lora_rank)",
                "grouped low-rank output projection (o_lora_rank, o_groups)",
            ],
            ["MLA"],
        ),
        (  # transformers' deepseek_v4 config names the kinds in layer_types
            {
                **LlamaConfig(**SMALL).to_dict(),
                "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
            },
            ["(layer_types 'compressed_sparse_attention', layer_types 'heavily_compressed_attention')"],
            ["MLA"],
        ),
    ],
    ids=["deepseek_v32", "deepseek_v4", "layer_types"],
)
def test_a_refusal_names_every_unsupported_feature(config: dict, features: list[str], not_named: list[str]) -> None:
    with pytest.raises(UnsupportedModelError) as refused:
        parse_config(config)
    message = str(refused.value)
    for feature in features:
        assert feature in message, message
    for word in not_named:
        assert word not in message, message


def test_gpt_oss_config_json_in_the_older_rope_scaling_format() -> None:
    config = {  # the shape of openai/gpt-oss-20b's config.json, sizes shrunk
        "model_type": "gpt_oss",
        "hidden_size": 64,
        "head_dim": 16,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 4,
        "intermediate_size": 32,
        "vocab_size": 96,
        "num_local_experts": 4,
        "experts_per_token": 2,
        "num_experts_per_tok": 2,
        "sliding_window": 128,
        "rope_theta": 150000,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
    }
    spec = parse_config(config)
    assert spec.layers == (LayerAttention("sliding", 128), LayerAttention("full")) * 2
    assert (spec.rope.kind, spec.rope.theta, spec.rope.truncate) == ("yarn", 150000.0, False)
    assert spec.attention_sinks and spec.qkv_bias and spec.o_bias and spec.moe is not None
    assert spec.page_layout(16, torch.bfloat16) == PageLayout(4, 2, 16, 16, "bfloat16")


@pytest.mark.parametrize("family", ["llama3_rope_tied", "gpt_oss"])
def test_weights_load_from_a_saved_directory(family: str, tmp_path) -> None:
    hf_model(family).save_pretrained(tmp_path)
    spec, weights = load_directory(tmp_path)
    assert spec == runner(family).spec
    r = ModelRunner(spec, weights)
    ids = prompt(10, seed=5)
    pool = nan_pool(r)
    out = r.prefill([PrefillRequest(Pages(len(pool)).take(3), 0, ids)], pool, all_logits=True)
    assert_close(out.token_logits[0], hf_logits(family, ids))


def test_bad_requests_are_refused() -> None:
    with pytest.raises(ValueError, match="full_hit_last_token"):
        PrefillRequest([0, 1], 8, [])
    with pytest.raises(ValueError, match="full_hit_last_token"):
        PrefillRequest([0, 1], 4, [3, 4], full_hit_last_token=4)
    r = runner("llama")
    with pytest.raises(ValueError, match="cannot hold"):
        r.prefill([PrefillRequest([0], 0, prompt(5, seed=1))], nan_pool(r))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_the_same_code_on_cuda_matches_hf(family: str) -> None:
    """Suffix-only prefill and a decode step on device="cuda" against transformers on the CPU."""
    spec, weights = load_model(hf_model(family))
    r = ModelRunner(spec, weights, device="cuda", dtype=torch.float32)
    ids = prompt(14, seed=21)
    prefix = 8
    pool = torch.zeros((8, *spec.page_layout(PAGE, torch.float32).page_shape), device="cuda")
    table = Pages(8, seed=4).take(pages_for(len(ids) + 1))
    r.prefill([PrefillRequest(table, 0, ids[:prefix])], pool)
    out = r.prefill([PrefillRequest(table, prefix, ids[prefix:])], pool, all_logits=True)
    assert_close(out.token_logits[0].cpu(), hf_logits(family, ids)[prefix:])
    next_id = int(out.last_logits[0].argmax())
    logits = r.decode([DecodeRequest(table, len(ids), next_id)], pool)
    assert_close(logits[0].cpu(), hf_logits(family, ids + [next_id])[-1])
