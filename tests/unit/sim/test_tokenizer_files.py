"""The shipped HuggingFace tokenizer files reproduce the sim: token ids of any text, and the chat prompt.

The chat template is rendered the way HF transformers renders one (a sandboxed Jinja environment with
``trim_blocks`` and ``lstrip_blocks``), so a router loading the files gets the engine's very prompt tokens.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment
from smg_sim import tokenizer_files
from smg_sim.openai_api import chat_prompt
from smg_sim.tokenizer_files import TOKENIZER_DIR
from smg_sim.tokens import decode, encode, token_str
from tokenizers import Tokenizer

SETTINGS = settings(max_examples=300, deadline=None, database=None)


@pytest.fixture(scope="module")
def hf() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))


@functools.cache
def _template() -> Template:
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(config["chat_template"])


def render(messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
    return _template().render(messages=messages, add_generation_prompt=add_generation_prompt)


def test_shipped_files_are_what_the_generator_writes() -> None:
    assert tokenizer_files.stale() == []


def test_generator_writes_both_files(tmp_path: Path) -> None:
    written = tokenizer_files.write(tmp_path)
    assert sorted(p.name for p in written) == ["tokenizer.json", "tokenizer_config.json"]
    assert tokenizer_files.stale(tmp_path) == []
    assert tokenizer_files.main(["--check", "--dir", str(tmp_path / "missing")]) == 1


@SETTINGS
@given(text=st.text())
def test_hf_tokenizer_ids_equal_the_sims_tokens(hf: Tokenizer, text: str) -> None:
    ids = hf.encode(text).ids
    assert ids == encode(text)
    assert hf.decode(ids) == decode(ids) == text


@SETTINGS
@given(text=st.text(alphabet=st.characters(codec="ascii")))
def test_hf_tokenizer_keeps_one_token_per_ascii_character(hf: Tokenizer, text: str) -> None:
    encoding = hf.encode(text)
    assert len(encoding.ids) == len(text)
    assert encoding.tokens == [token_str(t) for t in encode(text)]


_content = st.one_of(
    st.none(),
    st.text(),
    st.lists(
        st.one_of(
            st.fixed_dictionaries({"type": st.just("text"), "text": st.text()}),
            st.fixed_dictionaries(
                {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": st.text()})}
            ),
            st.fixed_dictionaries({"type": st.just("text")}),
        ),
        max_size=4,
    ),
)
_message = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool"]) | st.text(), "content": _content}
    ),
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"])}),
)


@SETTINGS
@given(messages=st.lists(_message, min_size=1, max_size=6), add_generation_prompt=st.booleans())
def test_chat_template_renders_the_sims_chat_prompt(
    messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    assert render(messages, add_generation_prompt=add_generation_prompt) == chat_prompt(messages)


def test_chat_template_example(hf: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    prompt = render(messages)
    assert prompt == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert hf.encode(prompt).ids == encode(chat_prompt(messages))
