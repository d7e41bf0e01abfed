"""The repository's tracked text is whole: no merge left its conflict markers in a file (one did, in docs/)."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^(<{7} |={7}$|>{7} )", re.M)  # git's three marker lines, each at a line start


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    paths = [ROOT / p for p in out.decode().split("\0") if p]
    return [p for p in paths if p.suffix in {".py", ".md", ".sh", ".toml", ".txt", ".js", ".html", ".css", ".cfg",
                                             ".yml", ".yaml", ".json"} or p.name in {"Makefile", "run"}]


def test_no_merge_conflict_markers():
    files = _tracked_text_files()
    assert len(files) > 100  # the walk found the repository's files
    bad = [f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
           for p in files if p.is_file()
           for text in [p.read_text(errors="replace")] for m in MARKER.finditer(text)]
    assert not bad, f"merge conflict markers left in: {', '.join(bad)}"


def test_marker_pattern_catches_a_conflict():
    text = "a\n<<<<<<< HEAD\nours\n=======\ntheirs\n>>>>>>> branch\n"
    assert len(MARKER.findall(text)) == 3
    assert not MARKER.findall("a ======= b\n<<< not a marker\n")
