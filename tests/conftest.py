"""Shared pytest fixtures for arckv-press.

- ``default_model`` / ``default_model_fp32`` (session): ``(model, tokenizer)`` of the embedded
  SmolLM2-135M-Instruct in bfloat16 / float32, from ``arckv_press.models.load_model``. The first
  run converts the GGUF file into the cache (``$ARCKV_CACHE_DIR`` or ``~/.cache/arckv-press``,
  about 30 s); later runs load the cached folder (about 1 s).
- ``tiny_model``: factory ``tiny_model(family, num_layers=2, seed=0, **config_overrides)`` that
  builds a tiny random-weight decoder in float32 with GQA (4 query heads, 2 KV heads,
  head_dim 16, hidden 64, vocab 128) and ``attn_implementation="sdpa"``, in eval mode.
  Families: ``TINY_FAMILIES``.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before anything imports huggingface_hub

from typing import Any, Callable  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

TINY_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")

TINY_VOCAB = 128
TINY_HIDDEN = 64
TINY_Q_HEADS = 4
TINY_KV_HEADS = 2
TINY_HEAD_DIM = 16


def tiny_config(family: str, num_layers: int = 2, **overrides: Any) -> Any:
    """Config of a tiny GQA decoder of the given family (see module docstring).

    Gemma3 alternates ``sliding_attention`` (even layers) and ``full_attention`` (odd layers) with
    the library's default ``sliding_window`` (4096: no effect on short sequences; override
    ``sliding_window=`` to make it bite) and ``query_pre_attn_scalar = head_dim``.
    Mistral gets ``sliding_window=None`` (as Mistral-7B-v0.3: full attention everywhere; pass
    ``sliding_window=4096`` for the v0.1 layout where every layer slides).
    """
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if not 1 <= num_layers <= 8:
        raise ValueError(f"num_layers must be in [1, 8] for a tiny model, got {num_layers}")
    common: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=TINY_HIDDEN,
        intermediate_size=2 * TINY_HIDDEN,
        num_hidden_layers=num_layers,
        num_attention_heads=TINY_Q_HEADS,
        num_key_value_heads=TINY_KV_HEADS,
        head_dim=TINY_HEAD_DIM,
        max_position_embeddings=1024,
    )
    if family == "llama":
        cfg_cls = LlamaConfig
    elif family == "qwen2":
        cfg_cls = Qwen2Config
    elif family == "qwen3":
        cfg_cls = Qwen3Config
    elif family == "mistral":
        cfg_cls = MistralConfig
        common["sliding_window"] = None
    elif family == "gemma3":
        cfg_cls = Gemma3TextConfig
        common["query_pre_attn_scalar"] = TINY_HEAD_DIM
        common["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        ]
    else:
        raise ValueError(f"unknown tiny model family {family!r}; expected one of {TINY_FAMILIES}")
    common.update(overrides)
    return cfg_cls(**common)


def build_tiny_model(family: str, num_layers: int = 2, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """Tiny random-weight causal LM (float32, sdpa, eval mode), deterministic in ``seed``.

    The global torch RNG state is left untouched.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, num_layers=num_layers, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model.eval()


@pytest.fixture
def tiny_model() -> Callable[..., torch.nn.Module]:
    """Factory: ``tiny_model("qwen3", num_layers=2, seed=0, **config_overrides)``."""
    return build_tiny_model


