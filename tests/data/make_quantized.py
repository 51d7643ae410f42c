"""Writes the tiny GGUFs in this folder: one random qwen2-shaped model (hidden 256, so K-quant
blocks fit), quantized by llama.cpp's own ``llama-quantize --pure`` to each type the kernels read
that only llama.cpp can write (the ``gguf`` package quantizes Q5_1, Q8_0, BF16 ... in the tests
themselves). Rerun after changing the model:

    ../shared/tools/build_llamacpp.sh        # llama-quantize, once (~25 min)
    .venv/bin/python tests/data/make_quantized.py ~/.cache/quickdraft/llamacpp-native/bin
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

from tiny import hf_to_gguf, make_tiny_hf_model  # noqa: E402

# type -> file; every tensor (embedding and output included) in that type
TYPES = ("Q2_K", "Q3_K", "Q5_K", "IQ4_XS", "IQ4_NL")
SHAPE = {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}


def main(bin_dir: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_hf_model(Path(tmp), "qwen2", seed=3, name="tiny-qwen2-256", **SHAPE)
        f32 = hf_to_gguf(folder, Path(tmp) / "f32.gguf")
        env = dict(os.environ, LD_LIBRARY_PATH=bin_dir)
        for qtype in TYPES:
            out = HERE / f"tiny-qwen2-256-{qtype}.gguf"
            subprocess.run([f"{bin_dir}/llama-quantize", "--pure", str(f32), str(out), qtype, "1"],
                           check=True, env=env, capture_output=True)
            print(out, out.stat().st_size)


if __name__ == "__main__":
    main(sys.argv[1])
