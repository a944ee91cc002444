"""kvcanary's version: pyproject.toml's ``[project] version`` is the one place it is written,
read here from the installed distribution's metadata (``pip install -e .`` or the image's
``pip install .`` puts it there). Nothing else in ``replay`` or ``kvcal`` spells it out."""

from importlib.metadata import version

DISTRIBUTION = "kvcanary"  # pyproject.toml's [project] name

__version__ = version(DISTRIBUTION)
