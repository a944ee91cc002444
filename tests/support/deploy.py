"""Reading deploy/ the way a cluster and an image build would, offline: every YAML document
with the published schema of its kind (deploy/schemas/README.md says where each comes from),
the Containerfile's instructions, and what installing kvcanary with an extra brings in."""

from __future__ import annotations

import functools
import importlib.metadata as md
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml
from jsonschema import Draft202012Validator
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from tests.conftest import ROOT

DEPLOY = ROOT / "deploy"
SCHEMAS = DEPLOY / "schemas"
KUBERNETES = SCHEMAS / "kubernetes"
CONTAINERFILE = ROOT / "Containerfile"

# (apiVersion, kind) -> its schema. A kind missing here is a manifest the tests refuse.
SCHEMA_FILES = {
    ("batch/v1", "Job"): KUBERNETES / "job-batch-v1.json",
    ("v1", "ConfigMap"): KUBERNETES / "configmap-v1.json",
    ("v1", "PersistentVolumeClaim"): KUBERNETES / "persistentvolumeclaim-v1.json",
    ("v1", "Pod"): KUBERNETES / "pod-v1.json",
    ("locust.io/v2", "LocustTest"): SCHEMAS / "locusttest-v2.json",
}


@dataclass(frozen=True)
class Manifest:
    """One YAML document of a file under deploy/."""

    path: str  # relative to the repository
    index: int  # its place in the file
    doc: dict[str, Any]

    @property
    def id(self) -> str:
        return f"{self.path}#{self.index}"


def manifests(root: Path = DEPLOY) -> list[Manifest]:
    """Every YAML document under deploy/, in file order."""
    out = []
    for path in sorted([*root.rglob("*.yaml"), *root.rglob("*.yml")]):
        text = path.read_text(encoding="utf-8")
        for i, doc in enumerate(d for d in yaml.safe_load_all(text) if d is not None):
            out.append(Manifest(str(path.relative_to(ROOT)), i, doc))
    return out


def of_kind(kind: str) -> list[Manifest]:
    return [m for m in manifests() if m.doc.get("kind") == kind]


# -- schemas ------------------------------------------------------------------------------------


