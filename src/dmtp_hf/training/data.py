"""Training data: chat JSONL -> token ids + loss mask over the assistant turns.

Accepted records (one JSON object per line):

* OpenAI: ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}``
* ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}`` (entries in
  ``{"role", "content"}`` form are accepted too)
* pre-tokenized: ``{"input_ids": [...], "loss_mask": [...]}`` (``loss_mask`` optional, default all ones)

Chat records are rendered with the target tokenizer's chat template. The loss mask covers the assistant tokens and
their end-of-turn token(s), never the role headers. Two strategies (``mask_strategy``):

* ``"generation"``: the template marks assistant text with ``{% generation %}``; Transformers returns the mask
  (``return_assistant_tokens_mask``).
* ``"incremental"`` (works with any template that renders history append-only, e.g. Qwen's
  ``<|im_start|>role\\n...<|im_end|>\\n``): render the conversation as text once; for assistant message ``k`` the
  supervised *character* span starts where the rendering of ``messages[:k]`` plus the generation prompt stops
  agreeing with the full text (so the header, and e.g. an empty ``<think></think>`` the prompt injects, stay
  unsupervised) and ends at the length of the rendering of ``messages[:k + 1]``. Tokens are then selected through
  the tokenizer's offset mapping, so BPE merges across span boundaries cannot shift the mask.

``"auto"`` picks ``generation`` when the template contains ``{% generation %}``, else ``incremental``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from transformers import GenerationConfig

from ..bundled import resolve_target_path
from .config import SYNTHETIC_PROMPT_LENGTH, parse_synthetic_source
from .data_checks import LengthReport, check_token_ids, path_fingerprint

if TYPE_CHECKING:
    from .config import TrainConfig

__all__ = [
    "ChatRenderer",
    "TokenizedDataset",
    "collate",
    "conversation_from_record",
    "data_fingerprints",
    "load_dataset_records",
    "load_training_data",
    "mixed_dataset",
    "parse_mix_item",
    "read_jsonl",
    "synthetic_greedy_dataset",
    "training_datasets",
]

_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
}


# ----------------------------------------------------------------------------------------------------
# Reading JSONL


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, record)`` for each non-empty line; malformed lines (invalid JSON, not an object, not
    UTF-8) raise ``ValueError`` naming the file and the line."""
    try:
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{line_no}: invalid JSON ({err.msg} at column {err.colno})") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(record).__name__}")
                yield line_no, record
    except UnicodeDecodeError as err:
        raise ValueError(_not_utf8(path, err)) from None


def _not_utf8(path: str | os.PathLike, err: UnicodeDecodeError) -> str:
    """Where the first byte that is not UTF-8 lies: the text decoder reports an offset into a buffered chunk, not a
    line, so the file is scanned again line by line (only on this error path)."""
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as bad:
                byte = f"0x{line[bad.start : bad.start + 1].hex()} (byte {bad.start + 1} of the line)"
                return f"{path}:{line_no}: byte {byte} is not UTF-8; the file must be UTF-8"
    return f"{path}: not UTF-8 ({err.reason}); the file must be UTF-8"