@pytest.fixture(scope="session")
def default_model() -> tuple[torch.nn.Module, Any]:
    """``(model, tokenizer)`` of the default SmolLM2-135M-Instruct in bfloat16 (session-wide)."""
    from arckv_press.models import load_model

    return load_model(dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def default_model_fp32() -> tuple[torch.nn.Module, Any]:
    """``(model, tokenizer)`` of the default SmolLM2-135M-Instruct in float32 (session-wide)."""
    from arckv_press.models import load_model

    return load_model(dtype=torch.float32)


TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tiny_tokenizer(chat_template: bool = True) -> Any:
    """Deterministic character-level tokenizer for the tiny models (102 ids < ``TINY_VOCAB``).

    Ids 0-5 are ``<unk> <bos> <eos> <|user|> <|assistant|> <|end|>`` (special tokens); then
    ``"\\n"`` and printable ASCII 32..126, one id per character (a BPE model without merges).
    With ``chat_template`` the template is ``<bos><|user|>\\n{content}<|end|>\\n<|assistant|>\\n``.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<bos>", "<eos>", "<|user|>", "<|assistant|>", "<|end|>"]
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    assert len(vocab) <= TINY_VOCAB
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(specials)
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        chat_template=TINY_CHAT_TEMPLATE if chat_template else None,
    )


@pytest.fixture
def tiny_tokenizer() -> Callable[..., Any]:
    """Factory: ``tiny_tokenizer(chat_template=True)`` -> a fresh character-level tokenizer."""
    return build_tiny_tokenizer


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module of tiny-tensor tests: with 2 threads on a loaded 2-core
    machine torch spins and runs them up to ~100x slower. Restored after the module."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def forward_queries(model, cache, input_ids) -> list:
    """Per layer, the post-RoPE queries ``[Hq, L, D]`` of the ``L`` tokens ``input_ids`` fed after
    ``cache`` (a tiny Llama), computed independently of the package's capture hooks: the model's
    hidden states, ``input_layernorm``, ``q_proj`` and the rotary module (rotate-half) at the
    positions after the cache. ``cache`` is updated by the forward."""
    import torch

    L, past = input_ids.shape[1], cache.get_seq_length()
    with torch.no_grad():
        out = model.model(input_ids=input_ids, past_key_values=cache, output_hidden_states=True)
        positions = torch.arange(past, past + L)[None]
        qs = []
        for i, layer in enumerate(model.model.layers):
            h = layer.input_layernorm(out.hidden_states[i])
            q = layer.self_attn.q_proj(h).view(1, L, -1, layer.self_attn.head_dim).transpose(1, 2)
            cos, sin = model.model.rotary_emb(h, positions)
            rot = torch.cat([-q[..., q.shape[-1] // 2:], q[..., : q.shape[-1] // 2]], -1)
            qs.append((q * cos[:, None] + rot * sin[:, None])[0])
    return qs


def make_text(n_chars: int, seed: int = 0) -> str:
    """Deterministic word soup of ``n_chars`` characters (within the tiny tokenizers' alphabet)."""
    rng = random.Random(seed)
    words = ["alpha", "river", "stone", "ember", "quiet", "lunar", "maple", "cobalt", "drift", "wren"]
    text = ""
    while len(text) < n_chars:
        text += rng.choice(words) + rng.choice([" ", " ", ", ", ". "])
    return text[:n_chars]


def load_script(name: str):
    """The module behind ``scripts/<name>.py``: :mod:`arckv_press.bench.<name>` (each script is a
    thin entry point to it)."""
    import importlib

    return importlib.import_module(f"arckv_press.bench.{name}")


def assert_ratio_of_rounded(printed: float, num: float, den: float, csv_decimals: int, print_decimals: int = 2,
                            den_terms: int = 1, num_terms: int = 1):
    """A script printed ``printed`` = num/den rounded to ``print_decimals``, and wrote ``num`` and ``den``
    rounded to ``csv_decimals``. On tiny models the times are milliseconds, so the quotient of the rounded
    values can differ from the printed ratio by far more than a relative tolerance: check the printed ratio
    lies in the interval the rounded values allow instead. ``den_terms`` / ``num_terms``: how many rounded
    values ``den`` / ``num`` sum (or subtract)."""
    e, p = 0.5 * 10.0**-csv_decimals, 0.5 * 10.0**-print_decimals
    d, n = den_terms * e, num_terms * e
    low = (num - n) / (den + d)
    high = (num + n) / (den - d) if den > d else float("inf")
    assert low - p <= printed <= high + p, (printed, num, den)


def short_quality_file(path: Path) -> Path:
    """Two L-Eval QuALITY articles cut to ~400 characters: 2 questions of the first, 1 of the second."""
    source = Path(__file__).resolve().parents[2] / "shared" / "data" / "quality" / "leval_quality.jsonl"
    if not source.is_file():
        pytest.skip(f"no local QuALITY file at {source}")
    records = [json.loads(line) for line in source.read_text(encoding="utf-8").splitlines() if line.strip()][:2]
    for record, n_questions in zip(records, (2, 1)):
        text = record["input"].strip()
        record["input"] = text[: text.rfind(" ", 0, 400)]
        record["instructions"] = record["instructions"][:n_questions]
        record["outputs"] = record["outputs"][:n_questions]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path
