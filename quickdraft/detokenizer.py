"""Streaming detokenization: generated ids to text pieces that never split a character."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from quickdraft.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text pieces, never splitting a UTF-8 character.

    Decoding each token alone is wrong: a character can span several byte-level tokens, and
    sentencepiece-style decoders treat a leading space differently at the start of a text. So
    each push decodes a short window that starts one emitted chunk back and returns only what
    lies past the text already handed out; if the window ends in U+FFFD (an incomplete
    character) the text is held back until the next push or :meth:`flush`. The pieces joined
    equal ``tokenizer.decode(all_ids, skip_special_tokens)``.

    ``prompt_ids`` are accepted for callers that have them but do not change the text: the
    stream is defined as the decode of the generated ids alone (what transformers' streamers
    print with ``skip_prompt=True``).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.prompt_len = len(prompt_ids)
        self._ids: list[int] = []
        self._prefix = 0  # window start: one chunk before the first unread id
        self._read = 0  # ids before this have had their text handed out
        self._prefix_text = ""  # decode of ids[_prefix:_read]

    @property
    def ids(self) -> list[int]:
        """Every id pushed so far."""
        return list(self._ids)

    def push(self, ids: Sequence[int]) -> str:
        """Add generated ids; return the new text that is safe to show now (maybe "")."""
        self._ids.extend(int(i) for i in ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Return whatever was held back (at the end of generation), even an incomplete char."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        window = self._decode(self._prefix, len(self._ids))
        if not final and window.endswith("\ufffd"):
            return ""
        new_text = window[len(self._prefix_text) :]
        if final:  # a later push starts afresh instead of rewriting a flushed U+FFFD
            self._prefix = self._read = len(self._ids)
            self._prefix_text = ""
        else:
            self._prefix, self._read = self._read, len(self._ids)
            self._prefix_text = self._decode(self._prefix, self._read)
        return new_text

    def _decode(self, start: int, stop: int) -> str:
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=self._skip)


# ------------------------------------------------------------------------------ chat templates
