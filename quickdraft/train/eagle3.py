"""Train an EAGLE-3 head on captured target features, with the training-time test (TTT).

Interface used from HEAD (quickdraft/speculative/eagle3/head.py), as agreed in the contract:
``Eagle3Head.train_forward(embeds [B,T,H], features [B,T,H], positions [T], cache, attention_mask
[B,T]) -> (logits [B,T,Vd] float32, h [B,T,H], (k, v))`` where ``cache`` is the list of (k, v) of
the previous unroll steps (step 0 first); step s is called with positions + s. The fc fusion is
applied here with ``F.linear(aux, head.fc.weight)`` (the head's blocked Linear is for 2-D
inference rows). Nothing else is needed from HEAD.

Alignment (the head's convention): row t of unroll step s holds the embedding of token t+1+s and,
as its feature, the fused target features of position t (s = 0) or the head's own output ``h`` of
row t at step s-1 (s > 0); its label is the TARGET's prediction at position t+1+s (the token a
greedy verifier would accept there). Attention at step s: row t sees the step-0 keys of rows
0..t plus the keys of its own row from steps 1..s, exactly what the drafter's KV cache holds when
it drafts s tokens past position t. So the head is trained on its own (imperfect) features the
way it will use them, the point of EAGLE-3's TTT; gradients flow through the whole unroll.

Loss per step: cross-entropy to the target's argmax ("ce", what greedy acceptance rewards) or to
the target's top-k distribution restricted to the draft vocabulary ("kl", forward KL up to a
constant, the paper's choice), weighted ``step_weight ** s`` and normalised by the weights' sum.
The top-1 accuracy at step s counts labels outside the draft vocabulary as misses; it
approximates the acceptance rate at draft position s+1 given the earlier drafts were accepted.

Checkpoints hold the head, AdamW's state, the step and the data position; the batch order of an
epoch is a pure function of (seed, epoch), so a resumed run continues with exactly the batches
(and parameters) an uninterrupted run would have had.

Device and precision: the trainer runs where the head is (``quickdraft.config.resolve_device``: cpu, cuda or auto);
batches are assembled on the CPU from the memory-mapped shards and moved there, the frozen
embedding and AdamW's state live there. ``train_dtype="bfloat16"`` runs the forward (and so the
backward's matmuls) under autocast with float32 master weights and optimizer; on the 2-core
AVX-512 BF16 development machine that trains about 1.7x faster than float32 and reached the same
held-out loss after 40 steps. Only the forward is wrapped: with the whole step under autocast
(backward, clipping and AdamW included) the same 40-step test ended far worse (loss 63 vs 6).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from quickdraft.errors import QuickdraftError
from quickdraft.models.causal_lm import CausalLM
from quickdraft.speculative.eagle3.head import Eagle3Config, Eagle3Head
from quickdraft.train.capture import FeatureSet
from quickdraft.train.vocab import target_to_draft

LOSSES = ("ce", "kl")
SCHEDULES = ("cosine", "linear", "constant")
TRAIN_DTYPES = ("float32", "bfloat16")  # the forward's matmuls; weights and AdamW stay float32
CHECKPOINT_FILE = "state.pt"


@dataclass(frozen=True)
class TrainConfig:
    epochs: float = 1.0
    batch_size: int = 8  # sequences per optimizer step
    lr: float = 3e-4
    schedule: str = "cosine"  # decay to 0 after warmup
    warmup: float = 0.05  # share of the steps with a linear warmup
    weight_decay: float = 0.0
    max_grad_norm: float = 0.5
    ttt_steps: int = 3
    step_weight: float = 0.8  # loss weight of unroll step s: step_weight ** s
    loss: str = "ce"
    eval_fraction: float = 0.02  # sequences held out to measure accuracy
    save_every: int = 200  # steps between checkpoints (0: only at the end)
    log_every: int = 10
    seed: int = 0
    train_dtype: str = "float32"  # "bfloat16": the forward under autocast (float32 master weights)

    def __post_init__(self) -> None:
        checks = [
            (self.epochs > 0, f"--epochs must be positive, got {self.epochs}"),
            (self.batch_size >= 1, f"--batch-size must be at least 1, got {self.batch_size}"),
            (self.lr > 0, f"--lr must be positive, got {self.lr}"),
            (self.schedule in SCHEDULES, f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}"),
            (0 <= self.warmup < 1, f"--warmup is a share of the steps in [0, 1), got {self.warmup}"),
            (self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}"),
            (self.max_grad_norm > 0, f"--max-grad-norm must be positive, got {self.max_grad_norm}"),
            (1 <= self.ttt_steps <= 16, f"--ttt-steps must be between 1 and 16, got {self.ttt_steps}"),
            (0 < self.step_weight <= 1, f"--step-weight must be in (0, 1], got {self.step_weight}"),
            (self.loss in LOSSES, f"--loss must be one of {', '.join(LOSSES)}, got {self.loss!r}"),
            (0 <= self.eval_fraction < 0.5, f"--eval-fraction must be in [0, 0.5), got {self.eval_fraction}"),
            (self.save_every >= 0, f"--save-every must be >= 0, got {self.save_every}"),
            (self.log_every >= 1, f"--log-every must be >= 1, got {self.log_every}"),
            (self.train_dtype in TRAIN_DTYPES,
             f"--train-dtype must be one of {', '.join(TRAIN_DTYPES)}, got {self.train_dtype!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise QuickdraftError(message)


def autocast(cfg: TrainConfig, device: torch.device) -> torch.autocast:
    """The forward's precision context: bf16 matmuls under ``train_dtype="bfloat16"``, else off.
    Only the forward runs under it (backward follows the recorded casts; AdamW stays float32)."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=cfg.train_dtype == "bfloat16")


