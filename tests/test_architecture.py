"""The package's layering rules, checked on the source: layers import only downwards, no import cycles (lazy
imports included), library code never imports the test helpers, and the round never knows where the drafter state
is stored.

Sizes are guidance, reported rather than enforced: the round reads best in about 70 lines, other functions in about
80, modules in about 500. Code past the guidance is listed in a ``UserWarning`` (pytest's warnings summary), so growth
stays visible without packing code to fit; only a hard ceiling well above it fails (the round > 100 lines, another
function > 120, a module > 700), the sign that something wants splitting."""

import ast
import threading
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from conftest import draft_for

from dmtp_hf_assets.tiny_targets import load_tiny_target, make_tiny_target

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "dmtp_hf"
# Each layer may import only the layers listed after it (and itself).
LAYERS = ["cli", "demo", "evaluation", "training", "assistant", "bundled", "modeling"]
POLICY = PACKAGE.parents[1] / "policy" / "src" / "dmtp_policy"  # the shared policy, a distribution of its own
ALLOWED = {layer: set(LAYERS[i:]) for i, layer in enumerate(LAYERS)}
# Sizes in lines: (guidance, ceiling). Past the guidance a test warns; past the ceiling it fails.
FUNCTION_LINES = (80, 120)
ROUND_LINES = (70, 100)
MODULE_LINES = (500, 700)


def check_sizes(what: str, sizes: dict[str, int], limits: tuple[int, int]) -> None:
    """Warn about every entry of ``sizes`` (name: lines) past the guidance; fail on any past the ceiling."""
    guidance, ceiling = limits
    over = sorted(((n, name) for name, n in sizes.items() if n > guidance), reverse=True)
    if over:
        rows = "\n".join(f"  {n:5d}  {name}" for n, name in over)
        warnings.warn(UserWarning(f"{what} past the {guidance}-line guidance ({len(over)}):\n{rows}"), stacklevel=2)
    too_long = [f"{name}: {n} lines" for n, name in over if n > ceiling]
    assert not too_long, f"{what} past the {ceiling}-line ceiling (split them):\n" + "\n".join(too_long)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every ``dmtp_hf`` module imported anywhere in the file (function-level imports included)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("dmtp_hf")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("dmtp_hf"):
                found.add(target)
                found |= {f"{target}.{alias.name}" for alias in node.names}
    return found


def library_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_layers_import_only_downwards_and_never_the_assets():
    modules = library_modules()
    problems = []
    for name, path in modules.items():
        layer = layer_of(name)
        for imported in imports_of(path):
            if imported.startswith("dmtp_hf_assets"):  # test helpers and toy weights: not the library's
                problems.append(f"{name} imports {imported}")
                continue
            target = layer_of(imported)
            if layer in ALLOWED and target in LAYERS and target not in ALLOWED[layer]:
                problems.append(f"{name} ({layer}) imports {imported} ({target})")
    assert not problems, "\n".join(problems)


def test_the_policy_needs_nothing_but_torch_and_the_standard_library():
    """``dmtp_policy`` is what the vLLM plugin imports from vLLM's own environment (its own Transformers): it may
    import torch, NumPy, the standard library and itself, nothing else."""
    import sys

    problems = []
    for path in POLICY.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for name in names:
                top = name.partition(".")[0]
                if top not in ("torch", "numpy", "__future__", "dmtp_policy") and top not in sys.stdlib_module_names:
                    problems.append(f"{path.name} imports {name}")
    assert not problems, "\n".join(problems)


def test_evaluation_loads_targets_without_the_training_package():
    """Evaluation (and the serving exports in ``modeling``) load a target through ``assistant.target.loading``: a
    user who evaluates or serves needs nothing of training."""
    problems = [
        f"{name} imports {imported}"
        for name, path in library_modules().items()
        if layer_of(name) == "evaluation"
        for imported in imports_of(path)
        if layer_of(imported) == "training"
    ]
    assert not problems, "\n".join(problems)


def test_no_import_cycles():
    modules = library_modules()
    graph = defaultdict(set)
    for name, path in modules.items():
        for imported in imports_of(path):
            target = resolve(imported, modules)
            # A package's __init__ re-exports its modules; edges into the top-level package are the public API.
            if target and target != name and target != "dmtp_hf" and not name.startswith(target + "."):
                graph[name].add(target)
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(modules):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_library_function_sizes():
    sizes = {}
    for name, path in library_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                sizes[f"{name}.{node.name}:{node.lineno}"] = node.end_lineno - node.lineno + 1
    check_sizes("library functions", sizes, FUNCTION_LINES)


def test_the_decoding_round_reads_in_one_short_function():
    from dmtp_hf.assistant import decoding

    tree = ast.parse(Path(decoding.__file__).read_text())
    (function,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "speculative_decode"]
    check_sizes("decoding rounds", {"speculative_decode": function.end_lineno - function.lineno + 1}, ROUND_LINES)


def test_library_module_sizes():
    sizes = {name: len(path.read_text().splitlines()) for name, path in library_modules().items()}
    check_sizes("library modules", sizes, MODULE_LINES)


def test_the_round_never_mentions_the_drafter_state_storage():
    from dmtp_hf.assistant import decoding

    source = Path(decoding.__file__).read_text()
    storage = ["SlotKV", "fixed_shapes", "fixed_slots", "drafter_state", "MTPState", "DFlashContext", ".narrow("]
    assert not [word for word in storage if word in source]


def test_two_targets_in_two_threads_equal_sequential_runs(targets, tmp_path):
    """Nothing global is patched: two hybrid targets of one family decode concurrently as they do one by one."""
    first = targets["qwen3_5"]
    second = load_tiny_target(make_tiny_target("qwen3_5", tmp_path / "second", seed=7))
    prompts = [torch.tensor([[5, 17, 42, 9, 77, 3, 64]]), torch.tensor([[8, 1, 90, 33, 2]])]
    drafts = [draft_for(first), draft_for(second)]
    for draft in drafts:
        draft.native_mtp  # noqa: B018 - load the MTP heads up front: this test is about decoding
    runs = [(first, prompts[0], drafts[0]), (second, prompts[1], drafts[1])]

    def decode(target, prompt, draft):
        return target.generate(prompt, assistant_model=draft, do_sample=False, max_new_tokens=40)

    sequential = [decode(*run) for run in runs]
    results: list = [None, None]
    errors: list = []

    def worker(i):
        try:
            for _ in range(3):  # several overlapping generate calls per thread
                results[i] = decode(*runs[i])
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for got, expected, (target, prompt, _) in zip(results, sequential, runs):
        assert torch.equal(got, expected)
        assert torch.equal(got, target.generate(prompt, do_sample=False, max_new_tokens=40))


def test_the_wheel_holds_the_library_only():
    """Toy weights and test helpers live in assets/ (a second local distribution), not in the package."""
    files = [p for p in PACKAGE.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    weights = [str(p.relative_to(PACKAGE)) for p in files if p.suffix in {".safetensors", ".bin", ".gguf", ".pt"}]
    assert not weights, f"weights inside the package: {weights}"
    assert not (PACKAGE / "testing").exists(), "test helpers belong to assets/dmtp_hf_assets"
    size = sum(p.stat().st_size for p in files)
    assert size < 5 * 2**20, f"src/dmtp_hf holds {size / 2**20:.1f} MB (the wheel should stay under 5 MB)"
