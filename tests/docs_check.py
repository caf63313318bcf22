#!/usr/bin/env python3
"""Keeps README.md and docs/*.md true and readable (run by tests/docs_commands.sh).

    docs_check.py check SOURCE_DIR ACCOUNTED_TSV HELP_CONFIG_OUTPUT
    docs_check.py block FILE LANG N      prints the N-th (1-based) ```LANG block of FILE

check fails (exit 1, one line per problem) when
  - a command shown in a ```sh / ```bash block, or a ```python block, is neither run by
    tests/docs_commands.sh nor listed there with the test that covers it (ACCOUNTED_TSV: lines
    "run<TAB>command", "covered<TAB>command<TAB>why", "python<TAB>FILE:N"), or the test accounts
    for a command no page shows any more;
  - README.md is longer than 200 lines, or a line of README.md or of a docs page is wider than 120
    characters (the pages in WIDE_PAGES and the generated part of configuration.md excepted);
  - a relative link or its #anchor points nowhere;
  - docs/configuration.md does not hold the output of `eo-ddp --help-config --markdown` unchanged.
Commands are compared as the shell splits them, comments dropped.
"""
import os
import re
import shlex
import sys

README_MAX_LINES = 200
MAX_WIDTH = 120
# Pages older than the width rule, or printed by eo-ddp itself: their long lines are tables of
# measurements and generated rows.
WIDE_PAGES = {"architecture.md", "design.md", "benchmarks.md", "benchmarks-history.md", "axolotl-keys.md"}
GENERATED_BEGIN = "<!-- begin: the output of build/eo-ddp --help-config --markdown -->"
GENERATED_END = "<!-- end: the output of build/eo-ddp --help-config --markdown -->"
FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")


def blocks(path):
    """(lang, first line number, lines) of every fenced block in the file."""
    out, fence, lang, start, body = [], None, "", 0, []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f.read().split("\n"), 1):
            m = FENCE.match(line)
            if fence is None and m:
                fence, lang, start, body = m.group(1), m.group(2).lower(), n + 1, []
            elif fence is not None and line.strip().startswith(fence[0] * 3) and line.strip().strip(fence[0]) == "":
                out.append((lang, start, body))
                fence = None
            elif fence is not None:
                body.append(line)
    return out


def normalise(command):
    """The words the shell would see, comments dropped (None for a comment or blank line)."""
    lex = shlex.shlex(command, posix=True, punctuation_chars=False)
    lex.whitespace_split = True
    lex.commenters = "#"
    words = list(lex)
    return " ".join(words) if words else None


def shell_commands(lines, first):
    """(line number, command) of a sh block; a line ending in a backslash continues."""
    out, pending, at = [], "", first
    for n, line in enumerate(lines, first):
        if not pending:
            at = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        cmd = normalise(pending + line)
        pending = ""
        if cmd:
            out.append((at, cmd))
    return out


def pages(src):
    docs = os.path.join(src, "docs")
    return [os.path.join(src, "README.md")] + sorted(
        os.path.join(docs, p) for p in os.listdir(docs) if p.endswith(".md"))


def slug(heading):
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]", lambda m: "_" if m.group(0) == "_" else "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


def check(src, accounted_path, help_config_path):
    problems = []
    rel = lambda p: os.path.relpath(p, src)
    accounted = {}
    with open(accounted_path, encoding="utf-8") as f:
        for line in f.read().splitlines():
            kind, _, rest = line.partition("\t")
            key = rest if kind == "python" else normalise(rest.split("\t")[0])
            accounted[(kind == "python", key)] = kind
    shown = set()
    for path in pages(src):
        python_n = 0
        for lang, first, body in blocks(path):
            if lang in ("sh", "bash", "shell"):
                for n, cmd in shell_commands(body, first):
                    shown.add((False, cmd))
                    if (False, cmd) not in accounted:
                        problems.append(f"{rel(path)}:{n}: `{cmd}` is neither run nor listed in tests/docs_commands.sh")
            elif lang == "python":
                python_n += 1
                key = f"{rel(path)}:{python_n}"
                shown.add((True, key))
                if (True, key) not in accounted:
                    problems.append(f"{rel(path)}:{first}: python block {python_n} is neither run nor listed in "
                                    "tests/docs_commands.sh")
    for (is_python, key), kind in accounted.items():
        if (is_python, key) not in shown:
            problems.append(f"tests/docs_commands.sh: {kind} `{key}`, which no page shows any more")

    with open(os.path.join(src, "README.md"), encoding="utf-8") as f:
        readme_lines = f.read().rstrip("\n").split("\n")
    if len(readme_lines) > README_MAX_LINES:
        problems.append(f"README.md: {len(readme_lines)} lines, more than {README_MAX_LINES}")
    for path in pages(src):
        if os.path.basename(path) in WIDE_PAGES:
            continue
        generated = False
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f.read().split("\n"), 1):
                generated = (generated or line == GENERATED_BEGIN) and line != GENERATED_END
                if len(line) > MAX_WIDTH and not generated:
                    problems.append(f"{rel(path)}:{n}: {len(line)} characters, more than {MAX_WIDTH}")

    for path in pages(src):
        with open(path, encoding="utf-8") as f:
            text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
            if not os.path.exists(dest):
                problems.append(f"{rel(path)}: link {target}: no such file")
            elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                problems.append(f"{rel(path)}: link {target}: no heading '{anchor}' in {rel(dest)}")

    with open(help_config_path, encoding="utf-8") as f:
        help_config = f.read()
    with open(os.path.join(src, "docs", "configuration.md"), encoding="utf-8") as f:
        config_page = f.read()
    if not help_config.strip() or f"{GENERATED_BEGIN}\n{help_config}{GENERATED_END}" not in config_page:
        problems.append("docs/configuration.md does not hold the output of `eo-ddp --help-config --markdown` between its markers: "
                        "paste it again")

    for p in problems:
        print(f"docs_check: {p}")
    print(f"docs_check: {len(shown)} commands and blocks shown, {len(problems)} problem(s)")
    return 1 if problems else 0


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "check":
        return check(*sys.argv[2:])
    if len(sys.argv) == 5 and sys.argv[1] == "block":
        found = [b for b in blocks(sys.argv[2]) if b[0] == sys.argv[3]]
        sys.stdout.write("\n".join(found[int(sys.argv[4]) - 1][2]) + "\n")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
