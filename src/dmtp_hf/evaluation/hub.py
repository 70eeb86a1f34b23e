"""Model cards and the Hub: render the DMTP card from an eval JSON, lay out a repo folder, upload it.

The card template ships inside the package (``evaluation/templates/dmtp_card.md``, mirrored at the repository's
``model_cards/dmtp_card.md``) and is a :class:`string.Template` (``$name`` placeholders), so markdown and code
braces need no escaping.
"""

from __future__ import annotations

import json
import re
import string
from importlib import resources
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, ModelCard, ModelCardData

from .remote_code import AUTO_MAP, write_remote_code
from .report import ALL, _fmt, _pct, _table, comparison_pairs, dataset_rows

CARD_TEMPLATE = "dmtp_card.md"
EVAL_FILENAME = "dmtp_eval.json"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def card_template_text(name: str = CARD_TEMPLATE) -> str:
    """The packaged card template."""
    return resources.files("dmtp_hf.evaluation").joinpath("templates", name).read_text(encoding="utf-8")


def evaluation_section(results: dict[str, Any] | None) -> str:
    """The card's acceptance section from eval results: per-request length, first-candidate acceptance, settings."""
    if not results:
        return "_No evaluation results were attached to this card (run `dmtp eval` and push with `--eval-json`)._"
    labels = [s["label"] for s in results["strategies"]]
    pairs = comparison_pairs(results)
    settings = results["settings"]
    limit = settings["limit"] if settings["limit"] is not None else "all"
    rows, first = [], []
    for key, display, entries in dataset_rows(results):
        if key == ALL:
            continue
        row = [display] + [_fmt(entries[label]["acceptance_length_per_request"]) for label in labels]
        for a, b in pairs:
            new, base = entries[a]["acceptance_length_per_request"], entries[b]["acceptance_length_per_request"]
            row.append("n/a" if new is None or not base else f"{100 * (new / base - 1):+.2f}%")
        rows.append(row)
        first.append([display] + [_pct(entries[label]["first_candidate_acceptance"]) for label in labels])
    header = ["Dataset", *labels, *[f"{a} vs. {b}" for a, b in pairs]]
    strategies = "; ".join(
        f"`{s['label']}`: {s['kind']}, {s['num_candidates']} candidate{'s' if s['num_candidates'] != 1 else ''}"
        for s in results["strategies"]
    )
    lines = [
        f"Mean acceptance length per request (committed tokens per verify round, bonus token included; multi-turn "
        f"sets counted per turn). First {limit} prompts per set, the target's chat template with thinking disabled, "
        f"T={settings['temperature']:g} ({settings['verify_mode']} verification), up to {settings['max_new_tokens']} "
        f"new tokens per turn, stop at EOS. Strategies: {strategies}.",
        "",
        *_table(header, rows),
        "",
        "First-candidate acceptance (`1 − hist[0] / Σ hist`):",
        "",
        *_table(["Dataset", *labels], first),
        "",
    ]
    if results.get("baseline"):
        speed = [
            [display] + [_fmt(entries[label].get("speedup"), 2) + "×" for label in labels]
            for key, display, entries in dataset_rows(results)
            if key != ALL
        ]
        lines += [
            "Wall-clock speedup over plain `target.generate` on the same turns (batch size 1, same run):",
            "",
            *_table(["Dataset", *labels], speed),
            "",
        ]
    lines += [
        f"Measured with dmtp-hf {results['environment'].get('dmtp_hf')} on {results['environment'].get('device')} "
        f"(`dmtp eval`, {results.get('created', 'date unknown')}); the full results are in `{EVAL_FILENAME}`.",
    ]
    return "\n".join(lines)


def _is_hub_id(name: str | None) -> bool:
    return bool(name and _REPO_ID.match(name) and not Path(name).exists())


