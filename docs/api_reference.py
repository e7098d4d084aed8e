"""Build the API reference of meshbus's public surface (``make docs``) and check it.

    python docs/api_reference.py OUTPUT_DIR

The surface is what ``meshbus.__all__`` lists. pdoc renders it from the docstrings,
into OUTPUT_DIR/index.html and a page per module. The build fails -- exit 1, the
problems listed -- on any warning pdoc gives and on any public name left undocumented:
a class, function, method or property without a docstring, or a data attribute
neither documented itself nor named (as ``name``) in its class's or a base's docstring.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

# The reference is of the source: mypyc's compiled classes keep no docstrings, so the
# pure-Python leg is documented (the two legs have one source and one API).
os.environ["MESHBUS_NO_EXTENSIONS"] = "1"

import pdoc
import pdoc.doc

import meshbus


def undocumented(module: pdoc.doc.Module) -> list[str]:
    """The public names of ``module`` (its ``__all__``) and their members without docs."""
    missing: list[str] = []

    def check(owner: pdoc.doc.Module | pdoc.doc.Class) -> None:
        for member in owner.members.values():
            if member.name.startswith("_") or member.taken_from[0] == "builtins":
                continue
            if isinstance(member, pdoc.doc.Variable) and isinstance(owner, pdoc.doc.Class):
                named = f"``{member.name}``"
                if member.docstring.strip() or any(
                    named in (cls.__doc__ or "") for cls in owner.obj.__mro__
                ):
                    continue
            elif member.docstring.strip():
                if isinstance(member, pdoc.doc.Class):
                    check(member)
                continue
            missing.append(member.fullname)

    check(module)
    return missing


def main(output: Path) -> int:
    for name in meshbus.__all__:
        getattr(meshbus, name)  # the lazy names resolve, so pdoc sees them as members
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = pdoc.doc.Module(meshbus)
        pdoc.pdoc("meshbus", output_directory=output)
    problems = [f"pdoc: {w.message}" for w in caught]
    problems += [f"undocumented: {name}" for name in undocumented(module)]
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
