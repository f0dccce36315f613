"""Saved compact caches as untrusted files: digests, structural checks, clear errors, safe saving.

Each bad file is either a real byte change (refused by the SHA-256 digests written at save) or a
*forged* file whose digests were recomputed after the edit, so that only the structural checks stand
between it and the model. Every refusal is a :class:`CacheFileError` naming the file and what is
wrong. The fuzz test flips random bytes across a saved file: every case is refused or gives the
same logits as the cache that was saved.
"""

from __future__ import annotations

import json
import os
import random
import re
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DynamicCache

from arckv_press import cache as cache_module
from arckv_press.attention import enable_compact_attention
from arckv_press.cache import CacheFileError, CacheMetadata, CompactCache, CompactLayer, check_save_target
from arckv_press.models import config_hash, model_id, weights_fingerprint

README = Path(__file__).resolve().parents[1] / "README.md"
CTX, PREFIX = 30, 3


def build_cache(model, family: str = "llama", seed: int = 5) -> tuple[CompactCache, torch.Tensor]:
    """A compact cache of a random 30-token context with 3 verbatim prefix rows: layer 0 with
    per-head lengths and a random bias, sliding layers (Gemma-3) left ordinary; and a question."""
    g = torch.Generator().manual_seed(seed)
    ctx, q = torch.randint(0, 128, (1, CTX), generator=g), torch.randint(0, 128, (1, 5), generator=g)
    with torch.no_grad():
        dyn = DynamicCache(config=model.config)
        model(ctx, past_key_values=dyn)
    layers = []
    for i, layer in enumerate(dyn.layers):
        if getattr(layer, "is_sliding", False):
            layers.append(layer)
            continue
        K, V = layer.keys[0, :, PREFIX:], layer.values[0, :, PREFIX:]
        H, T, D = K.shape
        keep = torch.tensor([T, T - 4]) if not layers else torch.full((H,), T)
        ck = torch.cat([K[h, : keep[h]] for h in range(H)])
        cv = torch.cat([V[h, : keep[h]] for h in range(H)])
        beta = torch.randn(ck.shape[0], generator=g) if not layers else torch.zeros(ck.shape[0])
        layers.append(CompactLayer(ck, beta, cv, keep, T, i, layer.keys[:, :, :PREFIX].clone(), layer.values[:, :, :PREFIX].clone()))
    cache = CompactCache(layers, CacheMetadata(model_id(model), config_hash(model), "arckv-ha", 0.9, CTX, "0",
                                               extra={"prefix_length": PREFIX}, weights_fingerprint=weights_fingerprint(model)))
    return cache, q


def logits(model, cache, q) -> torch.Tensor:
    from arckv_press.cache import cache_snapshot, restore_cache

    snap = cache_snapshot(cache)
    with torch.no_grad():
        out = model(q, past_key_values=cache).logits
    restore_cache(cache, snap)
    return out


@pytest.fixture
def saved(tiny_model, tmp_path):
    """(model, path of a saved cache, question ids, the saved cache's logits for them)."""
    model = tiny_model("llama", num_layers=2)
    cache, q = build_cache(model)
    path = tmp_path / "doc.arckv"
    cache.save(path)
    enable_compact_attention(model)
    return model, path, q, logits(model, cache, q)


def read_raw(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}


def forge(path: Path, out: Path, *, meta=None, layers=None, tensors=None, header=None, redigest: bool = True) -> Path:
    """Rewrite a saved cache with edits (callables on the parsed metadata dict, layer list, tensor
    dict, raw header dict), recomputing its digests unless ``redigest=False``."""
    head, ts = read_raw(path)
    if meta is not None:
        m = json.loads(head["metadata"])
        meta(m)
        head["metadata"] = json.dumps(m)
    if layers is not None:
        kinds = json.loads(head["layers"])
        layers(kinds)
        head["layers"] = json.dumps(kinds)
    if tensors is not None:
        tensors(ts)
    if header is not None:
        header(head)
    if redigest and all(k in head for k in ("format", "metadata", "layers")):
        head["digests"] = json.dumps(cache_module._digests(ts, head))
    save_file(ts, str(out), metadata=head)
    return out


