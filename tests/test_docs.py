"""The docs against the code: links, flags, settings and samples a new user copies.

Cheap checks only (no nodes): each claim here was found wrong once by reading the
docs as a new user (README.md, docs/*.md, deploy/README.md).
"""

from __future__ import annotations

import re
import shlex
import unicodedata
from pathlib import Path

import click
import pytest
import typer
from typer.testing import CliRunner

from edgecache.clients.cli import app

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md"]
CODE = [ROOT / d for d in ("cache", "edge", "clients")]
runner = CliRunner()


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = heading.strip().lower()
    kept = "".join(
        c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN"
    )  # letters and digits, as GitHub keeps them
    return kept.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_their_sections_resolve(doc: Path) -> None:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https://, mailto:
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target}: no section #{anchor} in {path.name}")
    assert not broken, f"{doc.relative_to(ROOT)}: {broken}"


def _commands() -> dict[str, click.Command]:
    group = typer.main.get_command(app)
    commands = getattr(group, "commands", None)
    assert commands, "edgecache has no commands"
    return commands


def _command(name: str) -> click.Command:
    command = _commands().get(name)
    assert command is not None, f"no command edgecache {name}"
    return command


def _option_names(command: click.Command) -> set[str]:
    return {o for p in command.params for o in (*p.opts, *p.secondary_opts)}


def _documented_command_lines() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for block in re.findall(r"```\w*\n(.*?)```", doc.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip().removeprefix("$ ")
                if line.startswith("edgecache "):
                    found.append((doc.name, line.split("  #")[0]))
    return found


def test_every_flag_of_a_documented_command_line_exists() -> None:
    lines = _documented_command_lines()
    assert len(lines) >= 15
    wrong = []
    for doc, line in lines:
        words = shlex.split(line.replace("[", " ").replace("]", " "))
        known = _option_names(_command(words[1]))
        for word in words[2:]:
            flag = word.split("=")[0]
            if flag.startswith("--") and flag not in known:
                wrong.append(f"{doc}: {flag} in: {line}")
    assert not wrong, wrong


def test_every_option_of_every_command_is_documented() -> None:
    text = "\n".join(d.read_text() for d in DOCS)
    missing = [
        f"edgecache {name} {option}"
        for name, command in _commands().items()
        for option in sorted({o for p in command.params for o in p.opts} - {"--help"})
        if option.startswith("--")
        if not re.search(re.escape(option) + r"(?![\w-])", text)
    ]
    assert not missing, f"options no doc names: {missing}"


def test_every_edgecache_environment_variable_in_the_code_is_documented() -> None:
    from edgecache.edge.config import NodeConfig

    text = "\n".join(d.read_text() for d in DOCS)
    used = {
        name
        for folder in CODE
        for source in folder.rglob("*.py")
        for name in re.findall(r"EDGECACHE_[A-Z][A-Z_]*[A-Z]", source.read_text())
    }
    assert "EDGECACHE_TOKEN_FILE" in used
    # A node setting's variable is EDGECACHE_<SETTING>, documented by the settings table.
    settings = {f"EDGECACHE_{field.upper()}" for field in NodeConfig.model_fields}
    missing = sorted(name for name in used - settings if name not in text)
    assert not missing, f"environment variables no doc names: {missing}"


def test_every_node_setting_is_in_the_settings_table() -> None:
    from edgecache.edge.config import NodeConfig

    doc = (ROOT / "docs" / "edge-node.md").read_text()
    table = doc[doc.index("## Settings") :]
    table = table[: table.index("\n## ")]
    missing = [
        name
        for name in NodeConfig.model_fields
        if f"`{name}`" not in table and f"`--{name.replace('_', '-')}`" not in table
    ]
    assert not missing, f"docs/edge-node.md's settings table lacks {missing}"


def test_the_admin_calls_are_named_where_the_admin_token_is() -> None:
    from edgecache.edge.service import ADMIN_METHODS

    for doc, marker in (
        ("docs/security.md", "| admin token |"),
        ("docs/edge-node.md", "- `--token-file`:"),
    ):
        text = (ROOT / doc).read_text()
        start = text.index(marker)
        passage = text[start : text.index("\n", text.index("\n", start) + 1)]
        missing = [m for m in sorted(ADMIN_METHODS) if f"`{m}`" not in passage]
        assert not missing, f"{doc}: the admin token's calls lack {missing}"


def test_the_iris_refusal_in_operations_md_is_what_publish_says(tmp_path: Path) -> None:
    """docs/operations.md's and preprocessing.md's iris samples, run as written."""
    raw = tmp_path / "raw" / "iris"
    raw.mkdir(parents=True)
    rows = "".join(f"5.1,3.5,1.4,0.2,{i % 3}\n" for i in range(150))
    (raw / "iris.csv").write_text("150,4,setosa,versicolor,virginica\n" + rows)
    registry = ["--registry", str(tmp_path / "registry")]
    doc = (ROOT / "docs" / "operations.md").read_text()
    shown = re.search(r"\$ edgecache publish file:///srv/raw/iris .*\n(error: .*)\n", doc)
    assert shown is not None
    result = runner.invoke(app, ["publish", f"file://{raw}", "--dataset", "iris", *registry])
    assert result.exit_code == 2
    said = result.output.strip().replace(f"file://{raw}", "file:///srv/raw/iris")
    assert said == shown.group(1)

    doc = (ROOT / "docs" / "preprocessing.md").read_text()
    command, output = re.search(
        r"```\n\$ (edgecache publish file:///data/iris .*?)\n(iris@1 .*?)```", doc, re.S
    ).groups()
    args = shlex.split(command.replace("\\\n", " "))[1:]
    args[1] = f"file://{raw}"
    result = runner.invoke(app, [*args, *registry])
    assert result.exit_code == 0, result.output
    digest = re.compile(r"sha256:\w+…?")
    said = result.output.replace(f"file://{raw}", "file:///data/iris")
    assert digest.sub("D", said) == digest.sub("D", output)


def test_versions_of_an_unknown_dataset_says_what_operations_md_shows(tmp_path: Path) -> None:
    from edgeutil import write_parquet_shards

    write_parquet_shards(tmp_path / "origin", 1, rows=10)
    registry = ["--registry", str(tmp_path / "registry")]
    result = runner.invoke(
        app, ["publish", str(tmp_path / "origin"), "--dataset", "tokens-en", *registry]
    )
    assert result.exit_code == 0, result.output
    doc = (ROOT / "docs" / "operations.md").read_text()
    shown = re.search(r"\$ edgecache versions tokens-fr .*\n(error: .*)\n", doc)
    assert shown is not None
    result = runner.invoke(app, ["versions", "tokens-fr", *registry])
    assert result.exit_code == 2
    said = result.output.strip().replace(f"file://{tmp_path}/registry", "file:///srv/registry")
    assert said == shown.group(1)


def test_the_record_retention_operations_md_gives_is_the_controllers() -> None:
    # The controller's record keeps an ended job for --keep-records hours: the default
    # the docs give must be the option's, and the option's the Controller's own.
    from datetime import timedelta

    from edgecache.clients.controller import RECORD_RETENTION

    (option,) = [p for p in _command("controller").params if "--keep-records" in p.opts]
    assert option.default == RECORD_RETENTION / timedelta(hours=1)
    text = re.sub(r"\s+", " ", (ROOT / "docs" / "operations.md").read_text())
    assert f"`--keep-records` hours ({option.default:g} by default)" in text
    assert f"`--keep-records HOURS` ({option.default:g} by default)" in text
