"""Structured output (``response_format``) as a :class:`~quickdraft.constraints.Constraint`, with llguidance.

llguidance compiles a JSON schema into an Earley-parser grammar over the model's own tokenizer
and gives, for the parser's current state, the set of tokens that keep the output inside the
grammar. It was picked over xgrammar and outlines-core because it is a small abi3 wheel with no
torch dependency (nothing to pull a second torch next to ours), builds its tokenizer straight from
the ``tokenizers`` JSON we already hold (GGUF-rebuilt ones included), validates tokens without
committing them and rolls back, which is what checking a whole draft needs.

Speculative decoding stays lossless: row i of :meth:`JsonConstraint.allowed` is the mask after
the committed tokens + ``draft[:i]``, a function of the prefix alone, so the target's distribution
at a position is masked the same way whether the position came from a draft or plain decoding.
A drafted token the grammar forbids gets p = 0 and is rejected like any other wrong draft.
End-of-sequence is allowed exactly when the grammar is complete; once nothing but EOS is left,
EOS is all the mask allows, and the engine stops on it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import llguidance
import numpy as np
import torch

from quickdraft.errors import QuickdraftError
from quickdraft.server.tools import compact
from quickdraft.tokenizer import Tokenizer

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


class GrammarCompiler:
    """Per tokenizer: the llguidance view of the vocabulary (built once, ~0.2 s) and compiling."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = sorted(tokenizer.eos_ids)
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._texts: dict[int, tuple[str, bytes]] = {}

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(),
                    n_vocab=self.tokenizer.vocab_size,
                    eos_token=self.eos_ids,
                )
            return self._ll

    def token_text(self, token_id: int) -> tuple[str, bytes]:
        """A token's text and exact bytes; a piece of a UTF-8 character shows as U+FFFD in the text."""
        found = self._texts.get(token_id)
        if found is None:
            raw = self.ll_tokenizer.decode_bytes([token_id])
            found = self._texts[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return found

    def marker(self, text: str) -> str:
        """``text`` for a Lark grammar: ``<[id]>`` when it is one special token of this
        vocabulary (llguidance matches special tokens by id only), else a quoted string."""
        import json

        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and self.ll_tokenizer.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    def json(self, schema: dict[str, Any] | None) -> JsonConstraint:
        """A constraint to JSON matching ``schema``; None = any JSON object. The JSON is compact
        (llguidance's fixed separators, no free whitespace: a greedy model cannot pad it with
        spaces forever); ``$defs``/``definitions`` and recursion through ``$ref`` work."""
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                compact(schema or ANY_JSON_OBJECT)
            )
        except (ValueError, TypeError) as exc:
            raise QuickdraftError(f"the JSON schema is not usable: {exc}") from exc
        return self._constraint(grammar, "the JSON schema")

    def lark(self, grammar: str) -> JsonConstraint:
        """A constraint to a Lark grammar in llguidance's dialect (``%json`` embeds schemas)."""
        try:
            compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
        except (ValueError, TypeError) as exc:
            raise QuickdraftError(f"the grammar is not usable: {exc}") from exc
        return self._constraint(compiled, "the grammar")

    def _constraint(self, grammar: str, what: str) -> JsonConstraint:
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise QuickdraftError(f"{what} is not usable: {matcher.get_error()}")
        return JsonConstraint(matcher, self.eos_ids)


class JsonConstraint:
    """One request's grammar state. Used by one thread at a time (the engine's)."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_ids: Sequence[int]) -> None:
        self.matcher = matcher
        self.eos_ids = list(eos_ids)

    def allowed(self, draft: Sequence[int], vocab_size: int) -> torch.Tensor:
        """[len(draft) + 1, V] bool; row i = tokens allowed after committed + draft[:i].

        Only the valid prefix of the draft is walked (consuming a forbidden token would put the
        matcher in a permanent error state); rows past it repeat the last computed row, since
        verification stops at that token anyway. The walk stops at a drafted EOS too: the engine
        stops there when it is accepted.
        """
        eos = set(self.eos_ids)
        prefix = []
        for token in draft:
            if token in eos:
                break
            prefix.append(token)
        n_valid = self.matcher.validate_tokens(prefix) if prefix else 0
        rows = torch.empty(len(draft) + 1, vocab_size, dtype=torch.bool)  # [k+1, V]
        for i in range(n_valid):
            rows[i] = self._mask(vocab_size)
            if not self.matcher.consume_token(prefix[i]):
                raise QuickdraftError("the grammar refused a token it had validated")
        rows[n_valid:] = self._mask(vocab_size)
        if n_valid and not self.matcher.rollback(n_valid):
            raise QuickdraftError(f"the grammar could not roll back: {self.matcher.get_error()}")
        return rows

    def commit(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            if token in self.eos_ids and self.matcher.is_accepting():
                continue  # the end; llguidance needs no EOS to be consumed
            self.matcher.consume_token(token)  # a refused one leaves the error state: EOS only

    def is_finished(self) -> bool:
        return self.matcher.is_stopped()

    def _mask(self, vocab_size: int) -> torch.Tensor:  # [V] bool
        if self.matcher.is_error():  # cannot happen through the engine; end the output cleanly
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            mask[self.eos_ids] = True
            return mask
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:vocab_size]
        out = torch.zeros(vocab_size, dtype=torch.bool)
        out[: allowed.shape[0]] = torch.from_numpy(allowed.astype(np.bool_))
        return out
