"""The engine loop against a real daemon: prefill with prefix hits, greedy decode, hold and
resume, completion, and two engine processes sharing a prefix.

Logits are compared with transformers' eager implementation on each sequence alone
(tiny random models built here; nothing is downloaded) or with a full recompute by the
reference runner. The GPU pool starts filled with NaN, so any read of a slot that was
never written shows up in the logits.
"""

from __future__ import annotations

import functools
import hashlib

import pytest
import torch
from conftest import budget_for
from transformers import GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM

from engine_client import KVDClient
from gpu_worker.demo import DemoConfig, run_demo
from gpu_worker.engine import Engine, NoRoom, SequenceEvicted
from gpu_worker.model import ModelRunner
from gpu_worker.tiny_model import recompute_logits, tiny_model
from gpu_worker.weights import load_model

PAGE = 4
VOCAB = 96
TOL = 1e-4  # max|d| / max|ref|, float32
SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    initializer_range=0.1,
    attn_implementation="eager",
)


@functools.cache
def hf_model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(intermediate_size=128, **SMALL)).eval()
    config = GptOssConfig(  # layers: sliding (window 5, shorter than every prompt here), full
        intermediate_size=32,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=5,
        swiglu_limit=1.0,
        max_position_embeddings=131072,
        **SMALL,
    )
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)  # HF's init (std 0.1) barely moves the softmax
    return model.eval()


@functools.cache
def runner(family: str) -> ModelRunner:
    spec, weights = load_model(hf_model(family))
    return ModelRunner(spec, weights)


