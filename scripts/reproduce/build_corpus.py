"""Build the offline, license-clean corpus of the bundled target: Python stdlib source (PSF) + chitchat (MIT).

Outputs (default ``outputs/corpus/``), all JSONL, deterministic for a given Python version and package versions:

- ``train_code.jsonl`` / ``heldout_code_text.jsonl``: ``{"id", "text"}`` raw stdlib source files (pretraining text).
- ``train_code_chat.jsonl`` / ``heldout_code.jsonl``: code requests as chats, OpenAI ``messages`` (user asks for a
  function by name, signature and docstring; the assistant answers with its source in a fenced block).
- ``train_chat.jsonl`` / ``heldout_chat.jsonl``: chitchat conversations as ``messages`` (first speaker = user).
- ``train_chat_2turn.jsonl``: the first ``user, assistant, user`` messages of each training chat (ids ``...#2turn``),
  the shape of the held-out chat prompts; ``dmtp regenerate`` answers both user turns with the target. (Whole
  chitchat conversations run to dozens of turns: regenerating them turn by turn is far too slow on a CPU.)
- ``bench/code_question.jsonl`` / ``bench/chat_question.jsonl``: held-out prompts in the MT-Bench question shape
  ``{"question_id", "category", "turns": [...]}``.
- ``stats.json``: document counts per split and the sources with their versions.

The split is by *source document* (a stdlib file, a chitchat conversation), decided by a hash of its id, so held-out
functions never appear in the training text, not even as part of their file.

Usage::

    nice -n 19 .venv/bin/python scripts/reproduce/build_corpus.py --out outputs/corpus
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

CHITCHAT = "chitchat-dataset==0.9.0"
CHITCHAT_WHEEL = "chitchat_dataset-0.9.0-py3-none-any.whl"
CHITCHAT_FILE = "chitchat_dataset/dataset.json"
# Stdlib directories that are tests, demos or vendored third-party code (not PSF stdlib source proper).
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3", "Tools"}
MAX_CODE_FILE_BYTES = 200_000  # a few generated tables (e.g. unicode data) would dominate the code corpus
# Percent of source documents held out: stdlib files are few and uneven in size, so code holds out more.
HELDOUT_PERCENT = {"code": 6, "chat": 3}
# Code-as-chat functions: long enough to be a real request, short enough to fit a 512-token training window.
MIN_FUNCTION_LINES, MAX_FUNCTION_LINES = 4, 40
MAX_HELDOUT_BENCH = 200


def in_heldout(doc_id: str, percent: int) -> bool:
    """Deterministic split: a document is held out when the SHA-1 of its id falls in the first ``percent`` %."""
    return int(hashlib.sha1(doc_id.encode("utf-8")).hexdigest()[:8], 16) % 100 < percent


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write ``rows`` as JSON lines (UTF-8, non-ASCII kept)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------------------------------------------
# Code: the running interpreter's stdlib


def stdlib_files(stdlib: Path) -> list[Path]:
    """The stdlib ``.py`` files, tests and vendored packages excluded, sorted by relative path."""
    files = []
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib)
        if any(part in EXCLUDED_DIRS for part in relative.parts[:-1]) or relative.name.startswith("test_"):
            continue
        if path.stat().st_size > MAX_CODE_FILE_BYTES:
            continue
        files.append(path)
    return files


def module_name(relative: Path) -> str:
    """``email/mime/text.py`` -> ``email.mime.text``; ``json/__init__.py`` -> ``json``."""
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def function_requests(source: str, module: str) -> list[dict]:
    """Code-as-chat examples from the top-level functions and methods of one module that have a docstring.

    The user turn names the function, gives its signature and docstring; the assistant turn is the source.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    examples = []
    scopes: list[tuple[str | None, ast.AST]] = [(None, tree)]
    scopes += [(node.name, node) for node in tree.body if isinstance(node, ast.ClassDef)]
    for class_name, scope in scopes:
        for node in scope.body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            docstring = ast.get_docstring(node)
            if not docstring or node.name.startswith("__"):
                continue
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
            body = textwrap.dedent("\n".join(lines[start : node.end_lineno]))
            if not MIN_FUNCTION_LINES <= body.count("\n") + 1 <= MAX_FUNCTION_LINES:
                continue
            prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
            returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
            signature = f"{prefix} {node.name}({ast.unparse(node.args)}){returns}:"
            summary = docstring.strip().split("\n\n")[0].strip()
            owner = f"method `{class_name}.{node.name}`" if class_name else f"function `{node.name}`"
            request = (
                f"Write the Python {owner} of the `{module}` module.\n\n"
                f"Signature: `{signature}`\n\nDocstring: {summary}"
            )
            examples.append(
                {
                    "id": f"{module}:{class_name + '.' if class_name else ''}{node.name}",
                    "messages": [
                        {"role": "user", "content": request},
                        {"role": "assistant", "content": f"```python\n{body}\n```"},
                    ],
                }
            )
    return examples


