"""The core's legibility budgets (issue legible-core): characters, not lines, so density does not pay; one idea per
statement; the model built from its spec; the product's model specs written only by train_gpt.py."""
import ast
import os

import pytest

from conftest import REPO

CORE = ("train_gpt.py", "harness.py", "kernels.py", "aurora_opt.py")
CHARACTERS = {"train_gpt.py": 88_000, "harness.py": 40_000}  # about the lean core's, in characters
LONG, LONG_SHARE = 100, 0.06  # at most 6% of a file's lines longer than 100 characters (modded-nanogpt: 5.5%)
PACKED = 3  # ``a, b = x, y``: at most 3 a file (a tuple a function returns may be unpacked freely)


def source(name):
    with open(os.path.join(REPO, name), encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("name", CORE)
def test_a_core_file_keeps_its_lines_short_and_one_idea_per_statement(name):
    text = source(name)
    lines = text.splitlines()
    long = [i + 1 for i, line in enumerate(lines) if len(line) > LONG]
    assert len(long) <= LONG_SHARE * len(lines), f"{name}: {len(long)} of {len(lines)} lines over {LONG}: {long[:20]}"
    tree = ast.parse(text)
    packed = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Tuple)
              and any(isinstance(t, ast.Tuple) for t in n.targets)]
    assert len(packed) <= PACKED, f"{name}: packed multi-assignments at lines {packed}"
    hidden = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.NamedExpr)
              or (isinstance(n, ast.Expr) and isinstance(n.value, ast.Tuple))]
    assert hidden == [], f"{name}: an assignment or side effect inside another expression at lines {hidden}"


@pytest.mark.parametrize("name, budget", sorted(CHARACTERS.items()))
def test_the_trainer_and_its_harness_stay_within_their_character_budgets(name, budget):
    assert len(source(name)) <= budget, f"{name}: {len(source(name)):,} characters (budget {budget:,})"


def test_the_model_is_built_from_its_spec():
    tree = ast.parse(source("train_gpt.py"))
    [gpt] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GPT"]
    [init] = [n for n in gpt.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    assert [a.arg for a in init.args.args[:2]] == ["self", "spec"]


def writes_models(tree):
    """Lines of ``tree`` that assign into, or call a mutating method of, a name ``MODELS`` (``T.MODELS`` too)."""
    def is_models(node):
        return (isinstance(node, ast.Name) and node.id == "MODELS") or (
            isinstance(node, ast.Attribute) and node.attr == "MODELS")
    out = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if any(isinstance(t, ast.Subscript) and is_models(t.value) or is_models(t) for t in targets):
                out.append(n.lineno)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and is_models(n.func.value) and \
                n.func.attr in ("setdefault", "update", "pop", "clear", "__setitem__"):
            out.append(n.lineno)
        if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "setattr" and len(n.args) >= 2 and \
                isinstance(n.args[1], ast.Constant) and n.args[1].value == "MODELS":
            out.append(n.lineno)
    return out


def test_no_file_but_the_trainer_writes_its_model_specs():
    found = {}
    for folder in ("tests", "bench", "records", "data", "."):
        for name in sorted(os.listdir(os.path.join(REPO, folder))):
            path = os.path.normpath(os.path.join(folder, name))
            if name.endswith(".py") and path != "train_gpt.py":
                lines = writes_models(ast.parse(source(path)))
                if lines:
                    found[path] = lines
    assert found == {}