def hf_last_logits(family: str, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(family)(torch.tensor([list(ids)])).logits[0, -1].float()


def assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err <= TOL, f"max|d|/max|ref| = {err:.2e} > {TOL:.0e}"


def tokens(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.fixture
def client(daemon):
    with KVDClient.connect(daemon.socket, client_name="test-engine") as c:
        yield c


def make_engine(client: KVDClient, r: ModelRunner, gpu_pages: int = 96, model: str = "tiny") -> Engine:
    engine = Engine(client, r, r.spec, PAGE, gpu_pages, model=model)
    engine.pool.kv.fill_(float("nan"))
    return engine


def host_digests(engine: Engine, pages) -> list[str]:
    return [digest(engine.host.page(p)) for p in pages]


def gpu_digests(engine: Engine, pages) -> list[str]:
    return [digest(engine.pool.kv[engine.pool.copy_of(p)]) for p in pages]


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_mixed_batch_decodes_like_transformers_on_each_sequence(family: str, client: KVDClient) -> None:
    engine = make_engine(client, runner(family), model=f"tiny-{family}")
    base = tokens(13, seed=1)  # three full pages, published by its prefill, and a partial one
    [first] = engine.prefill([("base", base)])
    assert (first.computed_tokens, first.reused_tokens) == (13, 0)
    assert_close(first.logits, hf_last_logits(family, base))
    shared = engine.info("base").host_pages[:3]
    host_before, gpu_before = host_digests(engine, shared), gpu_digests(engine, shared)

    own = tokens(9, seed=2)
    prompts = {
        "hit": base[:8] + tokens(5, seed=3),  # two shared pages + 5 own tokens
        "miss": own,
        "twin": list(own),  # same prompt in the same batch: its full pages get rebound on publish
        "full": base[:12],  # every token cached: only the last token's query is run, no K/V
    }
    results = {r.seq_id: r for r in engine.prefill(list(prompts.items()))}
    assert {s: (r.computed_tokens, r.reused_tokens) for s, r in results.items()} == {
        "hit": (5, 8),
        "miss": (9, 0),
        "twin": (9, 0),
        "full": (1, 12),
    }
    assert engine.info("twin").host_pages[:2] == engine.info("miss").host_pages[:2]
    assert engine.page_table("twin")[:2] == engine.page_table("miss")[:2]
    assert engine.page_table("hit")[:2] == engine.page_table("base")[:2] == engine.page_table("full")[:2]
    conversations = {"base": base + [first.next_token]}
    for s, r in results.items():
        assert_close(r.logits, hf_last_logits(family, prompts[s]))
        conversations[s] = prompts[s] + [r.next_token]
    assert host_digests(engine, shared) == host_before and gpu_digests(engine, shared) == gpu_before

    seqs = list(conversations)
    for _ in range(6):  # crosses page boundaries: runway pages, publishes, rebinds of the twin
        step = engine.decode_step(seqs)
        for i, s in enumerate(seqs):
            ref = hf_last_logits(family, conversations[s])
            assert_close(step.logits[i], ref)
            assert step.tokens[i] == int(ref.argmax())
            conversations[s].append(step.tokens[i])
    for s in seqs:
        assert engine.info(s).conversation == conversations[s]
    assert engine.info("twin").host_pages[:3] == engine.info("miss").host_pages[:3]  # page 2 filled in decode
    assert host_digests(engine, shared) == host_before and gpu_digests(engine, shared) == gpu_before
    engine.pool.check()
    engine.complete(seqs)
    assert client.check_invariants() == []


def test_prefill_computes_exactly_the_suffix_on_a_hit(client: KVDClient, monkeypatch) -> None:
    import gpu_worker.model as model_module

    written: list[int] = []
    real_write_kv = model_module.write_kv

    def spy(kv_pool, layer, slot_pages, slot_offsets, k, v):
        written.append(len(slot_pages))
        real_write_kv(kv_pool, layer, slot_pages, slot_offsets, k, v)

    monkeypatch.setattr(model_module, "write_kv", spy)
    r = runner("llama")
    engine = make_engine(client, r)
    prompt = tokens(24, seed=5)
    engine.prefill([("a", prompt)])
    assert written == [24] * r.spec.num_layers
    written.clear()
    [hit] = engine.prefill([("b", prompt[:16] + tokens(3, seed=6))])
    assert (hit.computed_tokens, hit.reused_tokens) == (3, 16)
    assert written == [3] * r.spec.num_layers  # only the suffix's K/V, layer by layer
    written.clear()
    [full] = engine.prefill([("c", prompt[:20])])
    # A full hit writes no K/V, but the runner does run its last token (the query, for the
    # logits): computed_tokens counts what the runner processed, not prompt minus hit.
    assert (full.computed_tokens, full.reused_tokens) == (1, 20)
    assert written == [0] * r.spec.num_layers  # a full hit writes nothing
    assert_close(full.logits, hf_last_logits("llama", prompt[:20]))
    stats = engine.stats()
    assert (stats.prefill_tokens_computed, stats.prefill_tokens_reused) == (24 + 3 + 1, 16 + 20)


def test_eight_sequences_share_one_loaded_prefix_across_hold_and_resume(client: KVDClient) -> None:
    r = runner("llama")
    engine = make_engine(client, r, gpu_pages=80)
    prefix = tokens(40 * PAGE, seed=7)
    engine.prefill([("warm", prefix)])
    engine.complete(["warm"])  # the prefix stays published (cached) in the daemon, not on the GPU
    assert engine.pool.stats().physical_pages == 0

    seqs = [f"s{i}" for i in range(8)]
    before = engine.pool.stats()
    results = engine.prefill([(s, prefix + tokens(6, seed=10 + i)) for i, s in enumerate(seqs)])
    after = engine.pool.stats()
    assert all((x.computed_tokens, x.reused_tokens) == (6, 40 * PAGE) for x in results)
    private = 8 * 2  # 6 own tokens: two private pages each
    assert after.unique_host_pages_loaded - before.unique_host_pages_loaded == 40
    assert after.duplicate_loads_skipped - before.duplicate_loads_skipped == 7 * 40
    assert (after.physical_pages, after.logical_pages) == (40 + private, 8 * 40 + private)
    assert (after.shared_pages, after.shared_refs) == (40, 8 * 40)
    tables = [engine.page_table(s) for s in seqs]
    assert len({t[:40] for t in tables}) == 1 and len({g for t in tables for g in t[40:]}) == private

    for _ in range(2):
        assert engine.decode_step(seqs).loaded_pages == 0
    assert engine.pool.stats().unique_host_pages_loaded == after.unique_host_pages_loaded

    engine.hold(seqs)
    held = engine.pool.stats()
    assert (held.logical_pages, held.cached_pages) == (0, 40 + private)
    engine.prefill([("squeeze", tokens(30 * PAGE, seed=99))])  # 30 pages: evicts 14 cached copies
    engine.complete(["squeeze"])
    rows = {p for s in seqs for p in engine.info(s).host_pages}
    evicted = rows - set(engine.pool.resident())
    assert 0 < len(evicted) < len(rows)
    loaded = engine.pool.stats().unique_host_pages_loaded
    assert engine.resume(seqs) == len(evicted)
    assert engine.pool.stats().unique_host_pages_loaded - loaded == len(evicted)

    step = engine.decode_step(seqs)
    for i, s in enumerate(seqs):
        assert_close(step.logits[i], recompute_logits(r, PAGE, list(engine.info(s).tokens)))
    engine.complete(seqs)
    final = engine.pool.stats()
    assert (final.logical_pages, final.physical_pages, final.cached_pages) == (0, 0, 0)
    engine.pool.check()
    stats = client.stats()
    assert stats["sequences"] == 0 and stats["logical_pages"] == 0
    assert client.check_invariants() == []


def test_a_filled_decode_page_is_published_and_hit_by_the_conversation(client: KVDClient) -> None:
    engine = make_engine(client, runner("llama"))
    prompt = tokens(10, seed=11)
    engine.prefill([("a", prompt)])
    for _ in range(6):  # tokens 10..15 fill pages 2 and 3
        engine.decode_step(["a"])
    info = engine.info("a")
    assert len(info.tokens) == 16 and info.published_pages == 4
    conversation = info.conversation  # 17 tokens: everything so far plus the chosen next token
    [b] = engine.prefill([("b", conversation)])
    assert (b.reused_tokens, b.computed_tokens) == (16, 1)
    assert engine.info("b").host_pages[:4] == info.host_pages[:4]
    assert_close(b.logits, hf_last_logits("llama", conversation))
    engine.complete(["a", "b"])


def test_no_room_on_the_gpu_changes_nothing(client: KVDClient) -> None:
    engine = make_engine(client, runner("llama"), gpu_pages=2)
    engine.prefill([("a", tokens(8, seed=12))])  # exactly the pool's two pages
    snapshot, info, daemon_stats = engine.pool.snapshot(), engine.info("a"), client.stats()
    with pytest.raises(NoRoom, match="gpu"):
        engine.decode_step(["a"])  # token 8 needs a third page
    assert engine.pool.snapshot() == snapshot and engine.info("a") == info
    assert client.stats()["logical_pages"] == daemon_stats["logical_pages"]
    with pytest.raises(NoRoom, match="gpu"):
        engine.prefill([("b", tokens(3, seed=13))])
    assert engine.pool.snapshot() == snapshot and client.stats()["sequences"] == 1
    engine.complete(["a"])
    assert client.check_invariants() == []


def test_no_room_on_the_host_changes_nothing(daemon_factory) -> None:
    r = runner("llama")
    layout = r.spec.page_layout(PAGE, r.dtype)
    host_pages = (64 << 10) // layout.page_bytes  # in two extents of 32 KiB
    budget = budget_for(host_pages, layout.page_bytes, PAGE, extents=2)
    flags = ("--enable-prefix-reuse", "--host-bytes", str(budget), "--extent-bytes", "32KiB")
    small = daemon_factory(*flags, name="small")
    with KVDClient.connect(small.socket) as client:
        engine = make_engine(client, r)
        engine.prefill([("a", tokens(host_pages * PAGE, seed=14))])  # every host page
        snapshot, info, daemon_stats = engine.pool.snapshot(), engine.info("a"), client.stats()
        with pytest.raises(NoRoom, match="host"):
            engine.decode_step(["a"])
        # The runway page taken for the step went back (to the end of the free list).
        now = engine.pool.snapshot()
        assert (now.refcounts, now.host_of_gpu, now.cached) == (
            snapshot.refcounts,
            snapshot.host_of_gpu,
            snapshot.cached,
        )
        assert sorted(now.free) == sorted(snapshot.free) and engine.info("a") == info
        assert client.stats()["logical_pages"] == daemon_stats["logical_pages"]
        engine.complete(["a"])
        [b] = engine.prefill([("b", tokens(5, seed=15))])
        engine.decode_step(["b"])
        engine.complete(["b"])
        assert client.check_invariants() == []


def test_second_engine_process_hits_the_first_ones_prefix(daemon) -> None:
    cfg = DemoConfig(
        engines=2,
        agents_per_engine=1,
        prefix_tokens=200,
        suffix_tokens=10,
        decode_tokens=3,
        family="gpt_oss",
        page_size=16,
    )
    result = run_demo(cfg, socket=daemon.socket)
    first, second = result.reports
    assert (first.reused_tokens, first.computed_tokens) == (0, 210)
    assert (second.reused_tokens, second.computed_tokens) == (192, 18)  # 12 shared pages
    assert second.gpu_pages_loaded == 12
    assert result.max_logit_delta <= 1e-4
    assert result.live["physical_pages"] < result.live["logical_pages"]
    assert result.violations == () and result.after["sequences"] == 0


def test_demo_model_is_the_same_in_every_process() -> None:
    a, b = tiny_model("gpt_oss", seed=3), tiny_model("gpt_oss", seed=3)
    assert a[0] == b[0]
    assert torch.equal(a[1].layers[1].mlp.gate_up, b[1].layers[1].mlp.gate_up)
    assert not torch.equal(a[1].embed_tokens, tiny_model("gpt_oss", seed=4)[1].embed_tokens)


def test_a_page_published_meanwhile_by_another_engine_is_rebound_and_reloaded(daemon) -> None:
    """Engine B allocates a prompt, engine A (another session) publishes the same pages
    before B does: B's pages are rebound to A's, and B's GPU copies reloaded from them."""
    r = runner("llama")
    prompt = tokens(14, seed=16)
    with KVDClient.connect(daemon.socket) as client_a, KVDClient.connect(daemon.socket) as client_b:
        engine_a = make_engine(client_a, ModelRunner(r.spec, r.weights))
        runner_b = ModelRunner(r.spec, r.weights)
        engine_b = make_engine(client_b, runner_b)
        real_prefill = runner_b.prefill

        def prefill_after_a_published(*args, **kwargs):
            engine_a.prefill([("a", prompt)])
            return real_prefill(*args, **kwargs)

        runner_b.prefill = prefill_after_a_published
        [b] = engine_b.prefill([("b", prompt)])
        assert b.computed_tokens == 14  # B allocated before A published: a miss
        shared = engine_a.info("a").host_pages[:3]
        assert engine_b.info("b").host_pages[:3] == shared
        assert gpu_digests(engine_b, shared) == host_digests(engine_b, shared)
        assert engine_b.stats().rebinds == 3
        assert_close(b.logits, hf_last_logits("llama", prompt))
        step = engine_b.decode_step(["b"])
        assert_close(step.logits[0], hf_last_logits("llama", engine_b.info("b").tokens))
        engine_b.pool.check()
        engine_a.complete(["a"])
        engine_b.complete(["b"])
        assert client_a.check_invariants() == []


@pytest.mark.parametrize("notice", ["received", "late"])
def test_an_on_hold_sequence_evicted_by_the_daemon_is_dropped_here_too(daemon_factory, notice: str) -> None:
    # Without prefix reuse every page stays private, so the daemon may evict an on-hold
    # sequence to make room (it counts only private pages of on-hold sequences as freeable).
    small = daemon_factory("--no-enable-prefix-reuse", "--host-bytes", "64KiB", "--extent-bytes", "32KiB", name="small")
    r = runner("llama")
    with KVDClient.connect(small.socket) as client:
        engine = make_engine(client, r)
        engine.prefill([("a", tokens(20 * PAGE, seed=17))])  # 20 of the 32 host pages
        engine.hold(["a"])
        assert engine.pool.stats().cached_pages == 20
        if notice == "late":  # the eviction notice has not arrived: the page ids must tell
            client.take_evicted = lambda: set()
        # 20 more pages: the daemon evicts "a" and hands its page ids to "b"; the GPU copies
        # of a's pages must not be taken for b's.
        [b] = engine.prefill([("b", tokens(20 * PAGE, seed=18))])
        assert b.computed_tokens == 20 * PAGE
        with pytest.raises(SequenceEvicted):
            engine.resume(["a"])
        assert engine.info("a").state == "EVICTED"
        step = engine.decode_step(["b"])
        assert_close(step.logits[0], recompute_logits(r, PAGE, list(engine.info("b").tokens)))
        engine.complete(["a", "b"])
        engine.pool.check()
        assert engine.pool.stats().cached_pages == 0
        assert client.stats()["sequences"] == 0 and client.check_invariants() == []