def data_span(path: Path, name: str) -> tuple[int, int]:
    """Byte range of tensor ``name``'s data in a safetensors file."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    start, end = json.loads(raw[8 : 8 + n])[name]["data_offsets"]
    return 8 + n + start, 8 + n + end


def refused(path: Path, model, match: str, **kwargs) -> CacheFileError:
    with pytest.raises(CacheFileError, match=match) as info:
        CompactCache.load(path, model, **kwargs)
    assert str(path) in str(info.value) and info.value.path == path
    return info.value


# ------------------------------------------------------------------------------------------ digests
TENSORS = ["0.ck", "0.cv", "0.beta", "0.lengths", "0.fixed_k", "0.fixed_v", "1.ck", "1.cv", "1.beta", "1.fixed_v"]


@pytest.mark.parametrize("name", TENSORS)
def test_one_changed_byte_in_any_tensor_is_refused_naming_it(saved, tmp_path, name):
    model, path, _, _ = saved
    start, end = data_span(path, name)
    raw = bytearray(path.read_bytes())
    raw[(start + end) // 2] ^= 0x01  # the lowest bit of one byte: a tiny change of one value
    bad = tmp_path / "bad.arckv"
    bad.write_bytes(bytes(raw))
    refused(bad, model, f"tensor '{re.escape(name)}' .*differs from the digest recorded at save")


def test_lengths_moved_between_heads_is_refused(saved, tmp_path):
    """Swapping two heads' lengths keeps the sum (the shapes still agree); the digest refuses it."""
    model, path, _, _ = saved
    start, end = data_span(path, "0.lengths")
    raw = bytearray(path.read_bytes())
    assert torch.frombuffer(bytearray(raw[start:end]), dtype=torch.int64).tolist() == [27, 23]
    raw[start:end] = torch.tensor([23, 27]).numpy().tobytes()
    bad = tmp_path / "bad.arckv"
    bad.write_bytes(bytes(raw))
    refused(bad, model, r"tensor '0.lengths' \(layer 0's lengths\) differs")


@pytest.mark.parametrize("field", ["metadata", "layers", "format"])
def test_edited_header_field_is_refused_naming_it(saved, tmp_path, field):
    model, path, _, _ = saved
    edits = {"metadata": lambda h: h.__setitem__("metadata", h["metadata"].replace('"ratio": 0.9', '"ratio": 0.5')),
             "layers": lambda h: h.__setitem__("layers", h["layers"].replace('"span": 27', '"span": 26')),
             "format": lambda h: h.__setitem__("format", "02")}
    bad = forge(path, tmp_path / "bad.arckv", header=edits[field], redigest=False)
    assert read_raw(bad)[0][field] != read_raw(path)[0][field]
    refused(bad, model, f"header field '{field}' differs from the digest recorded at save")


def test_dtype_change_with_the_same_bytes_is_refused(saved, tmp_path):
    """The digest covers the dtype: C_v's float32 bytes relabelled int32 are refused."""
    model, path, _, _ = saved
    head, ts = read_raw(path)
    ts["0.cv"] = ts["0.cv"].view(torch.int32)
    save_file(ts, str(tmp_path / "bad.arckv"), metadata=head)
    refused(tmp_path / "bad.arckv", model, r"tensor '0.cv' .*\(bytes, dtype or shape\)")


# ------------------------------------------------------------------------ forged: structural checks
def _set(mapping, key, value):
    mapping[key] = value


def _nan_at(name, value=float("nan")):
    def edit(ts):
        ts[name] = ts[name].clone()
        ts[name].view(-1)[0] = value
    return edit


