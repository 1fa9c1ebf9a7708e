"""The picture of the house in docs/architecture.md: the package's rooms floor by floor, drawn as a
mermaid flowchart from tests/test_architecture.py's LAYERS (the floors that test enforces), so the
picture and the rule are one list.

    python tools/house_diagram.py           # rewrites the picture in docs/architecture.md
    python tools/house_diagram.py --check   # exits 1 if the picture is not the LAYERS of today

tests/test_architecture.py checks the picture is current.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
DOC = REPOSITORY / "docs" / "architecture.md"
BEGIN = "<!-- the house: made by tools/house_diagram.py from tests/test_architecture.py's LAYERS -->"
END = "<!-- end of the house -->"
NAMES = {"_engine": "_engine (C++)", "__init__": "__init__ (zerolite.load)",
         "__main__": "__main__ (python -m zerolite)"}


def mermaid(layers: list[tuple[str, ...]]) -> str:
    """The floors top down, each importing only from the ones below it."""
    lines = ["```mermaid", "flowchart TB"]
    for floor in range(len(layers) - 1, -1, -1):
        rooms = " · ".join(NAMES.get(room, room) for room in layers[floor])
        lines.append(f'    floor{floor}["{rooms}"]')
    lines += [f"    floor{floor} --> floor{floor - 1}" for floor in range(len(layers) - 1, 0, -1)]
    lines.append("```")
    return "\n".join(lines)


def block(layers: list[tuple[str, ...]]) -> str:
    return f"{BEGIN}\n{mermaid(layers)}\n{END}"


def drawn(text: str) -> str | None:
    """The picture as it stands in the document's text, markers included."""
    found = re.search(re.escape(BEGIN) + r".*?" + re.escape(END), text, flags=re.S)
    return found[0] if found else None


def layers_enforced() -> list[tuple[str, ...]]:
    spec = importlib.util.spec_from_file_location("test_architecture", REPOSITORY / "tests" / "test_architecture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LAYERS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check the picture is current")
    args = parser.parse_args()
    text = DOC.read_text()
    current, wanted = drawn(text), block(layers_enforced())
    if current is None:
        sys.exit(f"{DOC} has no picture between {BEGIN!r} and {END!r}: add the two lines where it goes")
    if args.check:
        if current != wanted:
            sys.exit(f"{DOC}'s picture is not tests/test_architecture.py's LAYERS: run python tools/house_diagram.py")
        return
    DOC.write_text(text.replace(current, wanted))


if __name__ == "__main__":
    main()