def conversation_from_record(record: dict[str, Any], where: str = "record") -> list[dict[str, str]]:
    """Normalise an OpenAI ``messages`` or ShareGPT ``conversations`` record to ``[{"role", "content"}, ...]``."""
    turns = record.get("messages", record.get("conversations"))
    if turns is None:
        raise ValueError(f"{where}: no 'messages' or 'conversations' field (keys: {sorted(record)})")
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: 'messages'/'conversations' must be a non-empty list")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ValueError(f"{where}: turn {i} is not an object")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if role is None or content is None:
            raise ValueError(
                f"{where}: turn {i} needs 'role'/'content' (or ShareGPT 'from'/'value'), got {sorted(turn)}"
            )
        if str(role).lower() not in _ROLES:
            raise ValueError(f"{where}: turn {i} has unknown role {role!r}; expected one of {sorted(_ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"{where}: turn {i} content must be a string, got {type(content).__name__}")
        messages.append({"role": _ROLES[str(role).lower()], "content": content})
    return messages


# ----------------------------------------------------------------------------------------------------
# Rendering with the chat template


class ChatRenderer:
    """Turns a conversation into ``input_ids`` and ``loss_mask`` with a tokenizer's chat template.

    Args:
        tokenizer: a Transformers (fast) tokenizer with a chat template.
        enable_thinking: passed to the template as ``enable_thinking`` when not None (Qwen3-style templates).
        max_length: truncate to this many tokens (None: no truncation).
        mask_strategy: ``"auto"``, ``"generation"`` or ``"incremental"`` (see the module docstring).
        chat_template_kwargs: extra template variables.
    """

    def __init__(
        self,
        tokenizer: Any,
        enable_thinking: bool | None = None,
        max_length: int | None = None,
        mask_strategy: str = "auto",
        chat_template_kwargs: dict[str, Any] | None = None,
    ):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("The tokenizer has no chat template; set one or use pre-tokenized records.")
        if mask_strategy == "auto":
            mask_strategy = "generation" if "generation" in _generation_tags(tokenizer.chat_template) else "incremental"
        if mask_strategy not in ("generation", "incremental"):
            raise ValueError(f"mask_strategy must be 'auto', 'generation' or 'incremental', got {mask_strategy!r}")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.mask_strategy = mask_strategy
        self.template_kwargs = dict(chat_template_kwargs or {})
        if enable_thinking is not None:
            self.template_kwargs["enable_thinking"] = enable_thinking

    def render_text(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """The chat template applied to ``messages``, as text."""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.template_kwargs
        )

    def __call__(self, messages: list[dict[str, str]]) -> dict[str, torch.Tensor]:
        """``{"input_ids": [T], "loss_mask": [T]}`` (long tensors) for one conversation."""
        if self.mask_strategy == "generation":
            encoded = self.tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **self.template_kwargs
            )
            input_ids = torch.tensor(encoded["input_ids"], dtype=torch.long)
            loss_mask = torch.tensor(encoded["assistant_masks"], dtype=torch.long)
        else:
            input_ids, loss_mask = self._incremental(messages)
        if self.max_length is not None:
            input_ids, loss_mask = input_ids[: self.max_length], loss_mask[: self.max_length]
        return {"input_ids": input_ids, "loss_mask": loss_mask}

    def assistant_char_spans(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the ``[start, end)`` character spans of the assistant turns (end-of-turn included)."""
        full = self.render_text(messages)
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render_text(messages[:k], add_generation_prompt=True)
            through = self.render_text(messages[: k + 1])
            if not full.startswith(through):
                raise ValueError(
                    "The chat template rewrites earlier turns (e.g. strips past reasoning), so assistant spans cannot "
                    "be located by incremental rendering; use a template with {% generation %} markers "
                    "(mask_strategy='generation') or split the conversation into single-turn records."
                )
            start = len(os.path.commonprefix([prompt, full]))
            spans.append((start, len(through)))
        return full, spans

    def _incremental(self, messages: list[dict[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
        text, spans = self.assistant_char_spans(messages)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        input_ids = torch.tensor(encoded["input_ids"], dtype=torch.long)
        offsets = torch.tensor(encoded["offset_mapping"], dtype=torch.long).view(-1, 2)  # [T, 2]
        if not spans:
            return input_ids, torch.zeros_like(input_ids)
        span = torch.tensor(spans, dtype=torch.long)  # [K, 2]
        # token [s, e) overlaps span [cs, ce) iff s < ce and e > cs; zero-width tokens are never supervised
        overlap = (offsets[:, None, 0] < span[None, :, 1]) & (offsets[:, None, 1] > span[None, :, 0])
        nonempty = offsets[:, 1] > offsets[:, 0]
        return input_ids, (overlap.any(dim=1) & nonempty).long()


def _generation_tags(template: str | dict) -> str:
    text = template if isinstance(template, str) else " ".join(template.values())
    return "generation" if "{% generation %}" in text or "{%- generation %}" in text else ""


# ----------------------------------------------------------------------------------------------------
# Datasets


class TokenizedDataset(torch.utils.data.Dataset):
    """An in-memory list of samples ``{"input_ids": [T], "loss_mask": [T], ...}`` (long tensors)."""

    def __init__(self, samples: list[dict[str, torch.Tensor]]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.samples[i]


def _has_two_supervised_in_a_row(loss_mask: torch.Tensor) -> bool:
    return bool((loss_mask[:-1].bool() & loss_mask[1:].bool()).any()) if len(loss_mask) > 1 else False


def load_dataset_records(
    path: str | os.PathLike,
    tokenizer: Any | str | None = None,
    max_length: int | None = None,
    enable_thinking: bool | None = None,
    mask_strategy: str = "auto",
    chat_template_kwargs: dict[str, Any] | None = None,
    vocab_size: int | None = None,
) -> torch.utils.data.Dataset:
    """Load a training set: an offline feature directory, or a chat / pre-tokenized JSONL file.

    Records are truncated to ``max_length`` tokens; a warning counts the truncated ones and the share of tokens
    lost. Samples without two consecutive supervised tokens (no valid anchor) are dropped. Token ids must lie in
    ``[0, vocab_size)`` (negative ones are refused even without ``vocab_size``): a ``ValueError`` names the line.
    ``tokenizer`` may be a tokenizer or a path for ``AutoTokenizer``; it is only needed for chat records.
    """
    path = Path(path)
    if path.is_dir():
        return OfflineFeatureDataset(path)
    renderer = None
    lengths = LengthReport(max_length)
    samples = []
    for line_no, record in read_jsonl(path):
        where = f"{path}:{line_no}"
        if "input_ids" in record:
            sample = _pretokenized_sample(record, where)
        else:
            messages = conversation_from_record(record, where)
            if renderer is None:  # the tokenizer loads only when a chat record needs it
                renderer = _chat_renderer(tokenizer, where, enable_thinking, mask_strategy, chat_template_kwargs)
            try:
                sample = renderer(messages)
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
        check_token_ids(sample["input_ids"], vocab_size, where)
        kept = {k: v[:max_length] for k, v in sample.items()} if max_length is not None else sample
        usable = _has_two_supervised_in_a_row(kept["loss_mask"])
        lengths.add(len(sample["input_ids"]), not usable and _has_two_supervised_in_a_row(sample["loss_mask"]))
        if usable:
            samples.append(kept)
    lengths.warn(path)
    if not samples:
        raise ValueError(f"{path}: no usable sample (each needs two consecutive supervised tokens)")
    return TokenizedDataset(samples)


def _pretokenized_sample(record: dict[str, Any], where: str) -> dict[str, torch.Tensor]:
    ids = record["input_ids"]
    mask = record.get("loss_mask", [1] * len(ids))
    # JSON `true`/`false` are Python ints: they would train as token ids 1 and 0.
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"{where}: 'input_ids' must be a list of integers (not booleans, floats or strings)")
    if not isinstance(mask, list) or len(mask) != len(ids):
        raise ValueError(f"{where}: 'loss_mask' must be a list as long as 'input_ids' ({len(ids)})")
    return {"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask).long()}


def _chat_renderer(tokenizer: Any, where: str, enable_thinking, mask_strategy, chat_template_kwargs) -> ChatRenderer:
    """A renderer without truncation: `load_dataset_records` truncates every record itself, to count what it cut."""
    if tokenizer is None:
        raise ValueError(f"{where}: chat records need a tokenizer (set `tokenizer` in the config)")
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    return ChatRenderer(tokenizer, enable_thinking, None, mask_strategy, chat_template_kwargs)


def collate(samples: Sequence[dict[str, torch.Tensor]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad a list of samples into a batch: ``input_ids``/``loss_mask``/``attention_mask`` ``[B, S]`` and any
    feature tensors ``[B, S, ...]`` (padded with zeros; padding is never supervised nor visible to a block)."""
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    batch: dict[str, torch.Tensor] = {}
    for key in samples[0]:
        padding = pad_token_id if key == "input_ids" else 0
        batch[key] = torch.nn.utils.rnn.pad_sequence([s[key] for s in samples], batch_first=True, padding_value=padding)
    batch["attention_mask"] = (torch.arange(int(lengths.max()))[None] < lengths[:, None]).long()
    return batch


class OfflineFeatureDataset(torch.utils.data.Dataset):
    """Random access to features written by `extract_features` (tensors are read lazily, per sample)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        index_file = self.directory / "index.json"
        if not index_file.exists():
            raise FileNotFoundError(f"{index_file} not found: not a feature directory written by `dmtp extract`.")
        self.index = json.loads(index_file.read_text())
        self._shards: list[tuple[str, torch.Tensor]] = []  # (file, offsets)
        self._locate: list[tuple[int, int]] = []  # sample -> (shard, row)
        for shard_id, shard in enumerate(self.index["shards"]):
            path = str(self.directory / shard["file"])
            with safe_open(path, framework="pt") as f:
                offsets = f.get_tensor("offsets")
            self._shards.append((path, offsets))
            self._locate.extend((shard_id, row) for row in range(len(offsets) - 1))
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self._locate)

    def _handle(self, shard_id: int):
        if shard_id not in self._handles:
            self._handles[shard_id] = safe_open(self._shards[shard_id][0], framework="pt")
        return self._handles[shard_id]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        shard_id, row = self._locate[i]
        offsets = self._shards[shard_id][1]
        start, end = int(offsets[row]), int(offsets[row + 1])
        handle = self._handle(shard_id)
        return {key: handle.get_slice(key)[start:end] for key in handle.keys() if key != "offsets"}

    def __getstate__(self) -> dict[str, Any]:  # safetensors handles are not picklable (DataLoader workers)
        state = self.__dict__.copy()
        state["_handles"] = {}
        return state


def parse_mix_item(item: str) -> tuple[str, float]:
    """``"path*0.5"`` -> ``("path", 0.5)``; a plain path has weight 1."""
    path, star, weight = item.rpartition("*")
    if not star:
        return item, 1.0
    try:
        value = float(weight)
    except ValueError:
        raise ValueError(f"train_data item {item!r}: the weight after '*' must be a number") from None
    if value <= 0:
        raise ValueError(f"train_data item {item!r}: the weight must be > 0")
    return path, value


def data_fingerprints(source: str | list[str]) -> dict[str, str]:
    """``{path: fingerprint}`` (`data_checks.path_fingerprint`) for every existing file or feature directory of a
    ``train_data`` setting: one path, or a mixture of ``path*weight`` items (the weight is a setting, not data).
    Sources without a file (``synthetic:...``) have none."""
    paths = [parse_mix_item(item)[0] for item in source] if isinstance(source, list) else [source]
    return {path: path_fingerprint(path) for path in paths if Path(path).exists()}


def mixed_dataset(parts: Sequence[tuple[torch.utils.data.Dataset, float]], seed: int = 0) -> torch.utils.data.Dataset:
    """Datasets mixed by weight: each contributes ``round(weight * len)`` samples, whole copies of itself and then a
    seeded random subset for the fraction, so a weight of 2 sees every sample twice per epoch and 0.5 half of them."""
    pieces = []
    for number, (dataset, weight) in enumerate(parts):
        whole, fraction = divmod(round(weight * len(dataset)), len(dataset))
        generator = torch.Generator().manual_seed(seed * 1_000_003 + number)
        rest = sorted(torch.randperm(len(dataset), generator=generator)[:fraction].tolist())
        pieces.append(torch.utils.data.Subset(dataset, list(range(len(dataset))) * whole + rest))
    return torch.utils.data.ConcatDataset(pieces)


def synthetic_greedy_dataset(
    target: torch.nn.Module,
    num_samples: int,
    length: int,
    prompt_length: int = SYNTHETIC_PROMPT_LENGTH,
    seed: int = 0,
) -> TokenizedDataset:
    """Random prompts continued greedily by the target itself (smoke tests: the target-regenerated data setting).

    Loss mask: the continuation only. ``train_data: synthetic:<N>x<len>`` in a config selects it; sizes that leave
    no sample to train on raise ``ValueError`` (`config.parse_synthetic_source`).
    """
    parse_synthetic_source(f"synthetic:{num_samples}x{length}", prompt_length)
    vocab = target.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(seed)
    device = next(target.parameters()).device
    prompts = torch.randint(0, vocab - 1, (num_samples, prompt_length), generator=generator).to(device)
    # No EOS: every sample runs to `length` tokens.
    greedy = GenerationConfig(do_sample=False, max_new_tokens=length - prompt_length, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        ids = target.generate(prompts, attention_mask=torch.ones_like(prompts), generation_config=greedy)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, prompt_length:] = 1
    return TokenizedDataset([{"input_ids": i.cpu(), "loss_mask": m.cpu()} for i, m in zip(ids, loss_mask, strict=True)])


def training_datasets(
    config: TrainConfig,
    target: torch.nn.Module,
    train_dataset: torch.utils.data.Dataset | None = None,
    eval_dataset: torch.utils.data.Dataset | None = None,
) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset | None]:
    """A run's training and held-out sets: given, read from the config's ``train_data`` / ``eval_data``, or a
    held-out split of the training set (``eval_holdout``: a seeded random subset, since files are often grouped by
    source and their tail is no held-out sample)."""
    train = train_dataset if train_dataset is not None else load_training_data(config, target, config.train_data)
    if eval_dataset is not None or not (config.eval_data or config.eval_holdout > 0):
        return train, eval_dataset
    if config.eval_data:
        return train, load_training_data(config, target, config.eval_data)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(config.seed))
    held, kept = sorted(order[: config.eval_holdout].tolist()), sorted(order[config.eval_holdout :].tolist())
    return torch.utils.data.Subset(train, kept), torch.utils.data.Subset(train, held)


def load_training_data(
    config: TrainConfig, target: torch.nn.Module, source: str | list[str]
) -> torch.utils.data.Dataset:
    """One ``train_data``/``eval_data`` setting as a dataset: a chat or pre-tokenized JSONL, an offline feature
    directory, ``synthetic:<N>x<len>`` (greedy continuations by ``target``), or a list of them mixed by weight."""
    if isinstance(source, list):
        parts = [(load_training_data(config, target, path), weight) for path, weight in map(parse_mix_item, source)]
        return mixed_dataset(parts, seed=config.seed)
    synthetic = parse_synthetic_source(source)
    if synthetic is not None:
        return synthetic_greedy_dataset(target, *synthetic, seed=config.seed)
    if not Path(source).exists():
        raise FileNotFoundError(
            f"The training data {source} does not exist; the comment next to it in the shipped configs names the "
            "command that makes it (e.g. scripts/reproduce/regenerate_bundled.sh)."
        )
    return load_dataset_records(
        source,
        tokenizer=config.tokenizer or resolve_target_path(config.target_model),
        max_length=config.max_length,
        enable_thinking=config.enable_thinking,
        mask_strategy=config.mask_strategy,
        vocab_size=target.config.get_text_config().vocab_size,
    )
