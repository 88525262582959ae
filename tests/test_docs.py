"""The docs cannot drift from the command line: every `moeshard` command quoted in a code block of
README.md or docs/*.md parses with the real argument parser (nothing is run)."""

import re
import shlex
from pathlib import Path

import pytest

from moeshard.cli import build_parser

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Where a command starts on a line: at its start, after `&&` / `;`, or as torchrun's module.
START = re.compile(r"(?:^|&&|;|-m)\s*(?:\.venv/bin/)?moeshard\s+(?!serve\.|\.)|^\s*(?:\.venv/bin/python -m|python -m) moeshard\s+")


def code_blocks(text: str) -> list[list[str]]:
    blocks, inside = [], None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if inside is None:
                inside = []
            else:
                blocks.append(inside)
                inside = None
        elif inside is not None:
            inside.append(line)
    return blocks


def quoted_commands() -> list[tuple[str, str]]:
    """(page:line, the arguments after `moeshard`), continued lines joined."""
    found = []
    for page in PAGES:
        for block in code_blocks(page.read_text()):
            joined = "\n".join(block).replace("\\\n", " ")
            for line in joined.splitlines():
                match = START.search(line)
                if match is None:
                    continue
                rest = line[match.end():]
                rest = re.split(r"\s(?:&&|;|\||>)\s", rest)[0]  # this command only
                if "$" not in rest:  # a shell loop's variables: what they expand to is not on the page
                    found.append((f"{page.name}: {line.strip()[:60]}", rest))
    return found


COMMANDS = quoted_commands()


def test_the_docs_quote_commands():
    assert len(COMMANDS) >= 20, COMMANDS  # README and docs/ show many: a broken scan finds none


@pytest.mark.parametrize("where, arguments", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_quoted_command_parses(where, arguments):
    argv = shlex.split(arguments, comments=True)
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse's way to refuse (2), or --help (0)
        assert exc.code == 0, f"{where}: `moeshard {arguments}` does not parse"


def test_help_is_grouped_and_every_command_has_an_example(capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = capsys.readouterr().out
    for group in ("serve:", "run:", "prove:", "benchmark:"):
        assert f"\n{group}\n" in text
    grouped = text[text.index("\nserve:\n"):]
    listed = [line.split()[:2] for line in grouped.splitlines() if line.startswith("  ")]
    assert len(listed) >= 14
    for words in listed:
        name = words[:2] if words[0] in ("verify", "bench") else words[:1]
        with pytest.raises(SystemExit):
            parser.parse_args([*name, "--help"])
        assert "example:\n  moeshard " + " ".join(name) in capsys.readouterr().out
