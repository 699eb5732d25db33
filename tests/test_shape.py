"""The product's shape (docs/design.md, "Code shape"): files of a few hundred lines, functions that fit on a screen.
Read from the source: no file of core, edge, cloud or orchestrator over ``MAX_FILE_LINES`` lines (the generated
``_pb2`` stubs live in protos/), no function or method there over ``MAX_FUNCTION_LINES`` (from its ``def`` line to
its last, docstring and nested definitions included)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("core", "edge", "cloud", "orchestrator")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


def sources() -> list[Path]:
    return sorted(p for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py") if "_pb2" not in p.name)


def test_no_file_is_over_the_limit():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in sources()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, f"split by concern (at most {MAX_FILE_LINES} lines a file):\n" + "\n".join(long)


def test_no_function_is_over_the_limit():
    long = []
    for p in sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long, f"name its steps (at most {MAX_FUNCTION_LINES} lines a function):\n" + "\n".join(long)