def build_code(stdlib: Path) -> dict[str, list[dict]]:
    """Split the stdlib files by file and build the raw-text and code-as-chat sets of each split."""
    sets: dict[str, list[dict]] = {"train_code": [], "heldout_code_text": [], "train_code_chat": [], "heldout_code": []}
    for path in stdlib_files(stdlib):
        relative = path.relative_to(stdlib)
        try:
            source = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        doc_id = f"stdlib/{relative.as_posix()}"
        held = in_heldout(doc_id, HELDOUT_PERCENT["code"])
        sets["heldout_code_text" if held else "train_code"].append({"id": doc_id, "text": source})
        sets["heldout_code" if held else "train_code_chat"] += function_requests(source, module_name(relative))
    return sets


# ----------------------------------------------------------------------------------------------------------------
# Chat: chitchat-dataset


def fetch_chitchat(cache: Path) -> Path:
    """``pip download --no-deps`` the chitchat wheel into ``cache`` (once) and extract its dataset file."""
    downloads, extracted = cache / "downloads", cache / "extracted"
    wheel = downloads / CHITCHAT_WHEEL
    if not wheel.exists():
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(downloads), CHITCHAT]
        subprocess.run(command, check=True)
    target = extracted / CHITCHAT_FILE
    if not target.exists():
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(CHITCHAT_FILE, extracted)
            for name in archive.namelist():
                if name.endswith(".dist-info/LICENSE"):
                    archive.extract(name, extracted)
    return target


def chitchat_messages(conversation: dict) -> list[dict]:
    """One chitchat conversation as alternating user/assistant turns (the first speaker is the user).

    A chitchat turn is a list of consecutive messages by one sender; they are joined with newlines.
    """
    messages = []
    for turn in conversation["messages"]:
        text = "\n".join(m["text"].strip() for m in turn if m.get("text", "").strip())
        if not text:
            continue
        role = "user" if len(messages) % 2 == 0 else "assistant"
        messages.append({"role": role, "content": text})
    if messages and messages[-1]["role"] == "user":
        messages.pop()  # a chat ends with an answer
    return messages


def build_chat(dataset_file: Path) -> dict[str, list[dict]]:
    """Split chitchat by conversation id into training and held-out ``messages`` sets."""
    data = json.loads(dataset_file.read_text(encoding="utf-8"))
    sets: dict[str, list[dict]] = {"train_chat": [], "heldout_chat": []}  # + train_chat_2turn below
    for conversation_id in sorted(data):
        messages = chitchat_messages(data[conversation_id])
        if len(messages) < 2:
            continue
        row = {"id": f"chitchat/{conversation_id}", "messages": messages}
        sets["heldout_chat" if in_heldout(row["id"], HELDOUT_PERCENT["chat"]) else "train_chat"].append(row)
    sets["train_chat_2turn"] = [
        {"id": f"{row['id']}#2turn", "messages": row["messages"][:3]}
        for row in sets["train_chat"]
        if [m["role"] for m in row["messages"][:3]] == ["user", "assistant", "user"]
    ]
    return sets


# ----------------------------------------------------------------------------------------------------------------
# Bench prompts


def bench_questions(rows: list[dict], category: str, max_turns: int) -> list[dict]:
    """MT-Bench-shaped prompts: the first ``max_turns`` user turns of each held-out chat."""
    questions = []
    for index, row in enumerate(rows[:MAX_HELDOUT_BENCH]):
        turns = [m["content"] for m in row["messages"] if m["role"] == "user"][:max_turns]
        questions.append({"question_id": index + 1, "category": category, "source_id": row["id"], "turns": turns})
    return questions


def spread(rows: list[dict], count: int) -> list[dict]:
    """``count`` rows evenly spaced over ``rows`` (so held-out prompts span many files, not the first few)."""
    if len(rows) <= count:
        return rows
    step = len(rows) / count
    return [rows[int(i * step)] for i in range(count)]


def characters(row: dict) -> int:
    """Characters of a raw-text or ``messages`` row (message contents only)."""
    return len(row["text"]) if "text" in row else sum(len(m["content"]) for m in row["messages"])


def main() -> None:
    """Build the corpus and print its statistics."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/corpus"))
    parser.add_argument("--cache", type=Path, default=Path("outputs/corpus_cache"), help="pip download cache")
    args = parser.parse_args()

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sets = build_code(stdlib)
    sets.update(build_chat(fetch_chitchat(args.cache)))
    for name, rows in sets.items():
        write_jsonl(args.out / f"{name}.jsonl", rows)
    bench = {
        "code": bench_questions(spread(sets["heldout_code"], MAX_HELDOUT_BENCH), "code", 1),
        "chat": bench_questions(sets["heldout_chat"], "chat", 2),
    }
    for category, questions in bench.items():
        write_jsonl(args.out / "bench" / f"{category}_question.jsonl", questions)

    stats = {
        "python": sys.version.split()[0],
        "stdlib": str(stdlib),
        "sources": {"code": f"CPython {sys.version.split()[0]} stdlib (PSF-2.0)", "chat": f"{CHITCHAT} (MIT)"},
        "documents": {name: len(rows) for name, rows in sets.items()},
        "characters": {name: sum(map(characters, rows)) for name, rows in sets.items()},
        "bench_prompts": {category: len(questions) for category, questions in bench.items()},
    }
    (args.out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
