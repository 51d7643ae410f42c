"""Sampling: sampling parameters, logit transforms and token choice, as pure functions of tensors.

One function, :func:`process_logits`, turns raw target logits into the distribution p that both
plain decoding (one row) and speculative verification (k+1 rows) sample from. Sharing it is what
makes speculative decoding lossless: the target distribution at every position is computed by the
same code, with the same context, whichever path produced the position.

Order of transforms (vLLM / Hugging Face conventions):

0. logit bias (OpenAI's ``logit_bias``: a fixed amount added to chosen tokens' logits);
1. penalties: repetition (HF: divide positive logits, multiply negative ones, for every id seen
   in prompt + output), then frequency and presence (OpenAI: subtract ``count * frequency`` and
   ``presence`` for every id seen in the output only);
2. temperature (greedy, temperature 0, stops here: penalties only, then argmax);
3. top-k (ties with the k-th logit are kept, as in HF and vLLM);
4. top-p (the smallest most-likely set whose mass reaches top_p; the top token always stays);
5. min-p (drop tokens whose probability is below ``min_p`` times the top probability).

Filtered entries become ``-inf``. Every filter keeps at least the most likely token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from quickdraft.errors import QuickdraftError
from quickdraft.quant.ggml import active_kernels


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each output token. Validated on construction; invalid values raise QuickdraftError."""

    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF/vLLM: over prompt + output ids
    presence_penalty: float = 0.0  # OpenAI: over output ids only
    frequency_penalty: float = 0.0  # OpenAI: over output ids only
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; n >= 0: the chosen token's logprob and the top n
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids unique

    def __post_init__(self) -> None:
        # Lists arrive from JSON and the CLI; store tuples so the object stays hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((t, b) for t, b in bias)))
        problems = _problems(self)
        if problems:
            raise QuickdraftError("invalid sampling parameters: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0); top-k/top-p/min-p are then ignored."""
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        """True when a penalty is active, so process_logits needs the prompt and output ids."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _problems(p: SamplingParams) -> list[str]:
    """Every invalid field of ``p``, each as a message that says the allowed range."""
    out: list[str] = []
    if not _is_int(p.max_tokens) or p.max_tokens < 1:
        out.append(f"max_tokens must be an integer >= 1, got {p.max_tokens!r}")
    if not _is_real(p.temperature) or p.temperature < 0:
        out.append(f"temperature must be >= 0 (0 = greedy), got {p.temperature!r}")
    if not _is_int(p.top_k) or p.top_k < -1:
        out.append(f"top_k must be an integer >= -1 (0 or -1 = off), got {p.top_k!r}")
    if not _is_real(p.top_p) or not 0 < p.top_p <= 1:
        out.append(f"top_p must be in (0, 1] (1 = off), got {p.top_p!r}")
    if not _is_real(p.min_p) or not 0 <= p.min_p <= 1:
        out.append(f"min_p must be in [0, 1] (0 = off), got {p.min_p!r}")
    if not _is_real(p.repetition_penalty) or p.repetition_penalty <= 0:
        out.append(f"repetition_penalty must be > 0 (1 = off), got {p.repetition_penalty!r}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not _is_real(value) or not -2 <= value <= 2:
            out.append(f"{name} must be in [-2, 2] (0 = off), got {value!r}")
    if p.logprobs is not None and (not _is_int(p.logprobs) or not 0 <= p.logprobs <= 20):
        out.append(f"logprobs must be an integer in [0, 20] or None, got {p.logprobs!r}")
    if p.seed is not None and (not _is_int(p.seed) or not -(2**63) <= p.seed < 2**64):
        out.append(f"seed must be an integer in [-2**63, 2**64) or None, got {p.seed!r}")
    ids = [t for t, _ in p.logit_bias]
    if not all(_is_int(t) and t >= 0 for t in ids) or len(set(ids)) != len(ids):
        out.append("logit_bias keys must be distinct non-negative token ids")
    if not all(_is_real(b) and -100 <= b <= 100 for _, b in p.logit_bias):
        out.append("logit_bias values must be in [-100, 100]")
    if not all(isinstance(s, str) and s for s in p.stop):
        out.append(f"stop must be a list of non-empty strings, got {list(p.stop)!r}")
    if not all(_is_int(t) and t >= 0 for t in p.stop_token_ids):
        out.append(f"stop_token_ids must be non-negative integers, got {list(p.stop_token_ids)!r}")
    return out


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator for one request: seeded for reproducible output, else from a fresh random seed.

    Each request owns its generator, so concurrent requests and library code that uses the global
    RNG never disturb one another.
    """
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()  # a non-deterministic seed from the OS
    else:
        generator.manual_seed(seed)
    return generator


def process_logits(
    logits: Tensor,  # [N, V]
    params: SamplingParams,
    prompt_ids: Tensor,  # [P] long
    output_ids: Tensor,  # [O] long, context before row 0
    draft: Tensor | None = None,  # [N-1] long; row i also saw draft[:i] as output
) -> Tensor:  # [N, V] float32
    """Transform raw logits of N consecutive positions into the logits to sample from.

    Row i is processed exactly as a single-row call whose output_ids end with ``draft[:i]``, so the
    target distribution at a verified position is bitwise the one plain decoding would use.
    May return ``logits`` itself (as float32) when nothing applies; do not modify the result in place.
    """
    out = logits.float()  # [N, V]
    if params.logit_bias:
        out = _apply_logit_bias(out, params.logit_bias)
    if params.needs_history:  # the ids may live on the host while the logits are on a GPU
        on_device = None if draft is None else draft.to(out.device)
        out = _apply_penalties(out, params, prompt_ids.to(out.device), output_ids.to(out.device), on_device)
    if params.greedy:
        return out
    if params.temperature != 1.0:
        out = out / params.temperature
    if 0 < params.top_k < out.shape[-1]:
        out = _apply_top_k(out, params.top_k)
    if params.top_p < 1.0:
        out = _apply_top_p(out, params.top_p)
    if params.min_p > 0.0:
        out = _apply_min_p(out, params.min_p)
    return out


@lru_cache(maxsize=64)
def _bias_tensors(bias: tuple[tuple[int, float], ...], device: torch.device) -> tuple[Tensor, Tensor]:
    """(ids, float32 values) of a request's logit bias, built once per request, not per step."""
    ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=device)
    values = torch.tensor([b for _, b in bias], dtype=torch.float32, device=device)
    return ids, values


