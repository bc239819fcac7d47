"""The make targets and `python -m` commands on README.md and docs/ exist, with their settings,
sub-commands and flags; a target given ARGS it ignores says so (tests/support/doc_pages.py reads the pages)."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tests.support.doc_pages import PROJECT_PACKAGES, ROOT, all_snippets, commands, make_items, makefile


def test_every_make_target_and_setting_exists() -> None:
    targets, variables, _ = makefile()
    stale = []
    for where, target, _, settings in make_items():
        if target not in targets and not target.startswith("<"):
            stale.append(f"{where}: make {target}: no such target")
        stale += [f"{where}: make {target} {name}=: no such setting" for name in settings if name not in variables]
    assert not stale, "\n".join(stale)


def test_args_are_given_only_to_targets_that_use_them() -> None:
    targets, _, refusing = makefile()
    using = {name for name, recipe in targets.items() if "$(ARGS)" in recipe}
    stale = [
        f"{where}: make {target} ARGS={args!r}: {target} takes no ARGS"
        for where, target, args, _ in make_items()
        if args and target in targets and target not in using
    ]
    assert not stale, "\n".join(stale)
    # every target with a recipe either passes ARGS on or refuses them (TAKES_NO_ARGS)
    silent = {name for name, recipe in targets.items() if recipe and name not in using | refusing}
    old_names = {"repro", "serve"}  # they only say the new names, and exit 2
    assert not silent - old_names, f"targets that ignore ARGS without saying so: {sorted(silent - old_names)}"


def test_readme_lists_the_targets_that_take_args() -> None:
    targets, _, refusing = makefile()
    using = {name for name, recipe in targets.items() if "$(ARGS)" in recipe}
    text = (ROOT / "README.md").read_text()
    said = re.search(r"^`ARGS=\"\.\.\.\"` .*?(?=\n\n)", text, re.S | re.M)
    assert said, 'README.md: no paragraph starting `ARGS="..."` that says which targets take ARGS'
    named = set(re.findall(r"`([a-z][a-z0-9-]*)`", said.group(0)))
    assert named & set(targets) == using, f"README says {sorted(named & set(targets))}, the Makefile {sorted(using)}"
    assert refusing, "the Makefile has no TAKES_NO_ARGS list"


def _make(*args: str) -> subprocess.CompletedProcess[str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "ARGS")
    }
    return subprocess.run(["make", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_a_target_given_args_it_ignores_says_so() -> None:
    # refused while the Makefile is read: nothing is built or run first, whatever the environment's state
    done = _make("lint", "ARGS=--fix")
    assert done.returncode == 2, done
    assert "make lint takes no ARGS" in done.stderr, done.stderr
    assert not done.stdout, done.stdout
    # a target that takes ARGS still gets them (-n: shown, not run)
    shown = _make("-n", "bench", "ARGS=--smoke")
    assert shown.returncode == 0 and "-m benchmarks --smoke" in shown.stdout, shown


# --- python -m ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PyCommand:
    where: str
    module: str
    words: tuple[str, ...]


def _module_exists(module: str) -> bool:
    path = ROOT / module.replace(".", "/")
    if "*" in module:  # `python -m tasks.tools.*`: some
        return bool(glob.glob(str(path)))
    if module.split(".")[0] in PROJECT_PACKAGES:
        return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()
    import importlib.util

    return importlib.util.find_spec(module.split(".")[0]) is not None


def py_commands() -> Iterator[PyCommand]:
    for snippet in all_snippets():
        for offset, command in commands(snippet):
            for m in re.finditer(r"python[\d.]*\s+-m\s+([A-Za-z_][\w.]*[\w*])([^;&|)`]*)", command):
                words = tuple(_words(m.group(2)))
                yield PyCommand(snippet.where(offset + m.start()), m.group(1), words)
    targets, _, _ = makefile()
    for where, target, args, _ in make_items():
        found = re.search(r"-m ([\w.]+)((?: [a-z]\w*)?)", targets.get(target, ""))  # the module, its sub-command
        if args and found:
            yield PyCommand(where, found.group(1), (*found.group(2).split(), *_words(args)))


def _words(text: str) -> Iterator[str]:
    """A command's arguments, placeholders (`<run id>`) and optional brackets dropped, up to a `->`."""
    text = re.sub(r"<[^>]*>", "X", text)
    for word in text.replace("[", " ").replace("]", " ").split():
        if word == "->":
            return
        if word not in {"...", "=", "X"} and re.match(r"^[-\w./:~@'\"]", word):
            yield word


