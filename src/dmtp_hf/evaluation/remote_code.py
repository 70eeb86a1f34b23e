"""The code a pushed DMTP repo carries, so that it works with only ``transformers`` installed.

- Repo root: ``configuration_dmtp.py`` and ``modeling_dmtp.py`` (with what they import), named by ``auto_map`` in
  ``config.json``: ``AutoModel.from_pretrained(repo, trust_remote_code=True)`` builds the draft.
- ``custom_generate/``: ``generate.py`` (from ``dmtp_hf.assistant.remote``) and the engine it runs, plus
  ``requirements.txt``: ``target.generate(..., custom_generate=repo, trust_remote_code=True, assistant_model=draft)``.

The files are generated at push time from this package's own modules, never maintained as a second copy: each
module's source is copied with its package-relative imports rewritten to the flat, single-directory relative
imports Transformers' remote-code loader follows (``from ..modeling.native_mtp.head import X`` becomes
``from .native_mtp_head import X``). The set of files is the import closure of the entry modules.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import torch
import transformers

__all__ = ["AUTO_MAP", "flat_name", "import_closure", "write_remote_code"]

ROOT_ENTRIES = ("dmtp_hf.modeling.configuration_dmtp", "dmtp_hf.modeling.modeling_dmtp")
GENERATE_ENTRY = "dmtp_hf.assistant.remote"
AUTO_MAP = {"AutoConfig": "configuration_dmtp.DMTPConfig", "AutoModel": "modeling_dmtp.DMTPDraftModel"}
_RELATIVE = re.compile(r"^(\s*from\s+)(\.+)([\w.]*)(\s+import\s)", re.MULTILINE)


def _source_path(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"cannot find the source of {module}")
    return Path(spec.origin)


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _resolve(module: str, path: Path, dots: str, name: str) -> str:
    base = _package_of(module, path).split(".")
    base = base[: len(base) - len(dots) + 1]
    return ".".join(base + ([name] if name else []))


def flat_name(module: str) -> str:
    """The file name (without ``.py``) of a package module in a repo: ``dmtp_hf.assistant.generate`` ->
    ``assistant_generate``; the two ``auto_map`` modules keep their own names."""
    parts = module.split(".")[1:]
    if parts and parts[0] == "modeling" and len(parts) == 2:
        return parts[1]  # configuration_dmtp, modeling_dmtp, attention_masks, io
    return "_".join(part for part in parts if part != "modeling")


def import_closure(entries: tuple[str, ...]) -> list[str]:
    """Every ``dmtp_hf`` module the entries import, directly or not (entries first)."""
    seen, queue = [], list(entries)
    while queue:
        module = queue.pop(0)
        if module in seen:
            continue
        seen.append(module)
        path = _source_path(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                target = _resolve(module, path, "." * node.level, node.module or "")
                if _source_path(target).name == "__init__.py":
                    raise ImportError(f"{module} imports the package {target}: import its modules for remote code")
                queue.append(target)
            elif isinstance(node, ast.ImportFrom | ast.Import) and any(
                (alias.name if isinstance(node, ast.Import) else node.module or "").startswith("dmtp_hf")
                for alias in node.names
            ):
                raise ImportError(f"{module} imports dmtp_hf absolutely: remote code needs relative imports")
    return seen


def _rewrite(module: str) -> str:
    path = _source_path(module)

    def replace(match: re.Match) -> str:
        target = _resolve(module, path, match.group(2), match.group(3))
        return f"{match.group(1)}.{flat_name(target)}{match.group(4)}"

    header = f"# Generated from {module} by dmtp-hf (evaluation/remote_code.py); edit the package, not this file.\n"
    return header + _RELATIVE.sub(replace, path.read_text())


def write_remote_code(folder: str | Path) -> list[str]:
    """Write the repo-root modeling files and ``custom_generate/`` into ``folder``; returns the written paths."""
    folder = Path(folder)
    written = []
    for module in import_closure(ROOT_ENTRIES):
        (folder / f"{flat_name(module)}.py").write_text(_rewrite(module))
        written.append(f"{flat_name(module)}.py")
    generate_dir = folder / "custom_generate"
    generate_dir.mkdir(parents=True, exist_ok=True)
    for module in import_closure((GENERATE_ENTRY,)):
        name = "generate" if module == GENERATE_ENTRY else flat_name(module)
        (generate_dir / f"{name}.py").write_text(_rewrite(module))
        written.append(f"custom_generate/{name}.py")
    torch_major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    tf_major_minor = ".".join(transformers.__version__.split(".")[:2])
    (generate_dir / "requirements.txt").write_text(
        f"torch>={torch_major_minor}\ntransformers>={tf_major_minor},<{_next_minor(tf_major_minor)}\n"
    )
    written.append("custom_generate/requirements.txt")
    return written


def _next_minor(version: str) -> str:
    major, minor = (int(v) for v in version.split("."))
    return f"{major}.{minor + 1}"