def _apply_logit_bias(logits: Tensor, bias: tuple[tuple[int, float], ...]) -> Tensor:
    ids, values = _bias_tensors(bias, logits.device)  # logits are float32 here
    out = logits.clone()
    out[:, ids] += values
    return out


def _output_counts(output_ids: Tensor, draft: Tensor | None, shape: torch.Size) -> Tensor:
    """How often each id occurs in each row's output context: output_ids plus draft[:i]. [N, V]."""
    n_rows, vocab = shape
    base = torch.zeros(vocab, dtype=torch.long, device=output_ids.device)  # [V]
    # scatter_add_, not bincount: bincount syncs on CUDA to find its length.
    base.scatter_add_(0, output_ids.long(), torch.ones_like(output_ids, dtype=torch.long))
    if n_rows == 1:
        return base.unsqueeze(0)  # [1, V]
    if draft is None or draft.shape != (n_rows - 1,):
        got = None if draft is None else tuple(draft.shape)
        raise ValueError(
            f"penalties over {n_rows} rows need draft of shape ({n_rows - 1},), got {got}"
        )
    # Row i+1 gains one count of draft[i]; the running sum over rows gives each row's context.
    steps = torch.zeros(n_rows, vocab, dtype=torch.long, device=base.device)  # [N, V]
    rows = torch.arange(1, n_rows, device=base.device)  # [N-1]
    steps[rows, draft.long()] = 1
    return base + steps.cumsum(0)  # [N, V]


def _apply_penalties(
    logits: Tensor,  # [N, V] float32
    params: SamplingParams,
    prompt_ids: Tensor,  # [P]
    output_ids: Tensor,  # [O]
    draft: Tensor | None,  # [N-1]
) -> Tensor:  # [N, V]
    """Repetition (prompt + output, HF), then frequency and presence (output only, OpenAI)."""
    counts = _output_counts(output_ids, draft, logits.shape)  # [N, V]
    in_output = counts > 0  # [N, V]
    if params.repetition_penalty != 1.0:
        in_prompt = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)  # [V]
        in_prompt[prompt_ids.long()] = True
        seen = in_output | in_prompt  # [N, V]
        rp = params.repetition_penalty
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen, penalised, logits)
    if params.frequency_penalty != 0.0:
        logits = logits - params.frequency_penalty * counts.to(logits.dtype)
    if params.presence_penalty != 0.0:
        logits = logits - params.presence_penalty * in_output.to(logits.dtype)
    return logits


