"""Run the target over the training sequences once and keep what the head learns from.

Per position t of a sequence the head needs (see ``quickdraft.speculative.eagle3.head``): the target's
hidden states at the aux layers (INPUT-of-layer convention, concatenated: ``[n_aux * H]``), the
token ids, and the target's own prediction for position t+1 (its argmax, the label a greedy
verifier accepts; plus its top-k tokens and log-probabilities for distillation). Capturing once
and training many epochs on the stored features costs one target pass per token in total, which
on a CPU is most of the work.

Shards are safetensors files under ``features/`` (bf16 features: the target's activations do not
fit fp16's range in every model; int32 ids; fp16 log-probabilities), written atomically, so an
interrupted capture resumes at the first missing shard. ``manifest.json`` records what the shards
were made from; features of different sequences or layers are never mixed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from tqdm import tqdm

from quickdraft.errors import QuickdraftError
from quickdraft.models.causal_lm import CausalLM

FEATURE_DTYPE = torch.bfloat16
SHARD_TOKENS = 16384  # tokens per shard (about 56 MB of bf16 features for SmolLM2's three layers)


def check_aux_layers(aux_layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Validate INPUT-of-layer ids (0..L, L = the final norm's input); the model returns captured
    states in layer order, so the ids must be strictly increasing."""
    ids = tuple(int(i) for i in aux_layers)
    if not ids or any(not 0 <= i <= num_layers for i in ids) or list(ids) != sorted(set(ids)):
        raise QuickdraftError(
            f"aux layers {list(ids)} must be increasing, distinct layer ids between 0 and {num_layers} "
            f"(the INPUT of each layer; the target has {num_layers} layers)"
        )
    return ids


def sequences_digest(sequences: Sequence[Sequence[int]]) -> str:
    h = hashlib.sha256()
    for seq in sequences:
        h.update(len(seq).to_bytes(4, "little"))
        h.update(torch.tensor(list(seq), dtype=torch.int32).numpy().tobytes())
    return h.hexdigest()


def plan_shards(lengths: Sequence[int], shard_tokens: int = SHARD_TOKENS) -> list[tuple[int, int]]:
    """Consecutive [first, end) sequence ranges of about ``shard_tokens`` tokens each."""
    shards, first, size = [], 0, 0
    for i, n in enumerate(lengths):
        size += n
        if size >= shard_tokens:
            shards.append((first, i + 1))
            first, size = i + 1, 0
    if first < len(lengths):
        shards.append((first, len(lengths)))
    return shards


@torch.inference_mode()
def capture_sequence(model: CausalLM, ids: Sequence[int], aux_layers: Sequence[int], topk: int) -> dict[str, Tensor]:
    """One prefill-style pass over ``ids`` with a fresh cache; the rows the head trains on."""
    x = torch.tensor(list(ids), dtype=torch.long, device=model.device)
    logits, captured = model(x, model.make_cache(len(ids)), capture=tuple(aux_layers))
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top_lp, top_ids = logprobs.topk(topk, dim=-1)  # [T, k], sorted: column 0 is the argmax
    return {
        "features": torch.cat(captured, dim=-1).to(FEATURE_DTYPE).cpu(),
        "tokens": x.to(torch.int32).cpu(),
        "top_ids": top_ids.to(torch.int32).cpu(),
        "top_logprobs": top_lp.to(torch.float16).cpu(),
    }


@dataclass(frozen=True)
class SeqRef:
    shard: int
    start: int  # first row in the shard
    length: int