FORGED = {
    # tensors
    "nan in fixed_v": (dict(tensors=_nan_at("0.fixed_v")), r"layer 0: fixed_v \(verbatim prefix values\) contains NaN"),
    "inf in fixed_k": (dict(tensors=_nan_at("1.fixed_k", float("inf"))), r"layer 1: fixed_k .*contains NaN or inf"),
    "nan in C_k": (dict(tensors=_nan_at("0.ck")), "layer 0, head 0: C_k contains NaN"),
    "nan in beta": (dict(tensors=_nan_at("1.beta")), "layer 1, head 0: beta contains NaN"),
    "lengths sum": (dict(tensors=lambda ts: _set(ts, "0.lengths", torch.tensor([27, 22]))), "packed shapes disagree with lengths"),
    "lengths count": (dict(tensors=lambda ts: _set(ts, "0.lengths", torch.tensor([20, 20, 10]))), "lengths has 3 entries; the model has 2 KV heads"),
    "lengths over span": (dict(tensors=lambda ts: _set(ts, "0.lengths", torch.tensor([28, 22]))), r"head 0: t = 28 entries, must be in \[1, 27\]"),
    "lengths dtype": (dict(tensors=lambda ts: _set(ts, "0.lengths", ts["0.lengths"].int())), "lengths must be torch.int64"),
    "head_dim": (dict(tensors=lambda ts: ts.update({k: ts[k][:, :8].contiguous() for k in ("0.ck", "0.cv")})), "head_dim 16"),
    "fixed rows shape": (dict(tensors=lambda ts: _set(ts, "0.fixed_v", ts["0.fixed_v"][:, :, :2].contiguous())), r"fixed_k / fixed_v must both be \[1, 2, F, 16\]"),
    "extra tensor": (dict(tensors=lambda ts: _set(ts, "5.ck", torch.zeros(2))), r"unexpected \['5.ck'\]"),
    "missing tensor": (dict(tensors=lambda ts: ts.pop("1.fixed_v")), r"missing \['1.fixed_v'\]"),
    # the layer list
    "span": (dict(layers=lambda ls: _set(ls[0], "span", 26)), r"layers\[0\].span is 26; with 3 verbatim prefix rows it must be original_length - 3 = 27"),
    "span type": (dict(layers=lambda ls: _set(ls[1], "span", "27")), r"layers\[1\].span must be an int >= 1"),
    "kind": (dict(layers=lambda ls: _set(ls[0], "kind", "k")), r"layers\[0\]: kind must be one of"),
    "kind list": (dict(layers=lambda ls: _set(ls[0], "kind", ["compact"])), r"layers\[0\]: kind must be one of"),
    "kind dynamic": (dict(layers=lambda ls: ls.__setitem__(0, {"kind": "dynamic"})), "the tensors do not match the layer list"),
    "kind sliding": (dict(layers=lambda ls: ls.__setitem__(0, {"kind": "sliding", "window": 8, "cumulative_length": 30})), r"layers\[0\] is a 'sliding' layer but the model's layer 0 is full_attention"),
    "layer field": (dict(layers=lambda ls: _set(ls[1], "colour", 1)), r"layers\[1\]: a 'compact' layer has the fields"),
    "too short": (dict(layers=lambda ls: ls.pop()), "header field 'layers' lists 1 layers; the model has 2"),
    "not a list": (dict(header=lambda h: _set(h, "layers", '{"kind": "compact"}')), "header field 'layers' must be a JSON list"),
    "layers json": (dict(header=lambda h: _set(h, "layers", h["layers"][:-3])), "header field 'layers' is not valid JSON"),
    # metadata
    "metadata json": (dict(header=lambda h: _set(h, "metadata", h["metadata"][:-1])), "header field 'metadata' is not valid JSON"),
    "metadata nan": (dict(header=lambda h: _set(h, "metadata", h["metadata"].replace('"ratio": 0.9', '"ratio": NaN'))), "header field 'metadata' is not valid JSON"),
    "metadata list": (dict(header=lambda h: _set(h, "metadata", "[1, 2]")), "header field 'metadata' must be a JSON dict"),
    "unknown field": (dict(meta=lambda m: _set(m, "colour", "red")), r"unknown metadata field\(s\) \['colour'\]"),
    "missing field": (dict(meta=lambda m: m.pop("ratio")), r"metadata field\(s\) \['ratio'\] missing"),
    "ratio range": (dict(meta=lambda m: _set(m, "ratio", 2.0)), r"metadata field 'ratio': ratio is the kept fraction and must be in \(0, 1\]"),
    "ratio type": (dict(meta=lambda m: _set(m, "ratio", "0.9")), "metadata field 'ratio': ratio must be a float"),
    "ratio 1 with fewer rows": (dict(meta=lambda m: _set(m, "ratio", 1.0)), r"layer 0: lengths \[27, 23\] at ratio 1.0 must all be the span 27"),
    "method": (dict(meta=lambda m: _set(m, "method", "bogus")), "metadata field 'method' must be one of the compaction methods"),
    "original_length": (dict(meta=lambda m: _set(m, "original_length", 31)), r"layers\[0\].span is 27; .* = 28"),
    "original_length bool": (dict(meta=lambda m: _set(m, "original_length", True)), "metadata field 'original_length' must be an int >= 1"),
    "original_length negative": (dict(meta=lambda m: _set(m, "original_length", -1)), "metadata field 'original_length' must be an int >= 1"),
    "model_id": (dict(meta=lambda m: _set(m, "model_id", 5)), "metadata field 'model_id' must be a non-empty string"),
    "config_hash": (dict(meta=lambda m: _set(m, "config_hash", "abc")), "metadata field 'config_hash' must be 64 lowercase hex digits"),
    "fingerprint": (dict(meta=lambda m: _set(m, "weights_fingerprint", "xyz")), "metadata field 'weights_fingerprint' must be 64 lowercase hex"),
    "prefix_length": (dict(meta=lambda m: m["extra"].update(prefix_length=4)), "layer 0 holds 3 verbatim prefix rows; metadata extra.prefix_length is 4"),
    "extra": (dict(meta=lambda m: _set(m, "extra", [1])), "metadata field 'extra' must be a JSON object or null"),
    # the header
    "unknown header field": (dict(header=lambda h: _set(h, "colour", "red")), r"unknown header field\(s\) \['colour'\] for file format 2"),
    "no digests": (dict(header=lambda h: h.pop("digests"), redigest=False), "header field 'digests' is missing"),
    "digests json": (dict(header=lambda h: _set(h, "digests", "{"), redigest=False), "header field 'digests' is not valid JSON"),
    "no metadata": (dict(header=lambda h: h.pop("metadata"), redigest=False), "not an arckv-press compact cache"),
}


