"""One error tree: every exception kvcanary raises as its own is defined in
``replay/core/errors.py`` and drawn in that module's docstring, under its parent."""

from __future__ import annotations

import importlib
import pkgutil
import re

import kvcal
import replay
from replay.core import errors
from replay.core.errors import KvcanaryError


def _import_all() -> None:
    # Optional dependencies (torch, vllm, locust) may be absent: such a module defines no
    # error this tree lacks, since the test below would then fail where they are installed.
    for package in (replay, kvcal):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.endswith("__main__"):  # runs the command line when imported
                continue
            try:
                importlib.import_module(info.name)
            except ImportError:
                continue


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub, *_subclasses(sub)}
    return out


def test_every_kvcanary_error_is_defined_in_errors_and_drawn_in_its_tree() -> None:
    _import_all()
    found = {c for c in _subclasses(KvcanaryError) if c.__module__.startswith(("replay", "kvcal"))}
    elsewhere = sorted(
        f"{c.__module__}.{c.__name__}" for c in found if c.__module__ != errors.__name__
    )
    assert not elsewhere, f"define these in replay/core/errors.py: {elsewhere}"
    doc = errors.__doc__ or ""
    depth = {}
    for line in doc.splitlines():
        m = re.match(r"^\s*([│ ]*)(?:[├└]── )?([A-Z]\w+)\s", line)
        if m and m.group(2) in {c.__name__ for c in found} | {"KvcanaryError"}:
            depth[m.group(2)] = len(m.group(1)) // 4 + (1 if "──" in line else 0)
    for c in found:
        assert c.__name__ in depth, f"{c.__name__} is not drawn in replay/core/errors.py's tree"
        parent = c.__bases__[0].__name__
        assert depth[c.__name__] == depth[parent] + 1, f"{c.__name__} is not drawn under {parent}"
