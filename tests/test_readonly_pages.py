"""Published pages cannot be written through the client API (issue 11): one engine's stray
write must not corrupt every engine's KV."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import agents
import numpy as np
import pytest

from engine_client import KVDClient, SequenceRequest
from engine_client.types import ErrorCode, KVDError

PAGE = agents.LAYOUT.page_size


def test_only_private_pages_of_ones_own_live_sequences_are_writable(daemon):
    with KVDClient.connect(daemon.socket) as c, KVDClient.connect(daemon.socket) as other:
        ns = c.register_namespace(agents.MODEL, agents.LAYOUT)
        assert other.register_namespace(agents.MODEL, agents.LAYOUT) == ns
        tokens = np.arange(3 * PAGE + 5)
        [a] = c.allocate_with_prefix(ns, [SequenceRequest("a", tokens)])
        for page in a.pages:  # private: written as before
            c.page_array(ns, page)[...] = 7
            c.page(ns, page, writable=True)[0, 0, 0, 0, 0] = 8
        assert not other.page_array(ns, a.pages[0]).flags.writeable, "another client's private page"
        c.publish(ns, ["a"])
        published, tail = a.pages[:3], a.pages[3]
        for page in published:
            view = c.page_array(ns, page)
            with pytest.raises(ValueError, match="read-only"):
                view[...] = 0
            assert (view[1:] == 7).all()
            with pytest.raises(KVDError) as e:
                c.page(ns, page, writable=True)
            assert e.value.code == ErrorCode.FAILED_PRECONDITION and "immutable" in str(e.value)
        c.page_array(ns, tail)[...] = 1  # the partial tail stays private
        [ext] = [c.extend(ns, "a", PAGE)]
        c.page_array(ns, ext.new_pages[0])[...] = 2  # and so do pages from extend
        [fork] = [c.fork(ns, "a", "b")]
        assert fork.shared_pages == published
        c.page_array(ns, fork.private_pages[0])[...] = 3  # and a fork's copies
        assert not c.page_array(ns, fork.shared_pages[0]).flags.writeable
        c.release(ns, ["a"])
        assert not c.page_array(ns, tail).flags.writeable, "a released sequence's pages are not ours any more"
        assert c.page_array(ns, tail, writable=False).base is not None
        assert c.verify_pages()["corrupted_pages"] == 0


def test_a_torch_write_to_a_published_page_faults_only_the_writer(daemon):
    with KVDClient.connect(daemon.socket) as c:
        ns = c.register_namespace(agents.MODEL, agents.LAYOUT)
        tokens = np.arange(2 * PAGE)
        [a] = c.allocate_with_prefix(ns, [SequenceRequest("a", tokens)])
        for page in a.pages:
            c.page(ns, page)[...] = 5.0
        c.publish(ns, ["a"])
        writer = textwrap.dedent(f"""
            import numpy as np
            import agents
            from engine_client import KVDClient, SequenceRequest
            with KVDClient.connect({daemon.socket!r}) as c:
                ns = c.register_namespace(agents.MODEL, agents.LAYOUT)
                [hit] = c.allocate_with_prefix(ns, [SequenceRequest("hit", np.arange({2 * PAGE}))])
                view = c.page(ns, hit.shared_pages[0])
                print("read", float(view[0, 0, 0, 0, 0]), flush=True)
                view.fill_(0.0)  # an engine bug: writing a shared prefix page
                print("wrote", flush=True)
        """)
        run = subprocess.run(
            [sys.executable, "-c", writer],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=str(__import__("pathlib").Path(__file__).parent),
        )
        assert run.returncode == -11 and "read 5.0" in run.stdout and "wrote" not in run.stdout, run
        assert all((c.page_array(ns, p) == 5.0).all() for p in a.pages)
        assert c.verify_pages()["corrupted_pages"] == 0 and c.check_invariants() == []