def _json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def structural(node: Any) -> Any:
    """A CRD's openAPIV3Schema as the API server applies it under strict field validation (the
    default of ``kubectl apply``): an object schema that lists its ``properties`` and says
    nothing of others rejects them, where JSON Schema would let them through."""
    if isinstance(node, list):
        return [structural(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: structural(v) for k, v in node.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def validators() -> dict[tuple[str, str], Draft202012Validator]:
    """A validator per kind, every ``$ref`` resolved from the vendored files (never fetched)."""
    defs = _json(KUBERNETES / "_definitions.json")
    registry: Registry[Any] = Registry().with_resource(
        defs["$id"], DRAFT202012.create_resource(defs)
    )
    out = {}
    for key, path in SCHEMA_FILES.items():
        schema = _json(path)
        if path.parent == SCHEMAS:  # a CRD's schema, not Kubernetes' own strict one
            schema = structural(schema)
        Draft202012Validator.check_schema(schema)
        out[key] = Draft202012Validator(schema, registry=registry)
    return out


def problems(doc: dict[str, Any]) -> list[str]:
    """What the API server would refuse in ``doc``, one line each (field path: reason)."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    known = validators()
    if key not in known:
        return [f"no schema for apiVersion {key[0]!r}, kind {key[1]!r}; known: {sorted(known)}"]
    return sorted(
        f"{'.'.join(map(str, e.absolute_path)) or '(document)'}: {e.message}"
        for e in known[key].iter_errors(doc)
    )


# -- pods ---------------------------------------------------------------------------------------


def under(path: str, folder: str) -> bool:
    return PurePosixPath(path).is_relative_to(PurePosixPath(folder))


def mount_of(path: str, mounts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The volume mount that holds ``path`` (the deepest), or None."""
    holding = [m for m in mounts if under(path, m["mountPath"])]
    return max(holding, key=lambda m: len(m["mountPath"]), default=None)


def volume(name: str, volumes: list[dict[str, Any]]) -> dict[str, Any]:
    found = [v for v in volumes if v["name"] == name]
    assert len(found) == 1, f"volume {name!r}: {len(found)} volumes of that name in {volumes}"
    return found[0]


# -- the Containerfile --------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    args: str  # continuation lines joined
    line: int


def instructions(path: Path = CONTAINERFILE) -> list[Instruction]:
    """The Containerfile's instructions, comments dropped and continuation lines joined."""
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if not pending:
            start = n
        if line.startswith("#"):
            continue
        pending.append(line.removesuffix("\\").strip())
        if not line.endswith("\\"):
            keyword, _, args = " ".join(pending).partition(" ")
            out.append(Instruction(keyword.upper(), args.strip(), start))
            pending = []
    assert not pending, f"{path}: the last instruction ends with a continuation"
    return out


def exec_form(args: str) -> list[str]:
    """``["a", "b"]`` (JSON, the exec form) as a list; shell form is refused."""
    value = json.loads(args)
    assert isinstance(value, list), f"{args}: not the exec form"
    return [str(v) for v in value]


# -- what an install brings in -----------------------------------------------------------------


def requirement_closure(
    name: str, extras: frozenset[str], skip: Callable[[str], bool] = lambda _: False
) -> dict[str, str]:
    """Every distribution ``pip install name[extras]`` installs, each with who asked for it,
    from the installed distributions' metadata (markers evaluated for this interpreter, which
    is the image's Python). ``skip``: names not to follow (they are still listed)."""
    wanted: dict[str, str] = {canonicalize_name(name): "(the project)"}
    todo: list[tuple[str, frozenset[str]]] = [(name, extras)]
    done: set[tuple[str, frozenset[str]]] = set()
    while todo:
        dist, ex = todo.pop()
        if (canonicalize_name(dist), ex) in done or skip(dist):
            continue
        done.add((canonicalize_name(dist), ex))
        for req in _requirements(dist, ex):
            wanted.setdefault(canonicalize_name(req.name), dist)
            todo.append((req.name, frozenset(req.extras)))
    return wanted


def _requirements(dist: str, extras: frozenset[str]) -> Iterator[Requirement]:
    try:
        lines = md.requires(dist) or []
    except md.PackageNotFoundError:
        raise AssertionError(
            f"{dist} is not installed here: cannot follow its requirements"
        ) from None
    for line in lines:
        req = Requirement(line)
        envs = [{"extra": e} for e in extras] or [{"extra": ""}]
        if req.marker is None or any(req.marker.evaluate(env) for env in envs):
            yield req


def project_extras(pyproject_text: str) -> set[str]:
    """The names of pyproject.toml's optional-dependency groups."""
    import tomllib

    return set(tomllib.loads(pyproject_text)["project"]["optional-dependencies"])


def image_workdir_and_copies() -> tuple[str, dict[str, str]]:
    """The image's final WORKDIR, and where each repository folder or file is copied to."""
    workdir, copies = "/", {}
    for ins in instructions():
        if ins.keyword == "WORKDIR":
            workdir = str(PurePosixPath(workdir) / ins.args)
        elif ins.keyword == "COPY":
            *sources, dest = ins.args.split()
            for src in sources:
                target = PurePosixPath(workdir) / dest
                copies[src.rstrip("/")] = str(target if len(sources) == 1 else target / src)
    return workdir, copies


def repo_path(image_path: str) -> Path | None:
    """The repository file the image holds at ``image_path``, by the Containerfile's COPYs."""
    for src, dest in image_workdir_and_copies()[1].items():
        if under(image_path, dest):
            return ROOT / src / PurePosixPath(image_path).relative_to(dest)
    return None


# -- the Locust operator ------------------------------------------------------------------------

OPERATOR_MASTER_PORT = 5557


def fields(command: str) -> list[str]:
    """A command seed split as the Locust operator splits it (Go's strings.Fields: on white
    space, no quoting)."""
    return command.split()


def operator_commands(test: dict[str, Any]) -> dict[str, list[str]]:
    """The master's and a worker's argument lists as the operator (2.x, internal/resources/
    command.go) builds them: the seed split on white space, its flags, then extraArgs."""
    spec, name = test["spec"], test["metadata"]["name"].replace(".", "-")
    master = spec["master"]
    flags = ["--master", f"--master-port={OPERATOR_MASTER_PORT}"]
    flags.append(f"--expect-workers={spec['worker']['replicas']}")
    if master.get("autostart", True):
        flags.append("--autostart")
    autoquit = master.get("autoquit", {"enabled": True})
    if autoquit["enabled"]:
        flags += ["--autoquit", str(autoquit.get("timeout", 60))]
    flags += ["--enable-rebalancing", "--only-summary"]
    worker = ["--worker", f"--master-port={OPERATOR_MASTER_PORT}", f"--master-host={name}-master"]
    return {
        "master": fields(master["command"]) + flags + master.get("extraArgs", []),
        "worker": fields(spec["worker"]["command"]) + worker + spec["worker"].get("extraArgs", []),
    }
