"""Regenerate kjv.txt (the course's training text) from Debian's bible-kjv packages.

    apt-get download bible-kjv bible-kjv-text
    for f in bible-kjv*.deb; do dpkg-deb -x "$f" root; done
    python flashedu/data/make_kjv.py root/usr/bin/bible root/usr/lib > flashedu/data/kjv.txt

The output is deterministic: the same packages give the same bytes (see README.md for the hash).
"""

from __future__ import annotations

import re
import subprocess
import sys

# (title, the program's book abbreviation): five books, about 0.5 MB of plain ASCII.
BOOKS = [("Genesis", "gen"), ("Exodus", "ex"), ("Ruth", "ruth"), ("Proverbs", "pr"),
         ("Ecclesiastes", "ec")]

VERSE = re.compile(r"^\S+?(\d+):(\d+) (.*)$")  # "Ge1:1 In the beginning ..."


def book_text(program: str, data_dir: str, title: str, abbrev: str) -> str:
    # "-f" turns pretty-printing off: one verse a line, prefixed by its reference. The range
    # 1:1-99:999 runs past every book's end, and the program stops at the book's last verse.
    raw = subprocess.run([program, "-p", data_dir, "-f", f"{abbrev}1:1-99:999"],
                         check=True, capture_output=True, text=True).stdout
    lines, chapter = [title.upper(), ""], None
    for line in raw.splitlines():
        match = VERSE.match(line)
        if match is None:
            continue
        if match[1] != chapter:
            chapter = match[1]
            lines += ["", f"{title} {chapter}", ""]
        lines.append(match[3])
    return "\n".join(lines) + "\n\n\n"


def main(argv: list[str]) -> None:
    program, data_dir = argv
    sys.stdout.write("".join(book_text(program, data_dir, t, a) for t, a in BOOKS))


if __name__ == "__main__":
    main(sys.argv[1:])