def render_model_card(
    config,
    repo_id: str,
    *,
    results: dict[str, Any] | None = None,
    target: str | None = None,
    training_data: str | None = None,
    license: str = "apache-2.0",
    datasets: list[str] | None = None,
    template: str | None = None,
) -> str:
    """The README of a DMTP draft repo: its config (layout, fusion, candidates), target, training data and, when
    eval ``results`` are given, their acceptance tables. ``target`` defaults to the eval's target."""
    target = target or (results or {}).get("models", {}).get("target") or "<target model>"
    model_type = (
        (results or {}).get("models", {}).get("target_model_type")
        or (config.dmtp_config or {}).get("target_model_type")
        or "unknown"
    )
    dmtp = config.dmtp_config or {}
    values = {
        "title": repo_id.split("/")[-1],
        "repo_id": repo_id,
        "target_link": f"[`{target}`](https://huggingface.co/{target})" if _is_hub_id(target) else f"`{target}`",
        "target": target,
        "target_model_type": model_type or "unknown",
        "mtp_source": dmtp.get("mtp_source") or "the family's MTP tensors",
        "anchor_layout": config.anchor_layout,
        "fusion": config.fusion if config.anchor_layout != "dflash" else "none (DFlash layout)",
        "num_candidates": config.num_candidates,
        "num_rest": config.num_candidates - (0 if config.anchor_layout == "dflash" else 1),
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "target_layer_ids": config.target_layer_ids,
        "training_data": training_data or dmtp.get("training_data") or "not specified",
        "evaluation": evaluation_section(results),
    }
    body = string.Template(template or card_template_text()).substitute(values)
    data = ModelCardData(
        library_name="dmtp-hf",
        pipeline_tag="text-generation",
        # Hub metadata only accepts repo ids: a local target path stays out of the front matter.
        base_model=target if _is_hub_id(target) else None,
        tags=["speculative-decoding", "dmtp", "dflash", "mtp", "multi-token-prediction"],
        license=license,
        datasets=list(datasets) if datasets else None,
    )
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")
    if card.data.to_dict() != data.to_dict():  # the header must read back as written
        raise ValueError("the model card's metadata does not round-trip through huggingface_hub")
    return str(card)


def prepare_repo_folder(
    checkpoint: str | Path,
    folder: str | Path,
    repo_id: str,
    *,
    eval_json: str | Path | None = None,
    training_data: str | None = None,
    target: str | None = None,
) -> Path:
    """Write a Hub-ready folder: ``config.json`` (with ``auto_map``) + ``model.safetensors`` (re-saved after strict
    loading, so a broken checkpoint never reaches the Hub), the repo's own code (``remote_code.py``: modeling files
    and ``custom_generate/``), ``README.md`` (the card) and the eval JSON if given."""
    from ..modeling import DMTPDraftModel

    if not _REPO_ID.match(repo_id):
        raise ValueError(f"repo id {repo_id!r} is not of the form ORG/NAME")
    results = None
    if eval_json is not None:
        try:
            results = json.loads(Path(eval_json).read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{eval_json}: not a JSON file ({err.msg} at line {err.lineno})") from None
        if results.get("schema") != "dmtp-eval/1":
            raise ValueError(f"{eval_json}: not a `dmtp eval` result (schema {results.get('schema')!r})")
    model = DMTPDraftModel.from_pretrained(checkpoint)
    folder = Path(folder)
    model.save_pretrained(folder)
    # The repo carries its own code: AutoModel with trust_remote_code, and custom_generate for the engine.
    write_remote_code(folder)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["auto_map"] = dict(AUTO_MAP)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    card = render_model_card(model.config, repo_id, results=results, target=target, training_data=training_data)
    (folder / "README.md").write_text(card)
    if results is not None:
        (folder / EVAL_FILENAME).write_text(json.dumps(results, indent=1) + "\n")
    return folder


def push_checkpoint(
    checkpoint: str | Path,
    repo_id: str,
    *,
    eval_json: str | Path | None = None,
    training_data: str | None = None,
    target: str | None = None,
    folder: str | Path | None = None,
    private: bool = False,
    token: str | None = None,
    revision: str | None = None,
    commit_message: str = "Upload DMTP draft",
    upload: bool = True,
) -> tuple[Path, Any]:
    """Prepare the repo folder (``folder`` or a temporary one) and upload it with ``HfApi.upload_folder``.

    Returns ``(folder, commit_info)``; ``upload=False`` only writes the folder (``commit_info`` is ``None``).
    """
    import tempfile

    staging = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="dmtp-push-"))
    prepare_repo_folder(checkpoint, staging, repo_id, eval_json=eval_json, training_data=training_data, target=target)
    if not upload:
        return staging, None
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(staging),
            repo_type="model",
            revision=revision,
            commit_message=commit_message,
        )
    except Exception as err:  # network/auth failures of any HTTP stack: one line for the CLI, folder kept
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise OSError(f"upload to {repo_id} failed ({first_line}); the repo folder is at {staging}") from err
    return staging, info