# Each module's --help, in-process, in one interpreter for many modules: they share imports (a
# subprocess per module took 45 s on a busy 2-core machine). SystemExit is the end of a --help.
HELP_DRIVER = """
import contextlib, io, json, runpy, sys, warnings
warnings.simplefilter("ignore")
found = {}
for module, sub in json.loads(sys.argv[1]):
    sys.argv = [module, *([sub] if sub else []), "--help"]
    text, code = io.StringIO(), 1
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else int(done.code is not None)
        except Exception as error:
            text.write(repr(error))
    found[module + " " + sub] = [code, text.getvalue()]
sys.stdout = sys.__stdout__
print(json.dumps(found))
"""
# Modules whose --help imports torch: a process of their own, beside the others.
HEAVY_HELP = ("tasks.tools.gpu_check",)


def help_texts(keys: list[tuple[str, str]]) -> dict[tuple[str, str], tuple[int, str]]:
    groups = [[k for k in keys if k[0] in HEAVY_HELP], [k for k in keys if k[0] not in HEAVY_HELP]]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "LOCKSTEP_"))}

    def run(group: list[tuple[str, str]]) -> dict[str, list[Any]]:
        argv = [sys.executable, "-c", HELP_DRIVER, json.dumps(group)]
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.splitlines()[-1])

    with ThreadPoolExecutor(max_workers=2) as pool:
        found = {k: v for part in pool.map(run, [g for g in groups if g]) for k, v in part.items()}
    return {(module, sub): tuple(found[f"{module} {sub}"]) for module, sub in keys}  # type: ignore[misc]


def _flags(text: str) -> set[str]:
    """The flags a --help declares: in its usage, and at the start of its option lines (not in prose)."""
    usage = text.split("\n\n")[0]
    flags = set(re.findall(r"\[(--?[A-Za-z][\w-]*)", usage)) | set(
        re.findall(r"(?<=\s)(--?[A-Za-z][\w-]*) [A-Z]", usage)
    )
    for line in text.splitlines():
        declared = re.match(r"^\s+(--?[A-Za-z][\w-]*(?:[ =][^,\s]+)?(?:, --?[A-Za-z][\w-]*(?:[ =][^,\s]+)?)*)", line)
        if declared:
            flags |= set(re.findall(r"(?:^|, )(--?[A-Za-z][\w-]*)", declared.group(1)))
    return flags


# Commands that hand the options they do not know to another program, which checks them.
PASS_THROUGH = {
    ("flows.sweep", "scheduler"): "other options go to `dask scheduler`",
    ("flows.sweep", "worker"): "other options go to `dask worker`",
}


def _sub(command: PyCommand) -> str:
    first = next((w for w in command.words if not w.startswith("-")), "")
    return first if re.fullmatch(r"[a-z][a-z_]*", first) else ""


def _checked(commands: list[PyCommand]) -> list[PyCommand]:
    return [c for c in commands if c.module.split(".")[0] in PROJECT_PACKAGES and "*" not in c.module]


def test_every_python_module_command_and_flag_exists() -> None:
    commands = list(py_commands())
    stale = [f"{c.where}: python -m {c.module}: no such module" for c in commands if not _module_exists(c.module)]
    # a command with neither flags nor a sub-command needs no --help: its module exists
    checked = [c for c in _checked(commands) if _module_exists(c.module) and c.words]
    wanted = sorted({(c.module, "") for c in checked} | {(c.module, _sub(c)) for c in checked})
    helps = help_texts(wanted)
    for c in checked:
        code, top = helps[(c.module, "")]
        if code != 0:
            stale.append(f"{c.where}: python -m {c.module} --help exited {code}: {top[-300:]}")
            continue
        sub = _sub(c)
        choices = re.search(r"\{([\w,-]+)\}", top.split("\n\n")[0])
        if sub and choices and sub not in choices.group(1).split(","):
            stale.append(f"{c.where}: python -m {c.module} {sub}: no such sub-command ({choices.group(1)})")
            continue
        known = _flags(top) | (_flags(helps[(c.module, sub)][1]) if sub and helps[(c.module, sub)][0] == 0 else set())
        stale += [
            f"{c.where}: python -m {c.module}{' ' + sub if sub else ''} {w}: no such flag"
            for w in c.words
            if w.startswith("-")
            and w.split("=")[0] not in known
            and not re.fullmatch(r"-\d.*", w)
            and (c.module, sub) not in PASS_THROUGH
        ]
    assert not stale, "\n".join(stale)
