"""Real-engine tier: two llama.cpp servers (xllamacpp, a generated tiny model) behind a real smg-router, and two
vLLM CPU engines publishing their KV events (``test_vllm_events.py``, its own module-scoped fleet).

Each llama.cpp test gets a fresh fleet (a server starts in ~0.2 s), so no test sees another's KV cache, router
tree or processed counts; vLLM's engines take ~30 s to start and are shared by their module's tests, each with
prompts of its own.  Every process is stopped at teardown, whatever the test did.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.llamacpp import MODEL_ID, LlamaServer, start_llama_server, tiny_model
from support.procs import Router, start_router


@pytest.fixture(scope="session")
def tiny_gguf() -> Path:
    """The generated tiny model (cached across sessions under ~/.cache/smg/models)."""
    missing = [m for m in ("xllamacpp", "gguf", "numpy") if importlib.util.find_spec(m) is None]
    if missing:  # this tier runs in CI: fail loudly rather than skip
        pytest.fail(f"the real-engine tier needs {', '.join(missing)}: pip install -e '.[test]'")
    return tiny_model()


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture
def engines(logs: Path, tiny_gguf: Path) -> Iterator[list[LlamaServer]]:
    """Two llama.cpp servers on their own loopback addresses, 2 slots of 4096 tokens each, 1 thread each."""
    servers: list[LlamaServer] = []
    try:
        for _ in range(2):
            servers.append(start_llama_server(logs, tiny_gguf, slots=2, ctx=8192, threads=1))
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.fixture
def router(logs: Path, engines: list[LlamaServer]) -> Iterator[Router]:
    """smg-router (cache_aware, load polled every 0.2 s) over both engines; the model is discovered."""
    r = start_router(logs, workers=[e.url for e in engines], args=["--policy", "cache_aware"])
    try:
        r.wait_routable(len(engines), timeout=30)
        assert {w["model_id"] for w in r.workers()} == {MODEL_ID}
        yield r
    finally:
        r.stop()
