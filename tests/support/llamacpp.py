"""Real llama.cpp servers for the engine tier: a generated tiny model and ``llama-server`` processes on loopback.

The model is a llama-architecture GGUF with random weights written by the ``gguf`` package (hidden 256,
4 layers) and a byte-level tokenizer without merges, so one ASCII character is exactly one token.  It is
generated once and cached under ``~/.cache/smg/models`` (``$XDG_CACHE_HOME`` honoured), keyed by
``MODEL_VERSION``: change the recipe, bump the version.

The server is llama.cpp's own HTTP server as shipped in the ``xllamacpp`` wheel.  The wheel has no
``llama-server`` binary; ``xllamacpp.Server(params)`` starts the C++ server in-process.  So each server
is this file run as a script (``python llamacpp.py serve ...``) in its own process, with its log in a
file, stopped by SIGTERM then SIGKILL like every other test process (``support.procs.Proc``).

Run ``python tests/support/llamacpp.py model`` to generate the model and print its path.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script (the server process): make ``support`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from support.procs import Proc, free_port, http_json, next_host, wait_until

MODEL_VERSION = "tiny-llama-bytes-v1"
MODEL_ID = "smg-tiny-llama"
"""The id llama.cpp reports in ``/v1/models`` (its ``--alias``)."""

N_EMBD = 256
N_LAYER = 4
N_HEAD = 4
N_FF = 512
N_CTX_TRAIN = 8192
BOS_ID, EOS_ID = 256, 257
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def model_cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "smg" / "models"


def _byte_chars() -> list[str]:
    """GPT-2's byte → printable character map, in byte order: token i is byte i."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tiny_gguf(path: Path, *, seed: int = 0) -> Path:
    """Write the tiny random-weight llama model to ``path`` (atomically: a temp file, then a rename)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    byte_chars = _byte_chars()
    # llama.cpp refuses a BPE vocabulary without merges: one merge of two control bytes (\x01\x02) that
    # no test prompt contains, so every ASCII character stays one token.
    merge = (byte_chars[1], byte_chars[2])
    tokens = [*byte_chars, "<s>", "</s>", "".join(merge)]
    vocab = len(tokens)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.05).astype(np.float16)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(MODEL_VERSION)
    w.add_context_length(N_CTX_TRAIN)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL])
    w.add_token_merges([" ".join(merge)])
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    ones = np.ones(N_EMBD, dtype=np.float32)
    w.add_tensor("token_embd.weight", matrix(vocab, N_EMBD))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", matrix(vocab, N_EMBD))
    for i in range(N_LAYER):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{name}.weight", matrix(N_EMBD, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_gate.weight", matrix(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_up.weight", matrix(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_down.weight", matrix(N_EMBD, N_FF))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def tiny_model(cache_dir: Path | None = None) -> Path:
    """The cached tiny model, generated on first use (a few seconds)."""
    path = (cache_dir or model_cache_dir()) / f"{MODEL_VERSION}.gguf"
    if not path.exists():
        write_tiny_gguf(path)
    return path


@dataclass
class LlamaServer(Proc):
    host: str = ""
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def start_llama_server(
    tmp: Path,
    model: Path,
    *,
    host: str | None = None,
    port: int | None = None,
    slots: int = 2,
    ctx: int = 8192,
    threads: int = 1,
    timeout: float = 90.0,
) -> LlamaServer:
    """A llama.cpp server on ``host:port`` (fresh loopback address by default), ready (``/health`` 200).

    ``ctx`` is the whole KV cache, split evenly over ``slots``.  The host-RAM prompt cache is off, so a
    server keeps exactly the prefixes its slots hold: the last ``slots`` distinct prompts.
    """
    host = host or next_host()
    if not host.startswith("127."):
        raise ValueError(f"loopback only, not {host}")
    port = port or free_port(host)
    args = [
        sys.executable,
        str(Path(__file__).resolve()),
        "serve",
        "--model",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--slots",
        str(slots),
        "--ctx",
        str(ctx),
        "--threads",
        str(threads),
    ]
    server = LlamaServer(
        name=f"llama-{host}-{port}", args=args, log_path=tmp / f"llama-{host}-{port}.log", host=host, port=port
    )
    server.start()
    try:
        wait_until(
            lambda: not server.alive() or http_json("GET", server.url + "/health", timeout=2)[0] == 200,
            timeout=timeout,
            interval=0.2,
            what=f"llama.cpp server {server.url}",
        )
    except AssertionError:
        server.stop()
        raise
    if not server.alive():
        log = server.log()
        server.stop()
        raise AssertionError(f"llama.cpp server {server.url} exited:\n{log[-4000:]}")
    return server


def serve(argv: list[str]) -> None:
    """The server process: llama.cpp's HTTP server in this process until SIGTERM or SIGINT."""
    p = argparse.ArgumentParser(prog="llamacpp.py serve")
    p.add_argument("--model", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)

    import xllamacpp as xlc

    params = xlc.CommonParams()
    params.model.path = a.model
    params.model_alias = {MODEL_ID}
    params.hostnames = [a.host]
    params.port = a.port
    params.n_parallel = a.slots
    params.n_ctx = a.ctx
    params.n_batch = 512
    params.n_ubatch = 512
    params.cache_ram_mib = 0  # no host-RAM prompt cache: a prefix lives only in a slot's KV cache
    params.endpoint_metrics = True
    params.cpuparams.n_threads = a.threads
    params.cpuparams_batch.n_threads = a.threads
    params.n_threads_http = 4
    params.warmup = False
    params.fit_params = False

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"xllamacpp {xlc.__version__}: serving {a.model} as {MODEL_ID} on http://{a.host}:{a.port}", flush=True)
    server = xlc.Server(params)
    print(f"listening on {server.listening_address}", flush=True)
    started = time.monotonic()
    while not stop.wait(1.0):
        pass
    print(f"stopping after {time.monotonic() - started:.1f}s", flush=True)
    del server
    sys.stdout.flush()
    os._exit(0)  # the C++ server's threads are not ours to join


def main() -> None:
    if len(sys.argv) >= 2 and sys.argv[1] == "serve":
        serve(sys.argv[2:])
    elif len(sys.argv) == 2 and sys.argv[1] == "model":
        print(tiny_model())
    else:
        sys.exit("usage: llamacpp.py model | serve --model PATH --host H --port P [--slots N --ctx N --threads N]")


if __name__ == "__main__":
    main()
