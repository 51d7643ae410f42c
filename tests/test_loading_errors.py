"""Every bad input to loading (and to generation limits) is a QuickdraftError that says what to do.

Each case asserts the exception type (never a bare ValueError/KeyError/IndexError from a parser)
and some words of the message, so a refactor that loses the helpful part of a message fails too.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from helpers import assert_words, cli_error
from safetensors.torch import load_file, save_file
from tiny import gguf_tokenizer_metadata, make_tiny_hf_model, write_tokenizer

from quickdraft import zoo
from quickdraft.api import LLM
from quickdraft.errors import QuickdraftError
from quickdraft.loading.load import load_model
from quickdraft.sampling import SamplingParams


def error_of(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """The message of the QuickdraftError ``fn`` raises (any other exception fails the test)."""
    with pytest.raises(QuickdraftError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert message and "Traceback" not in message
    return message


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model(tmp_path_factory.mktemp("errors"), "llama")


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------------ paths and names


@pytest.mark.parametrize(
    "spec",
    [
        "/nonexistent/dir/model.gguf",
        "./missing-model-folder",
        "/tmp/quickdraft-missing/a/b",
        "missing.gguf",
    ],
)
def test_nonexistent_path(spec: str) -> None:
    msg = error_of(load_model, spec)
    assert_words(msg, "no such file", spec)


def test_unknown_model_name_lists_the_zoo() -> None:
    msg = error_of(load_model, "definitely-not-a-model")
    assert_words(msg, "unknown model", "definitely-not-a-model", *zoo.names())


def test_invalid_dtype(tiny_folder: Path) -> None:
    msg = error_of(load_model, str(tiny_folder), dtype="float64")
    assert_words(msg, "dtype", "float64", "bfloat16", "float32")
    assert_words(error_of(LLM, str(tiny_folder), dtype="int8"), "dtype", "int8")


@pytest.mark.parametrize(
    ("max_context", "words"), [(8, ["at least 16"]), (100_000, ["100000", "exceeds", "512"])]
)
def test_invalid_max_context(tiny_folder: Path, max_context: int, words: list[str]) -> None:
    msg = error_of(load_model, str(tiny_folder), dtype="float32", max_context=max_context)
    assert_words(msg, "max-context", *words)


# ------------------------------------------------------------------------------------ GGUF files


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file, not a model" * 10)
    assert_words(error_of(load_model, str(path)), "not a GGUF file", "magic")


def test_empty_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    assert_words(error_of(load_model, str(path)), "not a GGUF file")


def _truncated_copy(src: Path, dst: Path, size: int) -> Path:
    with src.open("rb") as f:
        dst.write_bytes(f.read(size))
    return dst


@pytest.mark.slow
def test_truncated_gguf_in_the_metadata(smollm2_gguf: Path, tmp_path: Path) -> None:
    path = _truncated_copy(smollm2_gguf, tmp_path / "cut.gguf", 1 << 20)  # inside the vocabulary
    assert_words(error_of(load_model, str(path)), "damaged or truncated", "fetch it again")


@pytest.mark.slow
def test_truncated_gguf_in_the_tensor_data(smollm2_gguf: Path, tmp_path: Path) -> None:
    size = smollm2_gguf.stat().st_size
    path = _truncated_copy(smollm2_gguf, tmp_path / "cut.gguf", size // 2)
    assert_words(error_of(load_model, str(path)), "damaged or truncated", "fetch it again")


def write_gguf(
    path: Path, arch: str, *, tokenizer: bool = True, tensors: dict[str, np.ndarray] | None = None
) -> Path:
    """A small but valid GGUF file: llama-style hyperparameters under ``arch``."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    if tokenizer:
        gguf_tokenizer_metadata(w)
    for name, array in (tensors or {"token_embd.weight": np.zeros((300, 64), np.float32)}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2")
    assert_words(
        error_of(load_model, str(path)), "architecture", "gpt2", "not supported", "llama", "qwen2"
    )


def test_gguf_without_tokenizer(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "notok.gguf", "llama", tokenizer=False)
    assert_words(error_of(load_model, str(path)), "no tokenizer")


def test_gguf_missing_tensors(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "partial.gguf", "llama")  # token_embd only
    msg = error_of(load_model, str(path), dtype="float32")
    assert_words(msg, "lacks", "tensor", "model.layers.0")


def test_gguf_unknown_tensor(tmp_path: Path) -> None:
    tensors = {
        "token_embd.weight": np.zeros((300, 64), np.float32),
        "blk.0.attn_qkv.weight": np.zeros((192, 64), np.float32),  # fused qkv: another variant
    }
    path = write_gguf(tmp_path / "fused.gguf", "llama", tensors=tensors)
    assert_words(
        error_of(load_model, str(path), dtype="float32"), "blk.0.attn_qkv.weight", "not supported"
    )


# ---------------------------------------------------------------------------- Hugging Face folders


def test_folder_without_config(tmp_path: Path) -> None:
    folder = write_tokenizer(tmp_path / "noconfig")
    assert_words(error_of(load_model, str(folder)), "no config.json")


def test_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert_words(error_of(load_model, str(tmp_path / "empty")), "config.json")


def test_config_not_json(tiny_folder: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_folder, tmp_path / "badjson")
    (folder / "config.json").write_text('{"model_type": "llama", ')
    assert_words(error_of(load_model, str(folder)), "config.json", "not valid JSON")


def test_config_missing_field(tiny_folder: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_folder, tmp_path / "nofield")
    config = json.loads((folder / "config.json").read_text())
    del config["num_hidden_layers"]
    (folder / "config.json").write_text(json.dumps(config))
    assert_words(error_of(load_model, str(folder)), "num_hidden_layers", "incomplete")


def test_unsupported_hf_architecture(tmp_path: Path) -> None:
    folder = write_tokenizer(tmp_path / "bert")
    config = {
        "model_type": "bert",
        "architectures": ["BertForMaskedLM"],
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_file(
        {"embeddings.word_embeddings.weight": torch.zeros(300, 64)},
        str(folder / "model.safetensors"),
    )
    assert_words(
        error_of(load_model, str(folder)), "architecture", "bert", "not supported", "llama"
    )


def test_unsupported_nested_architecture_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A multimodal checkpoint of a family quickdraft does not run (its fields in text_config)
    is refused by name, with the supported list, exit 2; not as a config missing a field."""
    folder = write_tokenizer(tmp_path / "gemma3n")
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3n", "text_config": {"hidden_size": 64}}))
    save_file({"x": torch.zeros(1)}, str(folder / "model.safetensors"))
    err = cli_error(["generate", "--raw", "-q", "--model", str(folder), "hi"], capsys)
    assert_words(err, "architecture", "gemma3n", "not supported", "qwen3_5", "gpt_oss")


def test_folder_without_tokenizer(tiny_folder: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_folder, tmp_path / "notok")
    (folder / "tokenizer.json").unlink()
    assert_words(error_of(load_model, str(folder)), "tokenizer.json")


def test_folder_without_weights(tiny_folder: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_folder, tmp_path / "noweights")
    (folder / "model.safetensors").unlink()
    assert_words(error_of(load_model, str(folder)), "safetensors")


def _rewrite_weights(folder: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_safetensors_missing_tensor(tiny_folder: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_folder, tmp_path / "missing")
    _rewrite_weights(folder, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    msg = error_of(load_model, str(folder), dtype="float32")
    assert_words(msg, "lacks 1 tensor(s)", "model.layers.1.mlp.down_proj.weight")


def test_safetensors_wrong_shape(tiny_folder: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_folder, tmp_path / "shape")
    name = "model.layers.0.self_attn.k_proj.weight"

    def transpose(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name].t().contiguous()

    _rewrite_weights(folder, transpose)
    msg = error_of(load_model, str(folder), dtype="float32")
    assert_words(msg, name, "shape", "(64, 32)", "(32, 64)")


def test_safetensors_unexpected_tensor(tiny_folder: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_folder, tmp_path / "extra")
    _rewrite_weights(
        folder, lambda t: t.update({"model.layers.7.mlp.gate_proj.weight": torch.zeros(2, 2)})
    )
    msg = error_of(load_model, str(folder), dtype="float32")
    assert_words(msg, "model.layers.7.mlp.gate_proj.weight", "config")


@pytest.mark.parametrize("keep", [0, 100, -1000])
def test_safetensors_damaged(tiny_folder: Path, tmp_path: Path, keep: int) -> None:
    folder = copy_folder(tiny_folder, tmp_path / f"damaged{keep}")
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    assert_words(error_of(load_model, str(folder), dtype="float32"), "safetensors")


# -------------------------------------------------------------------------------------- context


def test_prompt_longer_than_context(tiny_folder: Path) -> None:
    llm = LLM(
        str(tiny_folder),
        dtype="float32",
        max_context=32,
        draft="none",
        threads=torch.get_num_threads(),
    )
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 20
    assert len(llm.encode(long_prompt)) > 32
    msg = error_of(llm.generate, long_prompt)
    assert_words(msg, "context", "32", "shorten the prompt")


def test_small_context_with_the_auto_drafter(tiny_folder: Path) -> None:
    """A legal --max-context (>= 16) must not break building the default (auto) drafter."""
    llm = LLM(str(tiny_folder), dtype="float32", max_context=32, threads=torch.get_num_threads())
    [out] = llm.generate("def f", SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4


# ------------------------------------------------------------------------------------------ CLI


def test_cli_nonexistent_model(capsys: pytest.CaptureFixture[str]) -> None:
    err = cli_error(["generate", "--raw", "-q", "--model", "/nonexistent/m.gguf", "hello"], capsys)
    assert_words(err, "no such file", "/nonexistent/m.gguf")


def test_cli_unknown_model_name(capsys: pytest.CaptureFixture[str]) -> None:
    err = cli_error(["generate", "--raw", "-q", "--model", "no-such-zoo-model", "hi"], capsys)
    assert_words(err, "unknown model", zoo.names()[0])


def test_cli_not_a_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "fake.gguf"
    path.write_text("hello, I am text")
    err = cli_error(["generate", "--raw", "-q", "--model", str(path), "hi"], capsys)
    assert_words(err, "not a GGUF file")


def test_cli_prompt_longer_than_context(
    tiny_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    threads = str(torch.get_num_threads())
    argv = ["generate", "--raw", "-q", "--model", str(tiny_folder), "--dtype", "float32",
            "--max-context", "32", "--draft", "none", "--threads", threads, "word " * 80]  # fmt: skip
    err = cli_error(argv, capsys)
    assert_words(err, "context")


def test_cli_bad_draft_confidence_is_refused_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    err = cli_error(["generate", "--raw", "-q", "--model", "/nonexistent/m.gguf", "--draft-confidence", "-0.5", "hi"], capsys)
    assert_words(err, "--draft-confidence", "below 1")
