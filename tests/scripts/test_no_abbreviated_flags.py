"""benchmarks/ and scripts/ follow `gerl`'s rule for flags: no abbreviations (`--layer` is not `--layers`).

argparse's default `allow_abbrev=True` takes any unique prefix for a flag, so a typo or an old flag name silently
becomes another flag. Every parser in those folders is found by reading the source (no import, so nothing heavy
runs), and two real commands show the refusal: exit 2 and argparse's "unrecognized arguments" line."""

import ast
import subprocess
import sys

import pytest

from tests.scripts import HOMES, REPO

PARSER_CALLS = ("ArgumentParser", "add_parser")  # a subparser takes allow_abbrev itself; it does not inherit it


def _parser_calls(path) -> tuple[bool, list]:
    """(does `path` import argparse, [(line, allow_abbrev keyword's value or None when absent)] of every parser
    constructed in it)."""
    imports, out = False, []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            imports |= any(a.name == "argparse" for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            imports |= node.module == "argparse"
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name in PARSER_CALLS:
            kw = next((k.value for k in node.keywords if k.arg == "allow_abbrev"), None)
            out.append((node.lineno, kw.value if isinstance(kw, ast.Constant) else None))
    return imports, out


def test_every_parser_in_benchmarks_and_scripts_refuses_abbreviations():
    files = sorted(p for home in HOMES for p in home.rglob("*.py"))
    found, wrong, unparsed = 0, [], []
    for path in files:
        imports, calls = _parser_calls(path)
        found += len(calls)
        wrong += [f"{path.relative_to(REPO)}:{line}" for line, abbrev in calls if abbrev is not False]
        if imports and not calls:
            unparsed.append(str(path.relative_to(REPO)))  # argparse used through a name this walk does not see
    assert not wrong, f"pass allow_abbrev=False to these parsers (as gerl/cli.py does): {wrong}"
    assert not unparsed, f"these files use argparse but build no parser this test can find: {unparsed}"
    assert found >= 10  # the walk saw the benchmarks' and scripts' parsers (14 when this test was written)


def test_an_abbreviated_flag_is_refused_with_exit_2(monkeypatch, capsys):
    import benchmarks.__main__ as entry

    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the entry point renames the program in sys.argv
    with pytest.raises(SystemExit) as e:
        entry.main(["gpu", "--layer", "2"])  # `python -m benchmarks gpu --layer 2`: the benchmark has --layers
    err = capsys.readouterr().err
    assert e.value.code == 2 and "unrecognized arguments: --layer 2" in err and "Traceback" not in err, err
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "remote_reward.py"), "--lat", "0"],  # has --latency
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and "unrecognized arguments: --lat 0" in r.stderr, r.stdout + r.stderr
