"""The README and the pages under docs/ say what the repository holds.

Checked here, on the pages' own text:

- every repository path a page cites (in backticks or as a link) exists; a path is written
  as it lies in the repository (``planner/dp/solve.py``), never through the import
  namespace (``pipeplan/planner/...``, a folder that does not exist);
- every link between pages resolves, and so does its ``#anchor`` (GitHub's heading slugs);
- every ``pipeplan.x.y`` name a page cites is a module, or a name defined in one;
- every ``pipeplan <command>`` a page shows is a command, its ``--help`` runs, and each
  option it passes is one of that command's options;
- every option written alone in backticks (``--leaf-modules``) belongs to some command;
- the python blocks parse; the Hugging Face page's model file is the file in docs/tutorial/;
- the README stays short, keeps the set-up commands, links one page per topic and is the
  package's readme; design.md's layer drawing names every room of the import-linter layers.

Slow (marked ``slow``): the python blocks executed, and the tutorial's commands run on its
own files.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from functools import cache
from pathlib import Path

import pytest

from pipeplan.export.megatron import MEGATRON_OPTIONS

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Top-level entries of the repository a cited path may start with.
ROOTS = ("pipeplan", "planner", "profiler", "runtime", "configs", "bench", "tests", "docs", ".ci")
ROOT_FILES = ("README.md", "CONTRIBUTING.md", "pyproject.toml")
# Sub-packages mapped by package-dir onto top-level folders: `pipeplan/planner/x.py` is no path.
MAPPED = ("planner", "profiler", "runtime", "configs")
# The one page per topic the README links to.
TOPIC_PAGES = (
    "docs/tutorial.md",
    "docs/hugging-face.md",
    "docs/big-models.md",
    "docs/tensor-parallel.md",
    "docs/schedules.md",
    "docs/export.md",
    "docs/runtime.md",
    "docs/formats.md",
    "docs/profile-format.md",
    "docs/metrics.md",
    "docs/benchmarks.md",
    "docs/limits.md",
    "docs/design.md",
)
SETUP_COMMANDS = (
    "pip install torch==2.13.0 -e . && pipeplan demo",
    "pip install torch==2.13.0 -e '.[test]' && python tests/lanes.py",
)
README_MAX_LINES = 300
# Options the pages show in backticks that belong to other programs (torchrun, Megatron-LM,
# the bench scripts, docs/export/train_with_pipelining.py), not to a pipeplan command.
FOREIGN_OPTIONS = {
    "--nproc-per-node",  # torchrun
    "--no-python",  # torchrun
    "--accumulate-allreduce-grads-in-fp32",  # Megatron-LM
    "--grad-reduce-in-bf16",  # Megatron-LM
    "--calibrate",  # bench/bench_ptdp.py
    "--figure12",  # bench/bench_ptdp.py
    "--depths",  # bench/bench_memory.py
    "--shapes",  # bench/bench_planner.py
    "--no-pipedream",  # bench/bench_planner.py
    "--sail",  # bench/bench_schedules.py
    "--zb-paper",  # bench/bench_schedules.py
    "--gloo",  # bench/bench_schedules.py
    "--csv",  # docs/export/train_with_pipelining.py
    "--logdir",  # tensorboard
    *MEGATRON_OPTIONS,  # Megatron-LM, as `pipeplan export --to megatron` writes them
}


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


# ---------------------------------------------------------------------------------------------
# Reading the pages: prose (fenced blocks removed), code spans, links, fenced blocks.

# A fenced block, at the margin or indented in a list item.
FENCE = re.compile(r"^[ \t]*```[^\n]*\n.*?^[ \t]*```[ \t]*$", re.DOTALL | re.MULTILINE)
CODE_SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)*)`")  # may wrap onto the next line, not past a blank one
LINK = re.compile(r"!?\[(?:[^\]\n]|\n(?!\n))*?\]\(([^)\s]+)\)")


@cache
def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _prose(page: Path) -> str:
    """The page without its fenced blocks (code and outputs)."""
    return FENCE.sub("", _text(page))


def _fenced(page: Path) -> list[tuple[str, str]]:
    """(info string, body) of each fenced block."""
    blocks = []
    for match in FENCE.finditer(_text(page)):
        first, _, rest = match.group(0).partition("\n")
        body = textwrap.dedent(rest.rsplit("```", 1)[0].rstrip(" \t"))
        blocks.append((first.strip()[3:].strip(), body))
    return blocks


def _code_spans(page: Path) -> list[str]:
    return [" ".join(span.split()) for span in CODE_SPAN.findall(_prose(page))]


def _links(page: Path) -> list[str]:
    # Code spans may hold brackets (`[--format F]`): take links from the prose without them.
    return LINK.findall(CODE_SPAN.sub("", _prose(page)))


def _path_token(token: str) -> str | None:
    """``token`` as a repository path, or None when it is not one (a module, a command, ...)."""
    token = token.split("::")[0].strip().rstrip(".,;:)").lstrip("(")
    if not token or any(c in token for c in "<>*{}|$") or " " in token:
        return None
    if token in ROOT_FILES:
        return token
    if "/" not in token or not re.fullmatch(r"[A-Za-z0-9_.\-/]+", token):
        return None
    return token if token.split("/")[0] in ROOTS else None


def _cited_paths(page: Path) -> set[str]:
    """Repository paths the page cites in code spans (root-relative) and links (page-relative)."""
    paths = set()
    for span in _code_spans(page):
        for token in span.split():
            path = _path_token(token)
            if path is not None:
                paths.add(path.rstrip("/") or path)
    for target in _links(page):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        resolved = os.path.normpath(page.parent / target.split("#")[0])
        paths.add(Path(resolved).relative_to(REPO).as_posix())
    return paths


def _all_cited() -> list[tuple[str, str]]:
    return sorted({(_rel(page), path) for page in PAGES for path in _cited_paths(page)})


# ---------------------------------------------------------------------------------------------
# (a) Paths, links and anchors.


def test_the_pages_are_found() -> None:
    names = {_rel(page) for page in PAGES}
    assert {"README.md", *TOPIC_PAGES} <= names


@pytest.mark.parametrize("page, path", _all_cited(), ids=[f"{p}:{q}" for p, q in _all_cited()])
def test_every_cited_path_exists(page: str, path: str) -> None:
    assert (REPO / path).exists(), f"{page} cites {path}, which is not in the repository"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_page_cites_a_package_path_through_the_import_namespace(page: Path) -> None:
    mapped = "|".join(MAPPED)
    wrong = sorted(set(re.findall(rf"pipeplan/(?:{mapped})/[\w./]*", _text(page))))
    assert not wrong, (
        f"{_rel(page)} cites {', '.join(wrong)}: those folders are top-level in the repository "
        f"(planner/, profiler/, runtime/, configs/); write the repository path"
    )


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, code marks and punctuation dropped,
    spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip())
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


@cache
def _anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", _prose(page), re.MULTILINE):
        slug = _slug(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(anchors)


def test_slugs_follow_github() -> None:
    assert _slug("6b. Train a transformer's way: AdamW, warm-up + cosine") == (
        "6b-train-a-transformers-way-adamw-warm-up--cosine"
    )
    assert _slug("Plans the engines can run: `partition --for`") == (
        "plans-the-engines-can-run-partition---for"
    )


def _anchored_links() -> list[tuple[str, str]]:
    return sorted({(_rel(page), target) for page in PAGES for target in _links(page) if "#" in target})


@pytest.mark.parametrize("page, target", _anchored_links(), ids=[f"{p}:{t}" for p, t in _anchored_links()])
def test_every_link_anchor_resolves(page: str, target: str) -> None:
    if re.match(r"[a-z]+:", target):
        pytest.skip("external link")
    path, _, anchor = target.partition("#")
    linked = (REPO / page).parent / path if path else REPO / page
    linked = Path(os.path.normpath(linked))
    assert linked.suffix == ".md" and linked.exists(), f"{page}: {target} does not link a page"
    assert anchor in _anchors(linked), (
        f"{page}: #{anchor} is no heading of {_rel(linked)} "
        f"(its anchors: {', '.join(sorted(_anchors(linked)))})"
    )


# ---------------------------------------------------------------------------------------------
# Module names: `pipeplan.x.y` is a module, or a name defined in one (read statically, so that
# this stays fast and imports no torch).

PACKAGE_DIRS = {
    "pipeplan.planner": "planner",
    "pipeplan.profiler": "profiler",
    "pipeplan.runtime": "runtime",
    "pipeplan.configs": "configs",
}


def _module_file(name: str) -> Path | None:
    for package, folder in PACKAGE_DIRS.items():
        if name == package or name.startswith(package + "."):
            relative = folder + name[len(package) :].replace(".", "/")
            break
    else:
        relative = name.replace(".", "/")
    for candidate in (REPO / relative / "__init__.py", REPO / f"{relative}.py"):
        if candidate.exists():
            return candidate
    return None


def _defines(source: str, attribute: str) -> bool:
    name = re.escape(attribute)
    return bool(
        re.search(
            rf"^\s*(?:def|class) {name}\b|^{name}\s*[:=]|^\s*from \S+ import .*\b{name}\b"
            rf"|^\s+{name},?$|^\s*import .*\b{name}\b",
            source,
            re.MULTILINE,
        )
    )


def _cited_modules() -> list[tuple[str, str]]:
    names = set()
    for page in PAGES:
        for span in _code_spans(page):
            for match in re.finditer(r"\bpipeplan(?:\.[A-Za-z_]\w*)+", span):
                end = match.end()
                if end < len(span) and span[end] in "/:":  # a schema name (pipeplan.plan/2), a click path
                    continue
                names.add((_rel(page), match.group(0)))
    return sorted(names)


@pytest.mark.parametrize("page, name", _cited_modules(), ids=[f"{p}:{n}" for p, n in _cited_modules()])
def test_every_cited_module_or_name_exists(page: str, name: str) -> None:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = _module_file(".".join(parts[:cut]))
        if module is not None:
            break
    assert module is not None, f"{page} cites {name}: no such module"
    rest = parts[cut:]
    assert len(rest) <= 2, f"{page} cites {name}: {'.'.join(parts[:cut])} has no {'.'.join(rest)}"
    if rest:
        assert _defines(module.read_text(encoding="utf-8"), rest[0]), (
            f"{page} cites {name}: {_rel(module)} defines no {rest[0]}"
        )


# ---------------------------------------------------------------------------------------------
# (b) Commands the pages show.

PIPEPLAN_LINE = re.compile(r"(?:^|\s)pipeplan\s+([a-z][a-z-]*)(?=\s|$)")


def _command_lines(page: Path) -> list[str]:
    """Command lines of the page: lines of fenced blocks that run ``pipeplan`` (``$ `` prompts
    and continuation backslashes handled), and code spans that start with ``pipeplan``."""
    lines = []
    for _, body in _fenced(page):
        joined = re.sub(r"\\\n\s*", " ", body)
        for line in joined.splitlines():
            line = line.removeprefix("$ ")
            if re.match(r"(?:\S+=\S*\s+)*(?:/usr/bin/time -v\s+)?pipeplan\s", line) or (
                line.startswith("torchrun ") and " -m pipeplan " in line
            ):
                lines.append(line)
    lines += [span for span in _code_spans(page) if span.startswith("pipeplan ")]
    return lines


def _split(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:
        return line.split("#")[0].split()


def _invocations() -> list[tuple[str, str, tuple[str, ...]]]:
    """(page, command, options passed) of every command line the pages show."""
    found = set()
    for page in PAGES:
        for line in _command_lines(page):
            tokens = _split(line)
            if "pipeplan" not in tokens:
                continue
            rest = tokens[tokens.index("pipeplan") + 1 :]
            if not rest or not re.fullmatch(r"[a-z][a-z-]*", rest[0]):
                continue
            options = []
            for token in rest[1:]:
                token = token.strip("[]")
                if re.fullmatch(r"--?[A-Za-z][\w-]*(?:=.*)?", token):
                    options.append(token.split("=")[0])
            found.add((_rel(page), rest[0], tuple(options)))
    return sorted(found)


@cache
def _commands() -> dict[str, frozenset[str]]:
    """Every pipeplan command with its option names (read from click, no torch imported)."""
    import click

    from pipeplan.cli import COMMANDS, cli

    context = click.Context(cli)
    options: dict[str, frozenset[str]] = {}
    for name in COMMANDS:
        command = cli.get_command(context, name)
        assert command is not None
        names = {"--help", "-h"}
        for param in command.params:
            names.update(getattr(param, "opts", ()))
            names.update(getattr(param, "secondary_opts", ()))
        options[name] = frozenset(names)
    return options


def test_the_pages_show_commands() -> None:
    shown = {command for _, command, _ in _invocations()}
    assert {"profile", "partition", "run", "simulate", "report", "export", "estimate"} <= shown


@pytest.mark.parametrize(
    "page, command, options", _invocations(), ids=[f"{p}:{c}:{' '.join(o)}" for p, c, o in _invocations()]
)
def test_every_command_shown_exists_with_its_options(
    page: str, command: str, options: tuple[str, ...]
) -> None:
    commands = _commands()
    assert command in commands, (
        f"{page} shows `pipeplan {command}`, which is no command ({', '.join(commands)})"
    )
    unknown = [option for option in options if option not in commands[command]]
    assert not unknown, f"{page} shows `pipeplan {command}` with {', '.join(unknown)}, which it does not take"


@pytest.mark.parametrize("command", sorted({c for _, c, _ in _invocations()}))
def test_help_of_every_command_shown_runs(command: str) -> None:
    from click.testing import CliRunner

    from pipeplan.cli import cli

    result = CliRunner().invoke(cli, [command, "--help"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert re.search(rf"^Usage: \S+ {command} ", result.output, re.MULTILINE), result.output


def _lone_options() -> list[tuple[str, str]]:
    """Options the pages write alone in backticks (`--leaf-modules`, `--tensor-parallel 2`)."""
    found = set()
    for page in PAGES:
        for span in _code_spans(page):
            if span.startswith("pipeplan "):
                continue  # checked against its command above
            match = re.match(r"(--[a-z][\w-]*)", span)
            if match:
                found.add((_rel(page), match.group(1)))
    return sorted(found)


@pytest.mark.parametrize("page, option", _lone_options(), ids=[f"{p}:{o}" for p, o in _lone_options()])
def test_every_option_written_alone_belongs_to_a_command(page: str, option: str) -> None:
    if option in FOREIGN_OPTIONS:
        return
    owners = [name for name, options in _commands().items() if option in options]
    assert owners, f"{page} writes `{option}`, which no pipeplan command takes"


# ---------------------------------------------------------------------------------------------
# Python blocks.


def _python_blocks() -> list[tuple[str, int, str]]:
    blocks = []
    for page in PAGES:
        if page.name == "design.md":
            continue  # signatures and dataclass sketches, not code to run
        for index, (info, body) in enumerate(_fenced(page)):
            if info == "python":
                blocks.append((_rel(page), index, body))
    return blocks


PYTHON_BLOCK_IDS = [f"{page}:{index}" for page, index, _ in _python_blocks()]


@pytest.mark.parametrize("page, index, body", _python_blocks(), ids=PYTHON_BLOCK_IDS)
def test_every_python_block_parses(page: str, index: int, body: str) -> None:
    compile(body, f"{page} block {index}", "exec")


def test_the_hugging_face_page_shows_the_model_file_it_names() -> None:
    shown = next(body for info, body in _fenced(REPO / "docs/hugging-face.md") if info == "python")
    assert shown == (REPO / "docs/tutorial/hf_gpt2.py").read_text(encoding="utf-8")


@pytest.mark.slow
@pytest.mark.parametrize("page, index, body", _python_blocks(), ids=PYTHON_BLOCK_IDS)
def test_every_python_block_runs(page: str, index: int, body: str) -> None:
    namespace: dict[str, object] = {"__name__": "docs_block"}
    exec(compile(body, f"{page} block {index}", "exec"), namespace)  # noqa: S102 (the page's own code)
    if "build_model" in namespace and "sample_batch" in namespace:  # a model file: build it, draw, loss
        model = namespace["build_model"]()  # type: ignore[operator]
        inputs, targets = namespace["sample_batch"](4)  # type: ignore[operator]
        output = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
        if "loss_fn" in namespace:
            assert namespace["loss_fn"](output, targets).ndim == 0  # type: ignore[operator]


# ---------------------------------------------------------------------------------------------
# The README and the design card.


def test_readme_is_short_and_keeps_the_set_up_commands() -> None:
    text = _text(REPO / "README.md")
    assert len(text.splitlines()) <= README_MAX_LINES
    for command in SETUP_COMMANDS:
        assert f"\n{command}\n" in text, f"README.md lost the set-up command {command!r}"


def test_readme_links_one_page_per_topic() -> None:
    linked = _cited_paths(REPO / "README.md")
    missing = [page for page in TOPIC_PAGES if page not in linked]
    assert not missing, f"README.md does not link {', '.join(missing)}"


def test_readme_is_the_packages_readme() -> None:
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^readme = "README\.md"$', pyproject, re.MULTILINE)


def test_design_layers_name_every_room_of_the_import_contract() -> None:
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    layers = re.search(r"^layers = \[\n(.*?)^\]", pyproject, re.DOTALL | re.MULTILINE)
    assert layers is not None
    rooms = set(re.findall(r"pipeplan\.(\w+)", layers.group(1)))
    design = _text(REPO / "docs/design.md")
    drawing = design.split("## Layers", 1)[1].split("```")[1]
    missing = sorted(room for room in rooms if not re.search(rf"\b{room}\b", drawing))
    assert not missing, f"docs/design.md's layer drawing does not name {', '.join(missing)}"


def test_design_lists_every_command() -> None:
    from pipeplan.cli import COMMANDS

    design = _text(REPO / "docs/design.md")
    for name, target in COMMANDS.items():
        module = target.split(":")[0].rsplit(".", 1)[1]
        assert f"`{module}.py`" in design, f"docs/design.md does not list pipeplan/cli/{module}.py ({name})"


# ---------------------------------------------------------------------------------------------
# The tutorial's commands, run on its own files (slow: a profile and a plan).


def _pipeplan(*args: str, cwd: Path) -> str:
    command = [sys.executable, "-m", "pipeplan", *args]
    result = subprocess.run(
        command,
        check=False,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"},
    )
    assert result.returncode == 0, f"{' '.join(args)}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.mark.slow
@pytest.mark.multiprocess  # runs the pipeplan commands as a user would, in processes
def test_the_tutorial_commands_run_on_its_files(tmp_path: Path) -> None:
    tutorial = REPO / "docs" / "tutorial"
    out = _pipeplan(
        "profile",
        str(tutorial / "my_model.py"),
        "--device",
        "cpu",
        "--batch-size",
        "64",
        "--threads",
        "1",
        "--warmup",
        "1",
        "--repeats",
        "2",
        "-o",
        "profile.json",
        cwd=tmp_path,
    )
    assert "capture: fx, 14 layers" in out and "wrote profile.json" in out
    out = _pipeplan(
        "partition",
        "profile.json",
        "--topology",
        str(tutorial / "cluster.yaml"),
        "-o",
        "plan.json",
        cwd=tmp_path,
    )
    assert "cut states searched: all-downsets (15 states)" in out and "wrote plan.json" in out
    out = _pipeplan(
        "simulate", "plan.json", "--profile", "profile.json", "--timeline", "timeline.json", cwd=tmp_path
    )
    assert "1f1b-rr" in out and (tmp_path / "timeline.json").exists()
    _pipeplan(
        "partition",
        "profile.json",
        "--topology",
        "local-cpu",
        "--straight",
        "--schedule",
        "1f1b-flush",
        "--microbatches",
        "4",
        "-o",
        "flush.json",
        cwd=tmp_path,
    )
    out = _pipeplan(
        "export",
        "flush.json",
        "--to",
        "pipelining",
        "--model",
        str(tutorial / "my_model.py"),
        "-o",
        "split.py",
        cwd=tmp_path,
    )
    assert "Schedule1F1B, 4 micro-batches" in out
    compile((tmp_path / "split.py").read_text(), "split.py", "exec")