# ------------------------------------------------------------------------------ target weights


def dense_weight(module: nn.Module) -> Tensor:
    """The float32 weight matrix of an embedding or linear layer, dequantized if it is GGUF."""
    linear = getattr(module, "linear", None)  # QuantEmbedding wraps a quantized linear
    source = linear if linear is not None else module
    dequantize = getattr(source, "dequantize", None)
    if callable(dequantize):
        return torch.as_tensor(dequantize()).detach().float().cpu()
    weight = getattr(source, "weight", None)
    if not isinstance(weight, Tensor):
        raise QuickdraftError(f"cannot read the weights of the target's {type(module).__name__}")
    return weight.detach().float().cpu().clone()


def init_head(cfg: Eagle3Config, target: CausalLM, d2t: Tensor, seed: int = 0, max_len: int = 4096) -> Eagle3Head:
    """A float32 head ready to train.

    Layers get PyTorch's default initialisation (seeded); the output side starts from the
    target's own: ``norm`` = the target's final norm, ``lm_head`` = the target's output rows of
    the draft tokens. The head's ``h`` lives in the target's hidden space, so it starts out able
    to read its features the target's way and mostly has to learn the one-token lookahead.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = Eagle3Head(cfg, max_len=max_len)
    head.set_vocab_map(d2t)
    draft_to_target = head.to_target_ids(torch.arange(cfg.draft_vocab_size))
    with torch.no_grad():
        head.lm_head.weight.copy_(dense_weight(target.lm_head)[draft_to_target])
        head.norm.weight.copy_(target.model.norm.weight.detach().float())
    return head.float().train()


# ------------------------------------------------------------------------------ batches


@dataclass
class Batch:
    features: Tensor  # [B, T, n*Ht] float32
    tokens: Tensor  # [B, T] long
    valid: Tensor  # [B, T] bool (real positions)
    top_ids: Tensor  # [B, T, k] long
    top_logprobs: Tensor  # [B, T, k] float32

    @property
    def num_tokens(self) -> int:
        return int(self.valid.sum())

    def to(self, device: torch.device) -> Batch:
        if self.features.device == device:
            return self
        return Batch(self.features.to(device), self.tokens.to(device), self.valid.to(device),
                     self.top_ids.to(device), self.top_logprobs.to(device))


def collate(features: FeatureSet, indices: Sequence[int]) -> Batch:
    """Right-padded tensors for the sequences ``indices``."""
    rows = [features.get(i) for i in indices]
    t = max(len(r["tokens"]) for r in rows)
    b, k = len(rows), features.topk

    def pad(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        out = torch.zeros(b, t, *shape, dtype=dtype)
        for i, r in enumerate(rows):
            out[i, : len(r[key])] = r[key].to(dtype)
        return out

    valid = torch.zeros(b, t, dtype=torch.bool)
    for i, r in enumerate(rows):
        valid[i, : len(r["tokens"])] = True
    return Batch(
        features=pad("features", (features.feature_size,), torch.float32),
        tokens=pad("tokens", (), torch.long),
        valid=valid,
        top_ids=pad("top_ids", (k,), torch.long),
        top_logprobs=pad("top_logprobs", (k,), torch.float32),
    )


def split_indices(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) sequence indices: a seeded draw of ``eval_fraction`` held out (>= 1 when
    asked for and at least two sequences exist)."""
    order = list(range(n))
    random.Random(f"split/{seed}").shuffle(order)
    n_eval = min(n - 1, max(1, round(n * eval_fraction))) if eval_fraction > 0 and n > 1 else 0
    return sorted(order[n_eval:]), sorted(order[:n_eval])


