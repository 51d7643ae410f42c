"""GGUF layouts as llama.cpp's converter writes them where tests/tiny.py's writers differ: a
Qwen3.5-MoE file (``qwen35moe``, e.g. Qwen3.5/3.6-35B-A3B) has no ``feed_forward_length`` key
(every layer is routed; the converter's config has no dense width) and keeps the shared expert's
gate as an [H] vector (llama.cpp's ``ffn_gate_inp_shexp`` {n_embd}); such a file loads to the
transformers model's logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import load_reference, make_tiny_hf_model, qwen3_5_to_gguf, reference_logits

from quickdraft.loading.load import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "for i in range(10):\n    print(i, i * i)\nclass Stack:\n    def push(self, x):\n        self.items.append(x)\n"


def relayout(src: Path, dst: Path, drop_keys: tuple[str, ...], vectors: str) -> Path:
    """``src`` rewritten without the keys ``drop_keys``, tensors whose names end with ``vectors``
    flattened to one dimension (the float tensors of the tiny files only)."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop_keys:
            continue
        vtype = field.types[0]
        w.add_key_value(name, field.contents(), vtype,
                        sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        a = np.array(t.data)
        w.add_tensor(t.name, a.reshape(-1) if t.name.endswith(vectors) else a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_qwen35moe_without_dense_width_and_with_vector_shared_gate(tmp_path: Path) -> None:
    import gguf

    folder = make_tiny_hf_model(tmp_path, "qwen3_5_moe_text", seed=4)
    path = relayout(qwen3_5_to_gguf(folder, tmp_path / "tiny.gguf"), tmp_path / "llamacpp.gguf",
                    ("qwen35moe.feed_forward_length",), "ffn_gate_inp_shexp.weight")
    reader = gguf.GGUFReader(str(path))
    assert "qwen35moe.feed_forward_length" not in reader.fields
    assert [len(t.shape) for t in reader.tensors if t.name.endswith("ffn_gate_inp_shexp.weight")] == [1] * 3
    loaded = load_model(str(path), dtype="float32", max_context=256)
    cfg = loaded.config
    assert cfg.model_type == "qwen3_5_moe" and cfg.intermediate_size == cfg.shared_expert_intermediate_size
    ids = loaded.tokenizer.encode(TEXT)[:40]
    out, _ = loaded.model(torch.tensor(ids), loaded.model.new_cache())
    assert (out - reference_logits(load_reference(folder), ids)).abs().max() < 1e-4
