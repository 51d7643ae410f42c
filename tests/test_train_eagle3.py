"""``quickdraft train-eagle3``: data, feature capture, draft vocabulary, TTT training, resume, CLI.

Everything runs on a tiny random llama (3 layers, hidden 64, ~300-token vocabulary) and on a few
Python files written to a temp folder or read from the standard library, so the file takes
seconds and needs no network.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tiny import IM_END_ID, make_tiny_hf_model

from quickdraft.cli.main import main
from quickdraft.config import resolve_device
from quickdraft.errors import QuickdraftError
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.speculative.eagle3.head import Eagle3Config
from quickdraft.speculative.eagle3.io import load_head
from quickdraft.train import data as data_mod
from quickdraft.train.capture import FeatureSet, capture_features, plan_shards
from quickdraft.train.eagle3 import (
    TrainConfig,
    Trainer,
    autocast,
    chain_tau,
    collate,
    epoch_batches,
    init_head,
    lr_at,
    ttt_loss,
    unroll,
)
from quickdraft.train.vocab import (
    build_vocab,
    select_tokens,
    special_ids,
    target_to_draft,
    token_counts,
    vocab_maps,
)

AUX = (0, 1, 2)
CODE = [
    "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n",
    "for i in range(10):\n    print(i, i * i, i ** 3)\n" * 3,
    "import os, sys, json\nfrom pathlib import Path\n\nprint(json.dumps({'a': 1, 'b': [2, 3]}))\n",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny ops: one thread avoids OpenMP hand-offs that dominate (and stall on a busy machine).
    Also makes captures and direct forwards use the same kernels (the CLI calls pass --threads 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama", num_hidden_layers=3)


@pytest.fixture(scope="module")
def loaded(tiny: Path) -> LoadedModel:
    return load_model(str(tiny), dtype="float32", max_context=128)


@pytest.fixture(scope="module")
def sequences() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = [40, 33, 64, 20, 51, 64, 28, 45]
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def features(loaded: LoadedModel, sequences: list[list[int]], tmp_path_factory: pytest.TempPathFactory) -> FeatureSet:
    out = tmp_path_factory.mktemp("features")
    return capture_features(loaded.model, sequences, out, AUX, topk=4, shard_tokens=100, progress=False)


def head_for(loaded: LoadedModel, features: FeatureSet, draft_vocab: int = 128, seed: int = 0):  # type: ignore[no-untyped-def]
    cfg = Eagle3Config.for_target(loaded.config, AUX, draft_vocab, intermediate_size=96)
    counts = token_counts(loaded.config.vocab_size, features.labels(), features.tokens())
    d2t, _ = build_vocab(counts, draft_vocab, special_ids(loaded.tokenizer))
    return init_head(cfg, loaded.model, d2t, seed=seed, max_len=128)


def embed_of(loaded: LoadedModel) -> torch.Tensor:
    return loaded.model.model.embed_tokens.weight.detach().float()


# ------------------------------------------------------------------------------------ data


def test_benchmark_sets_are_refused() -> None:
    for name in ("humaneval", "HumanEval", "mt-bench", "mtbench", "MT_Bench", "human-eval"):
        with pytest.raises(QuickdraftError, match="refusing to train"):
            data_mod.parse_sources(f"stdlib,{name}")
    with pytest.raises(QuickdraftError, match="unknown training data 'wikipedia'"):
        data_mod.parse_sources("stdlib,wikipedia")
    assert data_mod.parse_sources(" stdlib, ShareGPT,stdlib ,gsm8k") == ("stdlib", "sharegpt", "gsm8k")


def test_cli_refuses_benchmark_data_before_loading(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = main(["train-eagle3", "--target", "no-such-model", "--out", str(out), "--data", "stdlib,mt-bench", "-q", "--threads", "1"])
    assert rc == 2
    assert "refusing to train on MT-bench" in capsys.readouterr().err
    assert not out.exists()  # nothing written for a refused run


def test_truncated_json_array_keeps_whole_objects() -> None:
    text = '[\n {"id": "a", "v": [1, 2]},\n {"id": "b", "v": "x, ]"},\n {"id": "c", "v": [3'
    assert [o["id"] for o in data_mod.read_json_objects(text)] == ["a", "b"]
    assert [o["id"] for o in data_mod.read_json_objects('[{"id": 1}, {"id": 2}]')] == [1, 2]


def test_sharegpt_turns_become_alternating_messages() -> None:
    conv = [
        {"from": "gpt", "value": "ignored opener"},
        {"from": "human", "value": "Q1"},
        {"from": "gpt", "value": "A1"},
        {"from": "human", "value": "Q2"},
        {"from": "human", "value": "Q2 again"},  # breaks the alternation: the conversation ends before
        {"from": "gpt", "value": "A2"},
    ]
    assert data_mod.sharegpt_messages(conv) == (
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
    )
    assert data_mod.sharegpt_messages([{"from": "human", "value": "only a question"}]) == ()


def _code_dir(tmp_path: Path) -> Path:
    root = tmp_path / "lib"
    (root / "test").mkdir(parents=True)
    for i, text in enumerate(CODE):
        (root / f"m{i}.py").write_text(text)
    (root / "test" / "test_x.py").write_text("assert False\n")  # tests are left out
    return root


def test_stdlib_files_are_sorted_and_skip_tests(tmp_path: Path) -> None:
    root = _code_dir(tmp_path)
    assert [p.name for p in data_mod.stdlib_files(root)] == ["m0.py", "m1.py", "m2.py", "m3.py"]
    order = [s.id for s in data_mod.iter_source("stdlib", seed=1, stdlib_dir=root)]
    assert order == [s.id for s in data_mod.iter_source("stdlib", seed=1, stdlib_dir=root)]
    assert sorted(order) == ["m0.py", "m1.py", "m2.py", "m3.py"]


def test_sequences_balance_sources_cut_and_regenerate(
    tmp_path: Path, loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    alpaca = tmp_path / "outputs.json"
    rows = [{"instruction": f"Say {w} twice.", "output": f"{w} {w}"} for w in ("hello", "fox", "stack", "json")]
    alpaca.write_text(json.dumps(rows))
    monkeypatch.setattr(data_mod, "fetch_file", lambda source, progress=True: alpaca)
    tok = loaded.tokenizer
    calls: list[list[int]] = []

    def generate(prompt: list[int], max_new: int) -> list[int]:
        calls.append(prompt)
        return [5, 6, 7, IM_END_ID]

    cache = tmp_path / "regen.jsonl"
    code = _code_dir(tmp_path)
    records = data_mod.build_sequences(
        tok, ("stdlib", "alpaca"), max_tokens=200, seq_len=64, seed=0, regenerate=2, generate=generate,
        regen_cache=cache, progress=False, stdlib_dir=code,
    )
    assert 200 - data_mod.MIN_SEQ_LEN < sum(len(r.tokens) for r in records) <= 200
    assert all(len(r.tokens) <= 64 for r in records)
    by_source = {s: sum(len(r.tokens) for r in records if r.source == s) for s in ("stdlib", "alpaca")}
    assert abs(by_source["stdlib"] - by_source["alpaca"]) <= 64  # balanced to within one sequence
    regen = [r for r in records if r.regenerated]
    assert len(regen) == 2 and len(calls) == 2
    for r, prompt in zip(regen, calls, strict=True):
        assert list(r.tokens) == prompt + [5, 6, 7, IM_END_ID]
        assert prompt == tok.encode_chat([{"role": "user", "content": json.loads(alpaca.read_text())[int(r.id)]
                                           ["instruction"]}], add_generation_prompt=True)
    plain = [r for r in records if r.source == "alpaca" and not r.regenerated]
    assert plain and all(IM_END_ID in r.tokens for r in plain)  # rendered with the chat template
    # a second build reuses the cached answers instead of asking the target again
    again = data_mod.build_sequences(
        tok, ("stdlib", "alpaca"), max_tokens=200, seq_len=64, seed=0, regenerate=2, generate=generate,
        regen_cache=cache, progress=False, stdlib_dir=code,
    )
    assert again == records and len(calls) == 2
    path = tmp_path / "seq.jsonl"
    data_mod.save_sequences(path, records)
    assert data_mod.load_sequences(path) == records


# ------------------------------------------------------------------------------------ capture


def test_capture_equals_a_direct_forward(loaded: LoadedModel, sequences: list[list[int]], features: FeatureSet) -> None:
    assert len(features) == len(sequences) and features.num_tokens == sum(map(len, sequences))
    assert len(features.manifest["shards"]) == len(plan_shards([len(s) for s in sequences], 100)) > 1
    model = loaded.model
    for i, seq in enumerate(sequences):
        ids = torch.tensor(seq)
        logits, captured = model(ids, model.make_cache(len(seq)), capture=AUX)
        row = features.get(i)
        assert torch.equal(row["tokens"], ids)
        assert torch.equal(row["features"], torch.cat(captured, -1).to(torch.bfloat16))
        assert torch.equal(row["top_ids"][:, 0], logits.argmax(-1))
        expected = torch.log_softmax(logits, -1).gather(1, row["top_ids"])
        assert torch.allclose(row["top_logprobs"], expected, atol=2e-2)
        assert bool((row["top_logprobs"][:, :-1] >= row["top_logprobs"][:, 1:]).all())


def test_capture_resumes_missing_shards_and_refuses_stale_ones(
    loaded: LoadedModel, sequences: list[list[int]], features: FeatureSet, tmp_path: Path
) -> None:
    out = tmp_path / "f"
    capture_features(loaded.model, sequences, out, AUX, topk=4, shard_tokens=100, progress=False)
    first = out / features.manifest["shards"][1]
    before = first.read_bytes()
    first.unlink()
    stamp = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    again = capture_features(loaded.model, sequences, out, AUX, topk=4, shard_tokens=100, progress=False)
    assert first.read_bytes() == before
    assert all(p.stat().st_mtime_ns == stamp[p.name] for p in out.glob("shard-*") if p.name in stamp)
    assert torch.equal(again.get(3)["features"], features.get(3)["features"])
    with pytest.raises(QuickdraftError, match="other sequences or settings"):
        capture_features(loaded.model, sequences[:-1], out, AUX, topk=4, shard_tokens=100, progress=False)
    with pytest.raises(QuickdraftError, match="aux layers"):
        capture_features(loaded.model, sequences, tmp_path / "g", (2, 1), topk=4, progress=False)


# ------------------------------------------------------------------------------------ vocab


def test_vocab_maps_follow_the_layout() -> None:
    counts = torch.zeros(50, dtype=torch.long)
    counts[[7, 3, 40, 12, 9]] = torch.tensor([100, 50, 50, 10, 1])
    selected = select_tokens(counts, 6, always=[0, 45])
    # specials first, then by count, ties to the smaller id
    assert selected.tolist() == [0, 3, 7, 12, 40, 45]
    d2t, t2d = vocab_maps(selected, 50)
    draft = torch.arange(6)
    assert torch.equal(draft + d2t[draft], selected)  # target_id = draft_id + d2t[draft_id]
    assert bool((d2t[1:] >= d2t[:-1]).all()) and int(d2t[0]) == 0
    assert t2d.dtype == torch.bool and t2d.sum() == 6 and bool(t2d[selected].all())
    index = target_to_draft(t2d)
    assert torch.equal(index[selected], draft) and bool((index[~t2d] == -1).all())
    # a vocabulary larger than the tokens seen is filled with the smallest unseen ids
    assert select_tokens(counts, 8).tolist() == [0, 1, 2, 3, 7, 9, 12, 40]
    with pytest.raises(QuickdraftError, match="--draft-vocab"):
        select_tokens(counts, 51)
    with pytest.raises(QuickdraftError, match="special tokens"):
        select_tokens(counts, 1, always=[0, 1])


def test_vocab_of_captured_data_keeps_specials(loaded: LoadedModel, features: FeatureSet) -> None:
    counts = token_counts(loaded.config.vocab_size, features.labels(), features.tokens())
    assert int(counts.sum()) == 2 * features.num_tokens
    specials = special_ids(loaded.tokenizer)
    assert {0, 1, 2} <= set(specials)
    _, t2d = build_vocab(counts, 64, specials)
    assert bool(t2d[specials].all())
    frequent = torch.argsort(-counts, stable=True)[: 64 - len(specials)]
    assert bool(t2d[frequent].all())


# ------------------------------------------------------------------------------------ training


def test_training_lowers_the_loss(loaded: LoadedModel, features: FeatureSet) -> None:
    cfg = TrainConfig(batch_size=4, lr=3e-3, warmup=0.0, schedule="constant", ttt_steps=3, eval_fraction=0.0)
    head = head_for(loaded, features)
    embed = embed_of(loaded)
    batch = collate(features, [0, 1, 2, 3])
    before, stats0 = ttt_loss(head, batch, embed, cfg)
    assert stats0.counted == [int(((batch.valid.sum(1) - 1 - s).clamp(min=0)).sum()) for s in range(3)]
    trainer = Trainer(head, features, embed, cfg, progress=False)
    for _ in range(25):
        trainer.train_step([0, 1, 2, 3])
    after, stats = ttt_loss(head, batch, embed, cfg)
    assert float(after.detach()) < 0.5 * float(before.detach())
    assert all(a > b for a, b in zip(stats.accuracy(), stats0.accuracy(), strict=True))


def test_kl_loss_trains_too(loaded: LoadedModel, features: FeatureSet) -> None:
    cfg = TrainConfig(batch_size=4, lr=3e-3, warmup=0.0, schedule="constant", loss="kl", eval_fraction=0.0)
    head = head_for(loaded, features)
    embed = embed_of(loaded)
    batch = collate(features, [4, 5, 6, 7])
    before, _ = ttt_loss(head, batch, embed, cfg)
    trainer = Trainer(head, features, embed, cfg, progress=False)
    for _ in range(15):
        trainer.train_step([4, 5, 6, 7])
    assert ttt_loss(head, batch, embed, cfg)[1].loss < 0.7 * float(before.detach())


def test_unroll_matches_drafting_with_the_kv_cache(loaded: LoadedModel, features: FeatureSet) -> None:
    """Unroll step s at row t must compute what the head computes at inference when it drafts s
    tokens past position t: rows 0..t fed with target features (step 0), then each later row fed
    with the previous row's own h and the next token, attending through the KV cache."""
    head = head_for(loaded, features)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))  # break the init's symmetries
    embed = embed_of(loaded)
    batch = collate(features, [2, 0])  # sequence 2 is the longest: sequence 0 is padded
    steps = list(unroll(head, batch, embed, 3))
    for b in range(2):
        n = int(batch.valid[b].sum())
        tokens = batch.tokens[b, :n]
        fused = torch.nn.functional.linear(batch.features[b, :n], head.fc.weight)
        for t in (0, 7, n - 4):
            cache = head.new_cache(n + 4)
            logits, h = head(embed[tokens[1 : t + 2]], fused[: t + 1], cache)  # rows 0..t
            for s in range(3):
                assert bool(steps[s].rows[b, t])
                assert int(steps[s].labels[b, t]) == int(batch.top_ids[b, t + 1 + s, 0])
                torch.testing.assert_close(steps[s].logits[b, t], logits[-1], atol=1e-4, rtol=1e-4)
                if s < 2:  # draft on: own h of the last row, embedding of token t+2+s, next slot
                    logits, h = head(embed[tokens[t + 2 + s]][None], h[-1:], cache)
        assert not bool(steps[0].rows[b, n - 1]) and not bool(steps[2].rows[b, n - 3])