def epoch_batches(
    train: Sequence[int], lengths: Sequence[int], batch_size: int, seed: int, epoch: int
) -> list[list[int]]:
    """The batches of one epoch, a pure function of (seed, epoch).

    Sequences are shuffled, grouped in windows of 32 batches, sorted by length inside a window
    (less padding), cut into batches, and the batches shuffled again.
    """
    rng = random.Random(f"epoch/{seed}/{epoch}")
    order = list(train)
    rng.shuffle(order)
    window = 32 * batch_size
    batches: list[list[int]] = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w : w + window], key=lambda i: lengths[i])
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


# ------------------------------------------------------------------------------ the loss


def _shift(x: Tensor, n: int, fill: float | int | bool = 0) -> Tensor:
    """x[:, t + n] at column t (dim 1), ``fill`` past the end."""
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


@dataclass
class StepStats:
    loss: float
    correct: list[int]  # per unroll step: rows whose top-1 draft token equals the target's
    counted: list[int]  # per unroll step: rows with a label

    def accuracy(self) -> list[float]:
        return [c / n if n else 0.0 for c, n in zip(self.correct, self.counted, strict=True)]


@dataclass
class UnrollStep:
    """One training-time-test step: logits for every row, which rows count, and their labels."""

    logits: Tensor  # [B, T, Vd] float32
    rows: Tensor  # [B, T] bool: row t has a token t+1+s and a label
    labels: Tensor  # [B, T] target ids (the target's argmax at position t+1+s)
    top_ids: Tensor  # [B, T, k] the target's top-k there
    top_logprobs: Tensor  # [B, T, k]


def unroll(head: Eagle3Head, batch: Batch, embed: Tensor, steps: int) -> Iterator[UnrollStep]:
    """Run the head ``steps`` times over the batch, each step on the previous step's ``h``."""
    t = batch.features.shape[1]
    positions = torch.arange(t, device=batch.features.device)
    feature = F.linear(batch.features, head.fc.weight)  # [B, T, H]
    cache: list[tuple[Tensor, Tensor]] = []
    for s in range(steps):
        shift = 1 + s
        ids = _shift(batch.tokens, shift)
        logits, feature, kv = head.train_forward(embed[ids], feature, positions + s, cache, attention_mask=batch.valid)
        cache.append(kv)
        yield UnrollStep(
            logits=logits,
            rows=_shift(batch.valid, shift, False),
            labels=_shift(batch.top_ids[..., 0], shift),
            top_ids=_shift(batch.top_ids, shift),
            top_logprobs=_shift(batch.top_logprobs, shift),
        )


def step_loss(step: UnrollStep, t2d_index: Tensor, loss: str) -> Tensor:
    """Mean loss over the step's rows whose label the draft vocabulary covers."""
    rows = step.rows
    logp = torch.log_softmax(step.logits[rows], dim=-1)  # [N, Vd]
    if loss == "ce":
        draft_labels = t2d_index[step.labels[rows]]
        keep = draft_labels >= 0
        if not keep.any():
            return logp.sum() * 0
        return -logp[keep].gather(1, draft_labels[keep, None]).mean()
    top = t2d_index[step.top_ids[rows]]  # [N, k]
    keep = (top >= 0).any(-1)
    if not keep.any():
        return logp.sum() * 0
    lp = step.top_logprobs[rows].masked_fill(top < 0, float("-inf"))[keep]
    p = torch.softmax(lp, dim=-1)  # the target's top-k, restricted to the draft vocabulary
    return -(p * logp[keep].gather(1, top[keep].clamp(min=0))).sum(-1).mean()


def ttt_loss(
    head: Eagle3Head, batch: Batch, embed: Tensor, cfg: TrainConfig
) -> tuple[Tensor, StepStats]:
    """The weighted training-time-test loss of one batch, and per-step top-1 hits."""
    t2d_index = target_to_draft(head.t2d)
    weights = [cfg.step_weight**s for s in range(cfg.ttt_steps)]
    total = batch.features.new_zeros(())
    correct, counted = [], []
    for weight, step in zip(weights, unroll(head, batch, embed, cfg.ttt_steps), strict=True):
        total = total + weight * step_loss(step, t2d_index, cfg.loss)
        with torch.no_grad():
            pred = head.to_target_ids(step.logits[step.rows].argmax(-1))
            correct.append(int((pred == step.labels[step.rows]).sum()))
            counted.append(int(step.rows.sum()))
    total = total / sum(weights)
    return total, StepStats(float(total.detach()), correct, counted)