class FeatureSet:
    """Read access to captured shards: a sequence's rows by index, memory-mapped."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        manifest = self.directory / "manifest.json"
        if not manifest.is_file():
            raise QuickdraftError(f"no captured features in {self.directory} (manifest.json is missing)")
        self.manifest = json.loads(manifest.read_text())
        self.aux_layers = tuple(self.manifest["aux_layers"])
        self.topk = int(self.manifest["topk"])
        self.refs: list[SeqRef] = []
        self._files = []
        for i, name in enumerate(self.manifest["shards"]):
            path = self.directory / name
            if not path.is_file():
                raise QuickdraftError(f"feature shard {path} is missing; run the command again with --resume")
            f = safe_open(str(path), framework="pt")
            self._files.append(f)
            offsets = f.get_tensor("offsets").tolist()
            self.refs += [SeqRef(i, a, b - a) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]

    def __len__(self) -> int:
        return len(self.refs)

    @property
    def num_tokens(self) -> int:
        return sum(r.length for r in self.refs)

    @property
    def feature_size(self) -> int:
        return int(self.manifest["feature_size"])

    def get(self, index: int) -> dict[str, Tensor]:
        """features [T, n*H] bf16, tokens [T] long, top_ids [T, k] long, top_logprobs [T, k] float32."""
        ref = self.refs[index]
        f = self._files[ref.shard]
        rows = slice(ref.start, ref.start + ref.length)
        return {
            "features": f.get_slice("features")[rows],
            "tokens": f.get_slice("tokens")[rows].long(),
            "top_ids": f.get_slice("top_ids")[rows].long(),
            "top_logprobs": f.get_slice("top_logprobs")[rows].float(),
        }

    def labels(self) -> Tensor:
        """Every position's target argmax, concatenated (for the draft vocabulary)."""
        return torch.cat([f.get_tensor("top_ids")[:, 0].long() for f in self._files])

    def tokens(self) -> Tensor:
        return torch.cat([f.get_tensor("tokens").long() for f in self._files])


def capture_features(
    model: CausalLM,
    sequences: Sequence[Sequence[int]],
    directory: Path,
    aux_layers: Sequence[int],
    topk: int = 8,
    shard_tokens: int = SHARD_TOKENS,
    progress: bool = True,
) -> FeatureSet:
    """Capture every sequence into ``directory`` (skipping shards already there) and open them."""
    aux = check_aux_layers(aux_layers, model.config.num_hidden_layers)
    if not 1 <= topk <= model.config.vocab_size:
        raise QuickdraftError(f"--topk must be between 1 and the vocabulary size, got {topk}")
    too_long = [i for i, s in enumerate(sequences) if len(s) > model.max_len]
    if too_long:
        raise QuickdraftError(
            f"sequence {too_long[0]} has {len(sequences[too_long[0]])} tokens but the target's context holds "
            f"{model.max_len}; lower --seq-len"
        )
    directory.mkdir(parents=True, exist_ok=True)
    shards = plan_shards([len(s) for s in sequences], shard_tokens)
    names = [f"shard-{i:05d}.safetensors" for i in range(len(shards))]
    manifest = {
        "aux_layers": list(aux),
        "aux_layer_convention": "input",
        "topk": topk,
        "feature_size": len(aux) * model.config.hidden_size,
        "num_sequences": len(sequences),
        "num_tokens": sum(len(s) for s in sequences),
        "sequences_sha256": sequences_digest(sequences),
        "shards": names,
    }
    path = directory / "manifest.json"
    if path.is_file():
        old = json.loads(path.read_text())
        if old != manifest:
            raise QuickdraftError(
                f"{directory} holds features captured from other sequences or settings; "
                "delete that folder or choose another --out"
            )
    else:
        path.write_text(json.dumps(manifest, indent=1))
    todo = [i for i, name in enumerate(names) if not (directory / name).is_file()]
    total = sum(len(s) for i in todo for s in sequences[shards[i][0] : shards[i][1]])
    with tqdm(total=total, desc="capture", unit="tok", disable=not progress or not todo) as bar:
        for i in todo:
            first, end = shards[i]
            rows = []
            for seq in sequences[first:end]:
                rows.append(capture_sequence(model, seq, aux, topk))
                bar.update(len(seq))
            _write_shard(directory / names[i], rows)
    return FeatureSet(directory)


def _write_shard(path: Path, rows: list[dict[str, Tensor]]) -> None:
    tensors = {key: torch.cat([r[key] for r in rows]).contiguous() for key in rows[0]}
    lengths = torch.tensor([0] + [len(r["tokens"]) for r in rows])
    tensors["offsets"] = lengths.cumsum(0)
    tmp = path.with_name(path.name + ".partial")
    save_file(tensors, str(tmp))
    tmp.replace(path)
