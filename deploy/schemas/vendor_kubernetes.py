"""Copy the Kubernetes JSON schemas deploy/'s manifests need out of a kubernetes-validate wheel
(Apache-2.0): the schema of each kind in KINDS, unchanged, and the shared definitions they
reach, unchanged but without the thousands they never reach. Offline, from the wheel file:

    pip download --no-deps kubernetes-validate==1.37.0 -d /tmp/kv
    python deploy/schemas/vendor_kubernetes.py /tmp/kv/kubernetes_validate-1.37.0-py3-none-any.whl

deploy/schemas/README.md says which version of Kubernetes and of the wheel the copies are."""

from __future__ import annotations

import json
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

KUBERNETES = "v1.35.0-local-strict"  # strict: a field the API does not know is an error
KINDS = ("configmap-v1", "job-batch-v1", "persistentvolumeclaim-v1", "pod-v1")
DEFINITIONS = "_definitions.json"
OUT = Path(__file__).resolve().parent / "kubernetes"


def refs(node: Any) -> Iterator[str]:
    """Every ``$ref`` under ``node``."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


def reached(kinds: list[Any], defs: dict[str, Any]) -> dict[str, Any]:
    """The definitions the kinds' schemas reach, directly or through one another."""
    seen: dict[str, Any] = {}
    todo = [ref for kind in kinds for ref in refs(kind)]
    while todo:
        name = todo.pop().rpartition("/")[2]
        if name not in seen:
            seen[name] = defs[name]
            todo.extend(refs(defs[name]))
    return dict(sorted(seen.items()))


def write(path: Path, schema: Any) -> None:
    path.write_text(json.dumps(schema, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(wheel: str) -> None:
    prefix = f"kubernetes_validate/kubernetes-json-schema/{KUBERNETES}/"
    with zipfile.ZipFile(wheel) as zf:
        raw = {k: zf.read(f"{prefix}{k}.json") for k in KINDS}
        everything = json.loads(zf.read(prefix + DEFINITIONS))
    OUT.mkdir(exist_ok=True)
    for name, data in raw.items():
        (OUT / f"{name}.json").write_bytes(data)  # byte for byte
    kinds = {name: json.loads(data) for name, data in raw.items()}
    defs = {key: value for key, value in everything.items() if key != "$defs"}
    defs["$defs"] = reached(list(kinds.values()), everything["$defs"])
    write(OUT / DEFINITIONS, defs)
    print(f"{len(kinds)} kinds and {len(defs['$defs'])} definitions written to {OUT}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