@torch.no_grad()
def evaluate(
    head: Eagle3Head, features: FeatureSet, indices: Sequence[int], embed: Tensor, cfg: TrainConfig
) -> StepStats | None:
    """Loss and per-step accuracy over ``indices`` (no gradients), in the training precision."""
    if not indices:
        return None
    device = head.device
    was_training = head.training
    head.eval()
    correct = [0] * cfg.ttt_steps
    counted = [0] * cfg.ttt_steps
    loss_sum = weight_sum = 0.0
    for i in range(0, len(indices), cfg.batch_size):
        batch = collate(features, indices[i : i + cfg.batch_size]).to(device)
        with autocast(cfg, device):
            loss, stats = ttt_loss(head, batch, embed, cfg)
        loss_sum += float(loss) * batch.num_tokens
        weight_sum += batch.num_tokens
        correct = [a + b for a, b in zip(correct, stats.correct, strict=True)]
        counted = [a + b for a, b in zip(counted, stats.counted, strict=True)]
    head.train(was_training)
    return StepStats(loss_sum / max(weight_sum, 1), correct, counted)


def chain_tau(accuracy: Sequence[float]) -> float:
    """Expected tokens per target pass of a greedy chain drafted with these per-position
    conditional acceptance rates (1 for the target's own token, plus each accepted prefix)."""
    tau, p = 1.0, 1.0
    for a in accuracy:
        p *= a
        tau += p
    return tau