def test_schedule_and_batches_are_deterministic() -> None:
    cfg = TrainConfig(lr=1.0, warmup=0.1, schedule="cosine")
    lrs = [lr_at(s, 100, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0) and lrs[-1] < 0.01
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    lin = TrainConfig(lr=1.0, warmup=0.0, schedule="linear")
    assert lr_at(50, 100, lin) == pytest.approx(0.5)
    lengths = list(range(10, 50))
    a = epoch_batches(range(40), lengths, 4, seed=3, epoch=0)
    assert a == epoch_batches(range(40), lengths, 4, seed=3, epoch=0)
    assert a != epoch_batches(range(40), lengths, 4, seed=3, epoch=1)
    assert sorted(i for b in a for i in b) == list(range(40))
    assert chain_tau([1.0, 1.0]) == 3.0 and chain_tau([0.5, 0.5]) == pytest.approx(1.75)


def test_resume_gives_the_same_parameters(loaded: LoadedModel, features: FeatureSet, tmp_path: Path) -> None:
    cfg = TrainConfig(epochs=2, batch_size=3, lr=1e-3, warmup=0.2, eval_fraction=0.2, save_every=0)
    embed = embed_of(loaded)
    whole = Trainer(head_for(loaded, features), features, embed, cfg, tmp_path / "a", progress=False)
    result = whole.run()
    assert result.finished and result.state.step == whole.total_steps == 4  # 6 train sequences / 3, 2 epochs
    assert result.state.epoch == 1 and result.eval is not None and result.eval_sequences == 2

    first = Trainer(head_for(loaded, features), features, embed, cfg, tmp_path / "b", progress=False)
    partial = first.run(stop_after=3)  # into the second epoch
    assert not partial.finished and partial.state.step == 3
    second = Trainer(head_for(loaded, features, seed=5), features, embed, cfg, tmp_path / "b", progress=False)
    assert second.load_checkpoint() and second.state.step == 3
    resumed = second.run()
    assert resumed.state.step == 4 and resumed.state.tokens_seen == result.state.tokens_seen
    for (name, p), (_, q) in zip(whole.head.state_dict().items(), second.head.state_dict().items(), strict=True):
        assert torch.equal(p, q), name
    other = Trainer(head_for(loaded, features), features, embed, TrainConfig(lr=2e-3), tmp_path / "b", progress=False)
    with pytest.raises(QuickdraftError, match="other settings"):
        other.load_checkpoint()


# ------------------------------------------------------------------------------------ CLI


def test_cli_end_to_end(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "head"
    argv = ["train-eagle3", "--target", str(tiny), "--out", str(out), "--data", "stdlib", "--max-tokens", "400",
            "--seq-len", "64", "--draft-vocab", "96", "--intermediate-size", "80", "--batch-size", "2",
            "--epochs", "2", "--ttt-steps", "2", "--eval-fraction", "0.2", "-q", "--threads", "1"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out)
    assert "top-1 accuracy per draft position" in captured.err
    model = load_model(str(tiny), dtype="float32").model
    head, info = load_head(out, model)
    assert head.config.aux_layers == (0, 1, 2) and info.aux_layers == (0, 1, 2)
    assert head.config.draft_vocab_size == 96 and head.config.intermediate_size == 80
    assert int(head.t2d.sum()) == 96 and bool(head.t2d[[0, 1, 2]].all())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
        assert f.get_tensor("d2t").dtype == torch.int64
    log = json.loads((out / "train_log.json").read_text())
    assert log["data"]["tokens"] == 400 == log["capture"]["tokens"]
    assert log["training"]["steps"] == log["training"]["total_steps"] > 0
    assert log["training"]["tokens_seen"] > 0 and log["wall_seconds"]["total"] > 0
    assert len(log["training"]["eval_accuracy_per_step"]) == 2

    assert main(argv) == 2  # the folder is taken: resume or choose another
    assert "--resume" in capsys.readouterr().err
    assert main([*argv, "--resume"]) == 0  # nothing left to do: writes the same head again
    capsys.readouterr()
    assert main([*argv, "--lr", "0.1", "--resume"]) == 2
    assert "trained with other settings (lr)" in capsys.readouterr().err
    assert main([*argv, "--seq-len", "32", "--resume"]) == 2
    assert "other options (seq_len)" in capsys.readouterr().err


def test_cli_friendly_errors(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["train-eagle3", "--target", "no-such-model", "--out", str(tmp_path / "x"), "--data", "stdlib", "-q", "--threads", "1"])
    assert rc == 2 and "unknown model 'no-such-model'" in capsys.readouterr().err
    rc = main(["train-eagle3", "--target", str(tiny), "--out", str(tmp_path / "y"), "--resume", "-q", "--threads", "1"])
    assert rc == 2 and "nothing to resume" in capsys.readouterr().err
    rc = main(["train-eagle3", "--target", str(tiny), "--out", str(tmp_path / "z"), "--ttt-steps", "0", "-q", "--threads", "1"])
    assert rc == 2 and "--ttt-steps" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ precision, device


def test_bf16_autocast_trains_with_float32_weights(loaded: LoadedModel, features: FeatureSet) -> None:
    cfg = TrainConfig(batch_size=4, lr=3e-3, warmup=0.0, schedule="constant", eval_fraction=0.0,
                      train_dtype="bfloat16")
    head = head_for(loaded, features)
    embed = embed_of(loaded)
    batch = collate(features, [0, 1, 2, 3])
    before, _ = ttt_loss(head, batch, embed, cfg)
    trainer = Trainer(head, features, embed, cfg, progress=False)
    with autocast(cfg, trainer.device):  # the forward really runs in bf16
        logits = next(unroll(head, batch, trainer.embed, 1)).logits
        assert torch.is_autocast_enabled("cpu")
    assert logits.dtype == torch.float32  # the head returns float32 logits either way
    for _ in range(20):
        trainer.train_step([0, 1, 2, 3])
    assert all(p.dtype == torch.float32 for p in head.parameters())  # master weights stay float32
    assert not torch.is_autocast_enabled("cpu")  # nothing leaks out of a step
    assert float(ttt_loss(head, batch, embed, cfg)[0].detach()) < 0.5 * float(before.detach())
    with pytest.raises(QuickdraftError, match="--train-dtype"):
        TrainConfig(train_dtype="float16")


def test_resolve_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    for name in ("cuda", "cuda:0", "CUDA"):
        with pytest.raises(QuickdraftError, match="CUDA is not available"):
            resolve_device(name)
    with pytest.raises(QuickdraftError, match="--device must be one of"):
        resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")


def test_cli_device_cpu_and_missing_cuda(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "head"
    argv = ["train-eagle3", "--target", str(tiny), "--out", str(out), "--data", "stdlib", "--max-tokens", "200",
            "--seq-len", "64", "--draft-vocab", "64", "--intermediate-size", "64", "--batch-size", "2",
            "--epochs", "1", "--ttt-steps", "2", "-q", "--threads", "1"]
    assert main([*argv, "--device", "cpu", "--train-dtype", "bfloat16"]) == 0
    captured = capsys.readouterr()
    assert "(float32, cpu)" in captured.err and captured.out.strip() == str(out)
    log = json.loads((out / "train_log.json").read_text())
    assert log["training"]["steps"] == log["training"]["total_steps"] > 0
    assert log["options"]["train"]["train_dtype"] == "bfloat16" and "device" not in log["options"]
    # the device is not part of the run: a resume may name another one
    assert main([*argv, "--device", "auto", "--train-dtype", "bfloat16", "--resume"]) == 0
    capsys.readouterr()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without CUDA
    fresh = tmp_path / "cuda"
    argv[argv.index(str(out))] = str(fresh)
    assert main([*argv, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda: CUDA is not available" in err and "use --device cpu" in err
    assert "Traceback" not in err and not fresh.exists()  # refused before loading or writing anything
    assert main([*argv, "--device", "gpu"]) == 2
    assert "--device must be one of auto, cpu, cuda" in capsys.readouterr().err