@pytest.mark.parametrize("case", list(FORGED))
def test_forged_file_is_refused_naming_the_field(saved, tmp_path, case):
    """Digests recomputed after the edit: the structural checks alone refuse each case, as one
    CacheFileError naming the file and the field (never a raw TypeError / KeyError / IndexError /
    JSONDecodeError)."""
    model, path, _, _ = saved
    edits, match = FORGED[case]
    refused(forge(path, tmp_path / "bad.arckv", **edits), model, match)


def test_forging_nothing_loads_the_same_logits(saved, tmp_path):
    """The forge helper itself changes nothing: an unedited rewrite loads with the same logits."""
    model, path, q, ref = saved
    copy = forge(path, tmp_path / "copy.arckv")
    assert torch.equal(logits(model, CompactCache.load(copy, model), q), ref)


@pytest.mark.parametrize(
    "version, extra, match",
    [
        ("9", {"colour": "red"}, r"written by a newer version of arckv-press \(file format 9, with field\(s\) "
                                 r"\['colour', 'metadata.shade'\] this version does not know\); this version reads format 2"),
        ("3", {}, r"newer version of arckv-press \(file format 3\); this version reads format 2: upgrade"),
        ("1", {}, r"file format 1 \(before saved caches carried integrity digests\) is no longer read"),
        ("x", {}, "header field 'format' must be a version number, got 'x'"),
        (None, {}, r"header field 'format' \(the file format version\) is missing"),
    ],
)
def test_format_version_is_checked(saved, tmp_path, version, extra, match):
    model, path, _, _ = saved

    def edit(h):
        if version is None:
            h.pop("format")
        else:
            h["format"] = version
        h.update(extra)
        if extra:
            m = json.loads(h["metadata"])
            m["shade"] = "dark"
            h["metadata"] = json.dumps(m)

    refused(forge(path, tmp_path / "bad.arckv", header=edit, redigest=False), model, match)


