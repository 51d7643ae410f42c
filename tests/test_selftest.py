"""``quickdraft selftest`` as a user runs it: PASS (exit 0) where every drafter is lossless, and a
MISMATCH line with exit 1 where speculation changes the output."""

from __future__ import annotations

from pathlib import Path

import pytest

from quickdraft import engine
from quickdraft.cli.main import main
from quickdraft.speculative.verify import Draft, Verdict

ARGS = ["selftest", "--draft", "ngram", "--max-tokens", "24", "--trials", "2000",
        "--prompt", "Repeat after me three times: the quick brown fox jumps over the lazy dog."]


def test_selftest_passes_on_a_real_model(smollm2_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--model", str(smollm2_gguf)]) == 0
    out = capsys.readouterr().out
    assert "greedy  ngram (k=4)" in out and "identical over 24 tokens" in out
    assert "seeded  ngram" in out and "MISMATCH" not in out
    assert "decode roofline:" in out and "sampling first-token TV to p" in out
    assert out.rstrip().endswith("selftest: PASS (lossless)")


def test_selftest_fails_when_speculation_changes_the_output(
    smollm2_gguf: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verifier that accepts every drafted token (the bug selftest exists to catch)."""

    def accept_all(target_tokens, draft: Draft) -> Verdict:  # type: ignore[no-untyped-def]
        tokens = draft.tokens.to(target_tokens.device)
        return Verdict(tokens=target_tokens.new_tensor([*tokens.tolist(), int(target_tokens[-1])]),
                       num_accepted=draft.k)

    monkeypatch.setattr(engine, "verify_greedy", accept_all)
    assert main([*ARGS, "--model", str(smollm2_gguf)]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "first difference at token" in out
    assert out.rstrip().endswith("selftest: FAIL")


def test_selftest_without_a_drafter_says_what_to_pick(smollm2_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["selftest", "--draft", "none", "--model", str(smollm2_gguf)]) == 1
    assert "--draft none: nothing to test" in capsys.readouterr().err
