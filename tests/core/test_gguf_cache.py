"""The disk cache of GGUF-derived tokenizers and configs gives back the same objects."""

from __future__ import annotations

from pathlib import Path

import pytest

from sgl.model_loader import bundled_model_path, load_hf_config, load_tokenizer
from sgl.model_loader.gguf_cache import cache_root

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n", "héllo 日本語 🚀", "<|im_start|>user"]


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SGL_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_cached_tokenizer_and_config_equal_fresh_ones(cache_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    built = load_tokenizer(None)
    entries = list((cache_dir / "gguf").iterdir())
    assert len(entries) == 1  # the tokenizer was saved
    cached = load_tokenizer(None)
    for text in TEXTS:
        ids = built.encode(text, add_special_tokens=False)
        assert cached.encode(text, add_special_tokens=False) == ids
        assert cached.decode(ids) == built.decode(ids)
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert cached.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        built.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert (cached.eos_token_id, cached.bos_token_id) == (built.eos_token_id, built.bos_token_id)

    monkeypatch.setenv("SGL_CACHE_DIR", "off")
    assert cache_root() is None
    fresh_config = load_hf_config(None)
    monkeypatch.setenv("SGL_CACHE_DIR", str(cache_dir))
    load_hf_config(None)
    cached_config = load_hf_config(None)
    def comparable(config) -> dict:
        return {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}

    assert comparable(cached_config) == comparable(fresh_config)
    assert cached_config.architectures == ["LlamaForCausalLM"]


def test_damaged_entry_is_rebuilt(cache_dir: Path) -> None:
    load_hf_config(None)
    (entry,) = (cache_dir / "gguf").iterdir()
    (entry / "config.json").write_text("{ not json")
    assert load_hf_config(None).architectures == ["LlamaForCausalLM"]
    assert bundled_model_path().exists()