def test_gemma3_sliding_layers_roundtrip_and_are_checked(tiny_model, tmp_path):
    """Sliding-window layers (kept ordinary, window 8 < context) round-trip; their window, length,
    rows and NaN are checked against the model and the metadata."""
    model = tiny_model("gemma3", num_layers=2, sliding_window=8)
    cache, q = build_cache(model, "gemma3")
    assert [type(layer).__name__ for layer in cache.layers] == ["DynamicSlidingWindowLayer", "CompactLayer"]
    path = tmp_path / "g.arckv"
    cache.save(path)
    enable_compact_attention(model)
    assert torch.equal(logits(model, CompactCache.load(path, model), q), logits(model, cache, q))
    cases = {
        r"layers\[0\].window is 9; the model's sliding window is 8": dict(layers=lambda ls: _set(ls[0], "window", 9)),
        r"layers\[0\].cumulative_length is 29; original_length is 30": dict(layers=lambda ls: _set(ls[0], "cumulative_length", 29)),
        r"layer 0: keys / values must both be \[1, 2, 7, 16\]": dict(tensors=lambda ts: _set(ts, "0.k", ts["0.k"][:, :, 1:].contiguous())),
        "layer 0: values contains NaN or inf": dict(tensors=_nan_at("0.v")),
        r"layers\[1\] is a 'sliding' layer but the model's layer 1 is full_attention":
            dict(layers=lambda ls: ls.__setitem__(1, {"kind": "sliding", "window": 8, "cumulative_length": 30})),
    }
    for match, edits in cases.items():
        refused(forge(path, tmp_path / "bad.arckv", **edits), model, match)