# ------------------------------------------------------------------------------ the trainer


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Learning rate before optimizer step ``step`` (0-based) of ``total``."""
    warm = int(cfg.warmup * total)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    if cfg.schedule == "constant":
        return cfg.lr
    progress = (step - warm) / max(1, total - warm)
    if cfg.schedule == "linear":
        return cfg.lr * (1.0 - progress)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch: int = 0  # next batch of the epoch
    tokens_seen: int = 0
    wall_seconds: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class TrainResult:
    state: TrainState
    total_steps: int
    train_accuracy: list[float]  # over the last steps (up to 50)
    eval: StepStats | None
    eval_sequences: int
    finished: bool


class Trainer:
    """AdamW over the head's parameters; the embedding stays the target's, frozen.

    Everything runs on the head's device: move the head there first (``head.to(device)``); the
    embedding and each batch follow it, the optimizer's state is created there.
    """

    def __init__(
        self,
        head: Eagle3Head,
        features: FeatureSet,
        embed: Tensor,
        cfg: TrainConfig,
        checkpoint_dir: Path | None = None,
        log: Callable[[str], None] = lambda _m: None,
        progress: bool = True,
    ) -> None:
        self.device = head.device
        self.head, self.features, self.embed, self.cfg = head, features, embed.float().to(self.device), cfg
        self.checkpoint_dir = checkpoint_dir
        self.log, self.progress = log, progress
        self.lengths = [r.length for r in features.refs]
        self.train_idx, self.eval_idx = split_indices(len(features), cfg.eval_fraction, cfg.seed)
        if not self.train_idx:
            raise QuickdraftError("no training sequence left after holding out the evaluation share")
        self.steps_per_epoch = math.ceil(len(self.train_idx) / cfg.batch_size)
        self.total_steps = max(1, math.ceil(cfg.epochs * self.steps_per_epoch))
        decay = [p for n, p in head.named_parameters() if p.dim() > 1]
        rest = [p for n, p in head.named_parameters() if p.dim() <= 1]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
        )
        self.state = TrainState()
        self._plan: tuple[int, list[list[int]]] | None = None

    # -------------------------------------------------------------- checkpoints

    def save_checkpoint(self) -> None:
        if self.checkpoint_dir is None:
            return
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        payload = {
            "head": self.head.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "state": asdict(self.state),
            "train_config": asdict(self.cfg),
            "head_config": self.head.config.to_dict(),
        }
        path = self.checkpoint_dir / CHECKPOINT_FILE
        tmp = path.with_name(path.name + ".partial")
        torch.save(payload, tmp)
        tmp.replace(path)

    def load_checkpoint(self) -> bool:
        """Continue from the checkpoint in ``checkpoint_dir``; False when there is none."""
        path = None if self.checkpoint_dir is None else self.checkpoint_dir / CHECKPOINT_FILE
        if path is None or not path.is_file():
            return False
        payload = torch.load(path, map_location="cpu", weights_only=False)
        if payload["head_config"] != self.head.config.to_dict():
            raise QuickdraftError(f"the checkpoint in {path.parent} is for a head of another shape; use a new --out")
        # settings added after a checkpoint was written count as their defaults
        saved = {**asdict(TrainConfig()), **payload["train_config"]}
        if saved != asdict(self.cfg):
            changed = sorted(k for k, v in asdict(self.cfg).items() if saved.get(k) != v)
            raise QuickdraftError(
                f"the checkpoint in {path.parent} was trained with other settings ({', '.join(changed)}); "
                "resume with the same options, or train into a new --out"
            )
        self.head.load_state_dict(payload["head"])  # copies onto the head's device
        self.optimizer.load_state_dict(payload["optimizer"])  # state follows the parameters' device
        self.state = TrainState(**payload["state"])
        return True

    # -------------------------------------------------------------- training

    def _batches(self, epoch: int) -> list[list[int]]:
        if self._plan is None or self._plan[0] != epoch:
            self._plan = (epoch, epoch_batches(self.train_idx, self.lengths, self.cfg.batch_size, self.cfg.seed, epoch))
        return self._plan[1]

    def train_step(self, indices: Sequence[int]) -> StepStats:
        batch = collate(self.features, indices).to(self.device)
        lr = lr_at(self.state.step, self.total_steps, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with autocast(self.cfg, self.device):
            loss, stats = ttt_loss(self.head, batch, self.embed, self.cfg)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.cfg.max_grad_norm)
        self.optimizer.step()
        self.state.step += 1
        self.state.tokens_seen += batch.num_tokens
        return stats

    def run(self, stop_after: int | None = None) -> TrainResult:
        """Train until the planned steps are done (or ``stop_after`` steps in total), checkpointing
        every ``save_every`` steps and at the end."""
        cfg, st = self.cfg, self.state
        end = self.total_steps if stop_after is None else min(self.total_steps, stop_after)
        recent: list[StepStats] = []
        t0 = time.perf_counter() - st.wall_seconds
        bar = tqdm(total=self.total_steps, initial=st.step, desc="train", unit="step", disable=not self.progress)
        while st.step < end:
            batches = self._batches(st.epoch)
            if st.batch >= len(batches):
                st.epoch, st.batch = st.epoch + 1, 0
                continue
            stats = self.train_step(batches[st.batch])
            st.batch += 1
            st.wall_seconds = time.perf_counter() - t0
            recent = (recent + [stats])[-50:]
            acc = _pooled(recent)
            bar.update(1)
            bar.set_postfix_str(f"loss {stats.loss:.3f} acc " + "/".join(f"{a:.2f}" for a in acc))
            if st.step % cfg.log_every == 0 or st.step == end:
                st.history.append({
                    "step": st.step, "epoch": st.epoch, "tokens_seen": st.tokens_seen,
                    "wall_seconds": round(st.wall_seconds, 1), "lr": lr_at(st.step - 1, self.total_steps, cfg),
                    "loss": round(stats.loss, 4), "accuracy": [round(a, 4) for a in acc],
                })
            if cfg.save_every and st.step % cfg.save_every == 0 and st.step < end:
                self.save_checkpoint()
        bar.close()
        self.save_checkpoint()
        finished = st.step >= self.total_steps
        ev = evaluate(self.head, self.features, self.eval_idx, self.embed, cfg) if finished else None
        return TrainResult(st, self.total_steps, _pooled(recent), ev, len(self.eval_idx), finished)


def _pooled(stats: Sequence[StepStats]) -> list[float]:
    if not stats:
        return []
    correct = [sum(s.correct[i] for s in stats) for i in range(len(stats[0].correct))]
    counted = [sum(s.counted[i] for s in stats) for i in range(len(stats[0].counted))]
    return StepStats(0.0, correct, counted).accuracy()


def export_head(head: Eagle3Head, dtype: torch.dtype = torch.bfloat16) -> Eagle3Head:
    """A copy of the trained head in ``dtype`` on the CPU (buffers d2t/t2d keep their integer types)."""
    import copy

    out = copy.deepcopy(head).to(device="cpu", dtype=dtype)
    return out.eval()


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)

