"""Stop conditions applied token by token to an accepted run: EOS, stop ids, max_tokens, stop strings.

Kept apart from verification (which only decides which tokens the target accepts), so a stop that
falls in the middle of an accepted run truncates it exactly where plain decoding would have stopped.
Stop strings are removed from the returned text (OpenAI semantics); text that might be the start of
a stop string is held back until it is known not to be one.
"""

from __future__ import annotations

from collections.abc import Sequence

from quickdraft.detokenizer import IncrementalDetokenizer
from quickdraft.sampling import SamplingParams
from quickdraft.tokenizer import Tokenizer


class StopChecker:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_ids: Sequence[int]) -> None:
        self.params = params
        self.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids |= set(tokenizer.eos_ids)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.text = ""  # all output text decoded so far
        self.emitted = 0  # characters of self.text already returned
        self.num_tokens = 0
        self.finish_reason: str | None = None

    def add(self, token: int) -> str:
        """Take one generated token; return the text that is now safe to show."""
        self.num_tokens += 1
        if token in self.stop_ids:
            self.finish_reason = "stop"
            self.text += self.detok.flush()
            return self._release(final=True)
        self.text += self.detok.push([token])
        if self.params.stop and self._find_stop():
            return self._release(final=True)
        if self.num_tokens >= self.params.max_tokens:
            self.finish_reason = "length"
            self.text += self.detok.flush()
            return self._release(final=True)
        return self._release(final=False)

    def _find_stop(self) -> bool:
        start = max(0, self.emitted - self.hold)
        hits = [i for i in (self.text.find(s, start) for s in self.params.stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        self.finish_reason = "stop"
        return True

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