@pytest.mark.parametrize("what", ["folder", "fifo", "empty", "garbage", "truncated", "huge header"])
def test_not_a_cache_file_is_refused(saved, tmp_path, what):
    model, path, _, _ = saved
    bad = tmp_path / "bad.arckv"
    raw = path.read_bytes()
    if what == "folder":
        bad.mkdir()
    elif what == "fifo":
        os.mkfifo(bad)  # opening it would block forever: it must be refused before
    else:
        bad.write_bytes({"empty": b"", "garbage": b"not a cache at all, just text\n" * 10, "truncated": raw[: len(raw) // 2],
                         "huge header": (2**40).to_bytes(8, "little") + raw[8:]}[what])
    refused(bad, model, "not a regular file" if what in ("folder", "fifo") else "not a readable safetensors file")
    with pytest.raises(FileNotFoundError, match="no compact cache at"):
        CompactCache.load(tmp_path / "missing.arckv", model)


# ------------------------------------------------------------------------------ use after loading
def test_load_leaves_a_fresh_model_able_to_use_the_cache(saved, tiny_model):
    """A model never switched to the compact attention (a fresh process) can use the loaded cache."""
    _, path, q, ref = saved
    fresh = tiny_model("llama", num_layers=2)
    assert not fresh.config._attn_implementation.startswith("arckv")
    loaded = CompactCache.load(path, fresh)
    assert fresh.config._attn_implementation.startswith("arckv")
    assert torch.equal(logits(fresh, loaded, q), ref)


def test_refused_load_leaves_the_model_as_it_was(saved, tmp_path, tiny_model):
    _, path, _, _ = saved
    fresh = tiny_model("llama", num_layers=2)
    refused(forge(path, tmp_path / "bad.arckv", tensors=_nan_at("0.fixed_v")), fresh, "fixed_v")
    assert fresh.config._attn_implementation == "sdpa"


# ----------------------------------------------------------------------------------------- saving
def test_save_refuses_a_symlink_and_leaves_it_and_its_target(saved, tmp_path):
    model, path, _, _ = saved
    cache = CompactCache.load(path, model)
    target = tmp_path / "elsewhere.txt"
    target.write_text("keep me")
    link = tmp_path / "link.arckv"
    link.symlink_to(target)
    with pytest.raises(CacheFileError, match="cannot save over a symbolic link"):
        cache.save(link)
    assert link.is_symlink() and target.read_text() == "keep me"
    dangling = tmp_path / "dangling.arckv"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(CacheFileError, match="symbolic link"):
        cache.save(dangling)
    assert dangling.is_symlink() and not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("what", ["fifo", "device", "folder", "missing folder"])
def test_save_refuses_non_regular_targets(saved, tmp_path, what):
    model, path, _, _ = saved
    cache = CompactCache.load(path, model)
    target = tmp_path / "t.arckv"
    if what == "fifo":
        os.mkfifo(target)
    elif what == "device":
        try:
            os.mknod(target, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # a null device node, inside tmp_path
        except (PermissionError, OSError):
            pytest.skip("cannot create a device node here")
    elif what == "folder":
        target.mkdir()
    else:
        target = tmp_path / "no" / "t.arckv"
    match = {"fifo": "cannot save over a FIFO", "device": "cannot save over a device node", "folder": "cannot save over a folder",
             "missing folder": "does not exist or is not a folder"}[what]
    with pytest.raises(CacheFileError, match=match):
        cache.save(target)
    with pytest.raises(CacheFileError, match=match):
        check_save_target(target)  # the same check, cheap, before any compaction
    if what != "missing folder":
        st = os.lstat(target)
        assert not stat.S_ISREG(st.st_mode)  # left as it was
    assert not [p for p in tmp_path.iterdir() if ".tmp." in p.name]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_save_removes_stale_partials_of_that_target_only(saved, tmp_path):
    model, path, _, _ = saved
    cache = CompactCache.load(path, model)
    target = tmp_path / "t.arckv"
    dead, alive = _dead_pid(), subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = tmp_path / f".t.arckv.tmp.{dead}.0123abcd"
        running = tmp_path / f".t.arckv.tmp.{alive.pid}.0123abcd"  # a save still in progress elsewhere
        other = tmp_path / f".other.arckv.tmp.{dead}.0123abcd"  # another target's partial
        unrelated = tmp_path / ".t.arckv.tmp.notapid"
        for p in (stale, running, other, unrelated):
            p.write_bytes(b"partial")
        cache.save(target)
        assert not stale.exists() and running.exists() and other.exists() and unrelated.exists()
        assert torch.equal(CompactCache.load(target, model).layers[0].lengths, cache.layers[0].lengths)
    finally:
        alive.kill()
        alive.wait()


def test_interrupted_save_keeps_the_old_file_and_leaves_no_partial(saved, tmp_path, monkeypatch):
    """A save interrupted before the rename (here: KeyboardInterrupt raised by the rename) leaves the
    previous file intact and removes its partial."""
    model, path, _, _ = saved
    cache = CompactCache.load(path, model)
    before = path.read_bytes()
    cache.metadata.method = "arckv-vi"

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(cache_module.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir() if ".tmp." in p.name] == []


def test_save_respects_the_umask_and_keeps_a_replaced_files_mode(saved, tmp_path):
    model, path, _, _ = saved
    cache = CompactCache.load(path, model)
    old = os.umask(0o027)
    try:
        cache.save(tmp_path / "a.arckv")
        os.umask(0o002)
        cache.save(tmp_path / "b.arckv")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "a.arckv").st_mode) == 0o640
    assert stat.S_IMODE(os.stat(tmp_path / "b.arckv").st_mode) == 0o664
    os.chmod(tmp_path / "a.arckv", 0o600)
    cache.save(tmp_path / "a.arckv")  # replacing a private file keeps it private
    assert stat.S_IMODE(os.stat(tmp_path / "a.arckv").st_mode) == 0o600