def _apply_top_k(logits: Tensor, k: int) -> Tensor:  # [N, V] -> [N, V]
    """Keep the k largest logits per row, and any tied with the k-th (HF/vLLM behaviour)."""
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [N, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: Tensor, top_p: float) -> Tensor:  # [N, V] -> [N, V]
    """Keep the smallest most-likely set whose probability mass reaches top_p.

    A token stays when the mass of the tokens ranked above it is still below top_p; the top token
    has nothing above it, so at least one token always stays.
    """
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)  # [N, V]
    probs = sorted_logits.softmax(dim=-1)  # [N, V]
    mass_before = probs.cumsum(dim=-1) - probs  # [N, V], exactly 0 in column 0
    drop_sorted = mass_before >= top_p  # [N, V]
    drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)  # back to vocab order
    return logits.masked_fill(drop, float("-inf"))


def _apply_min_p(logits: Tensor, min_p: float) -> Tensor:  # [N, V] -> [N, V]
    """Drop tokens less likely than min_p times the most likely one (the top token always stays).

    The ratio to the top probability does not change when other tokens are filtered out, so min-p
    gives the same set whether it runs before or after top-k/top-p.
    """
    probs = logits.softmax(dim=-1)  # [N, V]
    threshold = min_p * probs.amax(dim=-1, keepdim=True)  # [N, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def probs_from_logits(processed: Tensor) -> Tensor:  # [N, V] -> [N, V]
    """Softmax in float32 of the output of process_logits (filtered -inf entries get 0)."""
    return processed.float().softmax(dim=-1)


def greedy_tokens(processed: Tensor) -> Tensor:  # [N, V] -> [N] long
    """Argmax per row. Ties go to the lowest token id: torch.argmax documents that it returns the
    first maximal index, which keeps greedy output identical across plain and speculative paths.
    CPU float32 rows take the kernels' ``argmax_rows`` (the same index, NaN rows too; ~3x faster than
    torch's over a 262k vocabulary)."""
    if processed.dtype is torch.float32 and processed.is_cpu and processed.dim() == 2 and processed.shape[1] > 0 \
            and (ops := active_kernels()) is not None:
        return ops.argmax_rows(processed.contiguous())
    return processed.argmax(dim=-1)


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The seed of the random numbers that choose the token at sequence ``position`` (SplitMix64 of
    the request's seed and the position, 63 bits: what ``Generator.manual_seed`` takes)."""
    z = ((seed & _MASK64) + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def sample_at(probs: Tensor, seed: int, positions: Sequence[int]) -> Tensor:  # [N, V] -> [N] long
    """Draw row i's token with random numbers that depend on (``seed``, ``positions[i]``) alone.

    The exponential race of :func:`sample_tokens`, with each row's exponentials from a generator
    seeded by :func:`position_seed`. Plain decoding and every speculative step therefore pick the
    same token at a position from the same distribution p: a verification accepts a drafted token
    exactly when it equals this choice, so a seed gives one answer under every drafter and k.
    """
    if len(positions) != probs.shape[0]:
        raise ValueError(f"sample_at needs one position per row: {probs.shape[0]} rows, {len(positions)} positions")
    generator = torch.Generator(device=probs.device)
    race = torch.empty_like(probs, dtype=torch.float32)  # [N, V]
    for row, position in enumerate(positions):
        generator.manual_seed(position_seed(seed, position))
        race[row].exponential_(1.0, generator=generator)
    return _race_winner(probs, race)


def sample_tokens(probs: Tensor, generator: torch.Generator) -> Tensor:  # [N, V] -> [N] long
    """Draw one token per row from ``probs`` (weights; need not sum to 1) without a host sync.

    Exponential race: with E_v ~ Exp(1) independent, argmax_v probs_v / E_v is distributed as
    probs / sum(probs), because E_v / probs_v ~ Exp(rate probs_v) and the smallest of independent
    exponentials is v with probability rate_v / sum(rates). Unlike torch.multinomial this needs no
    validity check on the host. Tokens with zero weight are never drawn.
    """
    race = torch.empty_like(probs, dtype=torch.float32)  # [N, V]
    race.exponential_(1.0, generator=generator)
    return _race_winner(probs, race)


def _race_winner(probs: Tensor, race: Tensor) -> Tensor:  # [N, V], [N, V] Exp(1) -> [N] long
    """argmax_v probs_v / E_v per row (``race`` is overwritten)."""
    # Exp(1) may round to 0 in float32; clamping keeps probs / race finite-or-inf, never nan.
    race.clamp_min_(torch.finfo(torch.float32).tiny)
    return (probs.float() / race).argmax(dim=-1)
