"""Prompt sets in the bench shape: ``{"question_id": int, "category": str, "turns": [str, ...]}`` per JSON line.

Five sets ship inside the package (``data/``, attribution in ``data/SOURCES.md``): GSM8K, HumanEval, MATH-500,
Alpaca and MT-Bench (two turns). Users add their own files in the same shape; a malformed file raises
:class:`PromptFileError` naming the file, the line and the reason (the CLI prints it as one line).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

# Blog order (§8 table) and display names.
BUNDLED_SETS: dict[str, str] = {
    "gsm8k": "GSM8K",
    "humaneval": "HumanEval",
    "math500": "MATH500",
    "alpaca": "Alpaca",
    "mt_bench": "MT-Bench",
}
DEFAULT_LIMIT = 80  # the blog takes the first 80 entries of each set


class PromptFileError(ValueError):
    """A prompt file that is not in the bench shape; the message is ``FILE:LINE: reason``."""

    def __init__(self, path: str | Path, line: int | None, reason: str) -> None:
        self.path, self.line, self.reason = str(path), line, reason
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {reason}")


@dataclass
class BenchPrompt:
    """One conversation: the user turns are asked in order, each after the model's own previous answer."""

    question_id: int | str
    category: str
    turns: list[str]


@dataclass
class PromptSet:
    """A named list of prompts and where it came from (``bundled:<name>`` or a file path)."""

    name: str
    display_name: str
    source: str
    prompts: list[BenchPrompt] = field(default_factory=list)

    @property
    def num_turns(self) -> int:
        """Total user turns (= requests per strategy)."""
        return sum(len(p.turns) for p in self.prompts)


def bundled_data_dir() -> Path:
    """Directory of the bundled prompt files (package data)."""
    return Path(str(resources.files("dmtp_hf.evaluation").joinpath("data")))


def parse_prompt_lines(lines: list[str], source: str | Path, limit: int | None = None) -> list[BenchPrompt]:
    """Parse JSON lines in the bench shape (blank lines are skipped); raises :class:`PromptFileError`."""
    prompts: list[BenchPrompt] = []
    for number, raw in enumerate(lines, start=1):
        if limit is not None and len(prompts) >= limit:
            break
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as err:
            raise PromptFileError(source, number, f"invalid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(row, dict):
            raise PromptFileError(source, number, f"expected a JSON object, got {type(row).__name__}")
        if "turns" not in row:
            raise PromptFileError(source, number, 'missing "turns" (a list of user messages)')
        turns = row["turns"]
        if not isinstance(turns, list) or not turns:
            raise PromptFileError(source, number, '"turns" must be a non-empty list of strings')
        for index, turn in enumerate(turns):
            if not isinstance(turn, str) or not turn.strip():
                raise PromptFileError(source, number, f'"turns"[{index}] must be a non-empty string')
        question_id = row.get("question_id", number - 1)
        if not isinstance(question_id, int | str) or isinstance(question_id, bool):
            raise PromptFileError(source, number, '"question_id" must be an integer or a string')
        category = row.get("category", "")
        if not isinstance(category, str):
            raise PromptFileError(source, number, '"category" must be a string')
        prompts.append(BenchPrompt(question_id, category, list(turns)))
    if not prompts:
        raise PromptFileError(source, None, "no prompts found (expected JSON lines with a 'turns' list)")
    return prompts


def load_prompt_file(path: str | Path, name: str | None = None, limit: int | None = DEFAULT_LIMIT) -> PromptSet:
    """Load a user prompt file (JSON lines, bench shape); the set is named after the file unless ``name``."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(path, None, "no such prompt file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise PromptFileError(path, None, f"not UTF-8 text ({err.reason})") from None
    name = name or path.stem
    return PromptSet(name, name, str(path), parse_prompt_lines(lines, path, limit))


def load_bundled_set(name: str, limit: int | None = DEFAULT_LIMIT) -> PromptSet:
    """One of :data:`BUNDLED_SETS`, first ``limit`` prompts."""
    if name not in BUNDLED_SETS:
        raise ValueError(f"Unknown bundled prompt set {name!r}; choose from {', '.join(BUNDLED_SETS)}.")
    path = bundled_data_dir() / f"{name}.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines()
    return PromptSet(name, BUNDLED_SETS[name], f"bundled:{name}", parse_prompt_lines(lines, path, limit))


def resolve_prompt_sets(
    datasets: list[str] | None, files: list[str | Path] | None = None, limit: int | None = DEFAULT_LIMIT
) -> list[PromptSet]:
    """The bundled sets named in ``datasets`` (``None``: all five; ``[]``: none), then the user ``files``.

    User files keep their stem as name; a clash with another set gets a numeric suffix so results never merge.
    """
    files = list(files or [])
    datasets = list(BUNDLED_SETS) if datasets is None else datasets
    sets = [load_bundled_set(name, limit) for name in datasets]
    taken = {s.name for s in sets}
    for file in files:
        stem = Path(file).stem
        name, suffix = stem, 2
        while name in taken:
            name, suffix = f"{stem}_{suffix}", suffix + 1
        taken.add(name)
        sets.append(load_prompt_file(file, name, limit))
    if not sets:
        raise ValueError("No prompt sets selected: name bundled sets with --datasets or pass --prompts FILE.")
    return sets
