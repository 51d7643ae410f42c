"""Writes ``gemma4-vocab.gguf`` (a small Gemma-4-style vocabulary: spaces spelled "▁", BPE merges
over raw UTF-8 learned on runs split at newlines, ``<0x..>`` byte tokens; GGUF tokenizer model
"gemma4", as llama.cpp's converter writes Gemma 4) and ``gemma4-vocab-llamacpp.json``: texts and
the token ids llama.cpp's own tokenizer gives them (llama-cpp-python over the libllama that
``../shared/tools/build_llamacpp.sh`` builds). tests/test_gemma4.py checks quickdraft's GGUF
tokenizer against those ids. Rerun after changing the texts or the vocabulary:

    ../shared/tools/build_llamacpp.sh        # once (~25 min)
    .venv/bin/python tests/data/make_gemma4_vocab.py ~/.cache/quickdraft/llamacpp-native/bin ~/.cache/quickdraft/llamacpp-venv/bin/python
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n", "hello world", " leading", "double  space",
    "\n\n\nnewlines\n", "naïve café", "日本語 text", "emoji 🙂 ok", "tab\tchar", "x", "", "  ",
    "return fibonacci(n - 1) + fibonacci(n - 2)\n\n", "class Stack:\n    def push(self, x):\n        self.items.append(x)\n",
]
LLAMA_CPP = """
import json, sys, llama_cpp
m = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
print(json.dumps([m.tokenize(t.encode(), add_bos=False, special=False) for t in json.loads(sys.argv[2])]))
"""


def write_vocab(path: Path) -> None:
    import gguf
    from tiny import _CORPUS
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    corpus = [*_CORPUS, "naïve café — 日本語 text\n\n\nwith  double  spaces and\ttabs", "  leading\n    return x"]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    tok.train_from_iterator(corpus * 4, trainer=trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                                    show_progress=False))
    model = json.loads(tok.to_str())["model"]
    learned = sorted(model["vocab"], key=model["vocab"].__getitem__)
    tokens = learned[:4] + [f"<0x{b:02X}>" for b in range(256)] + learned[4:]
    types = [3, 3, 3, 2] + [6] * 256 + [1] * (len(tokens) - 260)  # control, unknown, byte, normal
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    w = gguf.GGUFWriter(str(path), "gemma4")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 128), (w.add_embedding_length, 8),
                       (w.add_feed_forward_length, 8), (w.add_head_count, 1), (w.add_head_count_kv, 1),
                       (w.add_key_length, 8), (w.add_value_length, 8)):
        add(value)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_merges(merges)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(lib_dir: str, python: str) -> None:
    vocab = HERE / "gemma4-vocab.gguf"
    write_vocab(vocab)
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=lib_dir)
    out = subprocess.run([python, "-c", LLAMA_CPP, str(vocab), json.dumps(TEXTS)], env=env, check=True,
                         capture_output=True, text=True).stdout
    ids = json.loads(out.strip().splitlines()[-1])
    (HERE / "gemma4-vocab-llamacpp.json").write_text(json.dumps({"texts": TEXTS, "ids": ids}, ensure_ascii=False, indent=1))
    print(f"wrote {vocab.name} and the ids of {len(TEXTS)} texts")


if __name__ == "__main__":
    main(*sys.argv[1:3])