def test_save_checks_its_own_metadata(saved):
    model, path, _, _ = saved
    cache = CompactCache.load(path, model)
    cache.metadata.ratio = float("nan")
    with pytest.raises(CacheFileError, match="metadata field 'ratio'"):
        cache.save(path.with_name("nan.arckv"))
    cache.metadata.ratio = 0.9
    cache.metadata.extra = {"prefix_length": PREFIX, "seconds": float("inf")}
    with pytest.raises(CacheFileError, match="cannot save: the metadata is not JSON"):
        cache.save(path.with_name("nan.arckv"))
    assert not path.with_name("nan.arckv").exists()


# --------------------------------------------------------------------------------------------- fuzz
def test_fuzz_flipped_bytes_are_refused_or_change_nothing(saved, tmp_path):
    """400 cases (fixed seed), one to three bytes XOR-ed with random values, half of them in the
    header (8-byte length + JSON) and half anywhere in the file: each case is refused with
    CacheFileError or loads with bitwise the same logits. Nothing else is raised."""
    model, path, q, ref = saved
    raw = path.read_bytes()
    header_end = 8 + int.from_bytes(raw[:8], "little")
    rng = random.Random(62)
    outcomes = {"refused": 0, "same": 0}
    bad = tmp_path / "fuzz.arckv"
    for case in range(400):
        data = bytearray(raw)
        hi = header_end if case % 2 == 0 else len(raw)
        where = [rng.randrange(hi) for _ in range(rng.randint(1, 3))]
        for i in where:
            data[i] ^= rng.randint(1, 255)
        bad.write_bytes(bytes(data))
        try:
            loaded = CompactCache.load(bad, model)
        except CacheFileError:
            outcomes["refused"] += 1
            continue
        assert max(where) < header_end, f"case {case}: a changed tensor byte ({where}) loaded"
        got = logits(model, loaded, q)
        assert torch.equal(got, ref), f"case {case}: a changed file loaded with other logits"
        outcomes["same"] += 1
    assert outcomes["refused"] > 0 and sum(outcomes.values()) == 400, outcomes


# ---------------------------------------------------------------------------- the README's snippet
@pytest.mark.model
def test_readme_snippet_roundtrips_across_processes(tmp_path):
    """The README's Python usage block, run as it stands in one process, saves doc.arckv; a fresh
    process runs the README's reuse call (``CompactCache.load(path, model)``) and ``answer`` on the
    same question: the answer is the same."""
    text = README.read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "cache.save(" in b)
    question = re.search(r'answer\(model, tok, cache, ("[^"]*")\)', block).group(1)
    reuse = re.search(r"# reuse across processes: (CompactCache\.load\(path, model\))", block).group(1)
    (tmp_path / "doc.txt").write_text(
        "The museum of Arden keeps three hundred clocks. Its oldest clock was built in 1642 by Mara Vell, "
        "who also designed the town's bridge. " * 6 + "The secret code of the archive is 4521. "
        + "Visitors may climb the tower on Sundays. " * 6, encoding="utf-8")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    first = block + f"\nimport json\nprint('JSON' + json.dumps(answer(model, tok, cache, {question})))\n"
    second = textwrap.dedent(f"""
        import json
        from arckv_press import CompactCache, load_model
        from arckv_press.generation import answer
        model, tok = load_model()
        path = "doc.arckv"
        cache = {reuse}
        print('JSON' + json.dumps(answer(model, tok, cache, {question})))
    """)
    answers = []
    for script in (first, second):
        out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        answers.append(json.loads(next(line for line in out.stdout.splitlines() if line.startswith("JSON"))[4:]))
    assert (tmp_path / "doc.arckv").is_file()
    assert answers[0] and answers[1] == answers[0]
