"""Targets: what each server under test is, from ``--targets`` or a targets TOML file.

An external server is named by URL; a local one by a model, which ``local_server`` starts.
Specs are validated as they are read (a bad one is a ``ConfigError`` naming it), and what a
spec expects of the served KV cache is checked against what the server reports.
"""

from __future__ import annotations

import base64
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from replay.core.credentials import (
    env_for_record,
    header_value_problem,
    redact,
    without_user_info,
)
from replay.core.errors import ConfigError, ServingMismatch
from replay.serving import kv_formats
from replay.serving.scale_log import EMULATED_FP8 as EMULATED_FP8

# Target names that need no definition: bf16 (the model's own dtype), every --kv-cache-dtype
# value vLLM takes (fp8, fp8_e5m2, int8_per_token_head, ...) and each emulable one with
# "-emulated" (a BF16 server rounding K/V through it). All on the default model.
BUILTIN_DTYPES = {
    "bf16": "auto",
    **{name: name for name in kv_formats.FORMATS},
    **{kv_formats.emulated(name): kv_formats.emulated(name) for name in kv_formats.EMULABLE},
}
# What an emulated target's server logs when kvcal's plugin (kvcal/vllm_plugin.py) runs,
# followed by "[FORMAT, ROUNDING rounding]": the plugin's contract, with the environment
# local_server gives it.
EMULATION_MARKER = "kvcanary kv emulation: active"


@dataclass(frozen=True)
class TargetSpec:
    """What a target is. Exactly one of ``url`` and ``model`` is set."""

    name: str
    url: str | None = None
    api_key_env: str | None = None
    model: str | None = None
    kv_cache_dtype: str = "auto"
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    # Served cache dtype we expect; None = no expectation (e.g. an unnamed external server).
    expect_cache_dtype: str | None = None
    # reference, candidate or calibrated (replay/analysis/roles.py); None: guessed from the name.
    role: str | None = None
    # An emulated cache's rounding: cpu (truncation) or cuda; None: the engine's for its format.
    rounding: str | None = None

    @property
    def is_local(self) -> bool:
        return self.model is not None

    @property
    def emulated(self) -> bool:
        """An emulated cache: quality evidence only, never capacity or speed."""
        return self.emulated_format is not None

    @property
    def emulated_format(self) -> str | None:
        """The format an emulated target rounds K/V through (fp8-emulated -> fp8)."""
        return kv_formats.emulated_format(self.kv_cache_dtype) or kv_formats.emulated_format(
            self.expect_cache_dtype
        )

    @property
    def connect_url(self) -> str | None:
        """The URL requests are sent to: ``url`` without its user-info (sent as Basic auth
        instead), its query kept (every request carries it)."""
        return None if self.url is None else without_user_info(self.url)[0]

    def api_key(self) -> str | None:
        """Read from the environment at connect time; never stored or written anywhere. A key
        that cannot go into a header line is refused, naming the variable, not the key."""
        if not self.api_key_env:
            return None
        key = os.environ.get(self.api_key_env)
        if key is None:
            raise ConfigError(
                f"target '{self.name}': environment variable "
                f"{self.api_key_env} (api_key_env) is not set"
            )
        problem = header_value_problem(key)
        if problem is not None:
            raise ConfigError(
                f"target '{self.name}': environment variable {self.api_key_env} (api_key_env) "
                f"holds {problem}; set it to the key alone, one line of printable ASCII "
                f"(from a file: {self.api_key_env}=\"$(tr -d '\\r\\n' < KEYFILE)\")"
            )
        return key

    def auth_headers(self) -> dict[str, str]:
        """What every call to this target carries, and calls elsewhere never do: each session
        opened toward the target is made with these headers (and follows no redirect). The
        key of ``api_key_env`` as a Bearer token, else the URL's user-info as Basic auth."""
        key = self.api_key()
        if key:
            return {"Authorization": f"Bearer {key}"}
        login = None if self.url is None else without_user_info(self.url)[1]
        if login is None:
            return {}
        token = base64.b64encode(":".join(login).encode("utf-8")).decode("ascii")
        return {"Authorization": f"Basic {token}"}

    def describe(self) -> dict[str, Any]:
        """For the manifest: everything but secrets (the key's variable name only; the URL
        without its user-info and query values)."""
        return {
            "name": self.name,
            "url": None if self.url is None else redact(self.url),
            "api_key_env": self.api_key_env,
            "model": self.model,
            "kv_cache_dtype": self.kv_cache_dtype,
            "args": list(self.args),
            "env": env_for_record(self.env),
            "expect_cache_dtype": self.expect_cache_dtype,
            "role": self.role,
            "rounding": self.rounding,
        }


def expected_dtype_for(name: str, kv_cache_dtype: str | None) -> str | None:
    """The cache a target means: its kv_cache_dtype, else the format its name starts with
    (``fp8_e5m2-b`` -> fp8_e5m2, ``bf16-b`` -> auto, ``nvfp4-emulated`` itself)."""
    if kv_cache_dtype is not None:
        return kv_cache_dtype
    if name.lower() in BUILTIN_DTYPES:
        return BUILTIN_DTYPES[name.lower()]
    return kv_formats.format_of_name(name)


def cache_dtype_matches(expected: str, served: str) -> bool:
    """vLLM reports 'auto' for the model's own dtype; fp8 is fp8_e4m3, fp8_e5m2 is not;
    an emulated cache stores BF16 (the plugin's log line shows the rest)."""
    return kv_formats.same_format(expected, served)


def emulate_kv(spec: TargetSpec, families: frozenset[str] | None = None) -> TargetSpec:
    """``--emulate-kv`` (``--emulate-fp8``: the FP8 family only): a local target of a
    quantized format kvcanary emulates, served as BF16 with that format's round trip."""
    fmt = kv_formats.FORMATS.get(spec.kv_cache_dtype)
    if not spec.is_local or fmt is None or not fmt.emulable:
        return spec
    if families is not None and fmt.family not in families:
        return spec
    dtype = kv_formats.emulated(fmt.name)
    return replace(spec, kv_cache_dtype=dtype, expect_cache_dtype=dtype)


def emulate_fp8(spec: TargetSpec) -> TargetSpec:
    """``--emulate-fp8``: a local FP8 target (fp8, fp8_e4m3, fp8_e5m2) emulated."""
    return emulate_kv(spec, frozenset({"fp8"}))


def check_served_dtype(
    spec: TargetSpec, served: str | None, log_text: str | None, problems: list[str]
) -> None:
    """Raise ServingMismatch when the target does not run the KV cache its spec means;
    append to ``problems`` what cannot be verified. ``log_text``: a local server's log."""
    if spec.expect_cache_dtype is None:
        return
    if served is None:
        problems.append(
            "cache_dtype not reported by /metrics (vllm:cache_config_info); cannot verify"
        )
    elif not cache_dtype_matches(spec.expect_cache_dtype, served):
        raise ServingMismatch(
            f"served cache_dtype is '{served}' but target '{spec.name}' expects "
            f"'{spec.expect_cache_dtype}': the server is not running the KV cache "
            "this target is meant to test"
        )
    fmt = spec.emulated_format
    if fmt is None:
        return
    if log_text is None:
        problems.append(
            f"'{spec.name}' is declared {fmt}-emulated; without the server's log "
            "kvcanary cannot see that the emulation plugin runs"
        )
    elif EMULATION_MARKER not in log_text:
        raise ServingMismatch(
            f"target '{spec.name}' is {fmt}-emulated but its server never logged "
            f"'{EMULATION_MARKER}': install kvcanary in the server's environment (its "
            "vllm.general_plugins entry point) and keep VLLM_PLUGINS unset or naming "
            "kvcanary_fp8_emulation"
        )
    elif f"{EMULATION_MARKER} [{fmt}," not in log_text:
        raise ServingMismatch(
            f"target '{spec.name}' is {fmt}-emulated but its server's plugin emulates "
            "another format (its log line: "
            f"{next(ln for ln in log_text.splitlines() if EMULATION_MARKER in ln).strip()})"
        )


def parse_targets(
    text: str,
    default_model: Path | None,
    config: Mapping[str, TargetSpec] | None = None,
    layers_arm: str | None = None,
) -> list[TargetSpec]:
    """``bf16,fp8,fp8_e5m2`` (built-ins on the default model: bf16 and every KV format),
    ``name=URL``, ``name=MODEL_DIR`` (a local server; dtype from the name: ``fp8-cal=DIR``)
    or names from a config. ``layers_arm``: the name ``--skip-layers`` gives layers, which
    needs no definition either (``fp8-swa``: FP8 on the default model)."""
    specs: list[TargetSpec] = []
    for raw in (p.strip() for p in text.split(",")):
        if not raw:
            continue
        name, sep, url = raw.partition("=")
        name = name.strip()
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
            raise ConfigError(
                f"--targets: '{name}' is not a valid target name (letters, digits, '_', '-', '.')"
            )
        if sep and not re.match(r"https?://", url.strip()):
            specs.append(_local_dir_target(name, raw, Path(url.strip()).expanduser()))
        elif sep:
            url = url.strip().rstrip("/")
            check_url(url, f"--targets: '{name}'")
            specs.append(
                TargetSpec(name=name, url=url, expect_cache_dtype=expected_dtype_for(name, None))
            )
        elif config and name in config:
            specs.append(config[name])
        elif name.lower() in BUILTIN_DTYPES:
            name = name.lower()
            if default_model is None:
                raise ConfigError(f"--targets: '{name}' needs a local model (--model)")
            specs.append(
                TargetSpec(
                    name=name,
                    model=str(default_model),
                    kv_cache_dtype=BUILTIN_DTYPES[name],
                    args=DEFAULT_MODEL_ARGS,
                    expect_cache_dtype=BUILTIN_DTYPES[name],
                )
            )
        elif name == layers_arm:
            specs.append(_layers_target(name, default_model))
        else:
            quantized = [n for n, f in kv_formats.FORMATS.items() if f.quantized]
            known = ["bf16", *quantized, *kv_formats.UNQUANTIZED, *sorted(config or {})]
            raise ConfigError(
                f"--targets: unknown target '{name}'. Available: "
                f"{', '.join(known)} (a format with -emulated: emulated in a BF16 "
                "server); or name=URL for an external server"
            )
    if not specs:
        raise ConfigError("--targets: no targets given")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"--targets: duplicate target names in {names}")
    return specs


def check_url(url: str, where: str) -> None:
    """Refuse a target URL that would be sent as something else than written: a space or a
    control character (the request line would break there), a comma (``--targets`` splits
    there), a fragment (never sent), a bad port or no host. The message shows the URL
    redacted: it may hold a password or a token."""
    problem = _url_problem(url)
    if problem is not None:
        raise ConfigError(f"{where}: {redact(url)}: {problem}")


def _url_problem(url: str) -> str | None:
    if any(ch.isspace() for ch in url):
        return "holds a space or a line break; percent-encode it (%20)"
    if "," in url:  # --targets separates targets with one
        return "holds a comma; percent-encode it (%2C)"
    if (problem := header_value_problem(url)) is not None:
        return f"holds {problem}; percent-encode it (a host in punycode)"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is no number or out of range
    except ValueError as exc:
        return f"is no URL kvcanary can send to ({exc})"
    if not parts.hostname:
        return "names no host (http://HOST:PORT)"
    if "#" in url:
        return "holds a '#' fragment, which is never sent; percent-encode a '#' as %23"
    return None


def _layers_target(name: str, default_model: Path | None) -> TargetSpec:
    """``--targets fp8-swa --skip-layers fp8-swa=...``: the layers arm on the default model,
    its KV format the one its name starts with (the layers themselves are added later)."""
    dtype = kv_formats.format_of_name(name)
    fmt = kv_formats.FORMATS.get(dtype or "")
    if fmt is None or not fmt.quantized:
        raise ConfigError(
            f"--targets: '{name}' (the --skip-layers arm): start its name with a quantized KV "
            "format (fp8-swa, fp8_e5m2-skip) so its KV cache dtype is known"
        )
    if default_model is None:
        raise ConfigError(f"--targets: '{name}' needs a local model (--model)")
    return TargetSpec(
        name=name,
        model=str(default_model),
        kv_cache_dtype=fmt.name,
        args=DEFAULT_MODEL_ARGS,
        expect_cache_dtype=fmt.name,
    )


def _local_dir_target(name: str, raw: str, model: Path) -> TargetSpec:
    """``fp8-cal=DIR``: a local server on another checkpoint folder (a calibrated overlay,
    say), its KV cache dtype taken from the format its name starts with."""
    if not (model / "config.json").is_file():
        raise ConfigError(
            f"--targets: '{raw}': expected name=http://host:port or "
            f"name=MODEL_DIR; {model} is no model folder (no config.json)"
        )
    dtype = expected_dtype_for(name, None)
    if dtype is None:
        raise ConfigError(
            f"--targets: '{raw}': start a local model target's name with bf16 or a KV "
            "format (e.g. fp8-cal=DIR, fp8_e5m2-b=DIR) so its KV cache dtype is known"
        )
    return TargetSpec(
        name=name,
        model=str(model.resolve()),
        kv_cache_dtype=dtype,
        args=DEFAULT_MODEL_ARGS,
        expect_cache_dtype=dtype,
    )


# The embedded default model speaks hermes-style tool calls.
DEFAULT_MODEL_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")

_TARGET_KEYS = {
    "url",
    "api_key_env",
    "model",
    "kv_cache_dtype",
    "args",
    "env",
    "expect_cache_dtype",
    "role",
    "rounding",
}


def load_targets_config(path: Path) -> dict[str, TargetSpec]:
    """A TOML file of ``[targets.NAME]`` tables (see scenarios/targets.example.toml)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    tables = data.get("targets")
    if not isinstance(tables, dict) or not tables:
        raise ConfigError(f"{path}: expected one or more [targets.NAME] tables")
    out: dict[str, TargetSpec] = {}
    for name, t in tables.items():
        where = f"{path}: [targets.{name}]"
        if not isinstance(t, dict):
            raise ConfigError(f"{where}: must be a table")
        unknown = set(t) - _TARGET_KEYS
        if unknown:
            raise ConfigError(
                f"{where}: unknown key(s) {sorted(unknown)}; valid keys: {sorted(_TARGET_KEYS)}"
            )
        if ("url" in t) == ("model" in t):
            raise ConfigError(
                f"{where}: set exactly one of 'url' (external server) and "
                "'model' (a local server kvcanary starts)"
            )
        strings = ("url", "api_key_env", "model", "kv_cache_dtype", "expect_cache_dtype", "role")
        for key in (*strings, "rounding"):
            if key in t and not isinstance(t[key], str):
                raise ConfigError(f"{where}: '{key}' must be a string")
        if t.get("rounding") not in (None, "cpu", "cuda"):
            raise ConfigError(f'{where}: \'rounding\' must be "cpu" or "cuda"')
        args = t.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ConfigError(f"{where}: 'args' must be a list of strings")
        env = t.get("env", {})
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise ConfigError(f"{where}: 'env' must be a table of strings")
        if "url" in t and not re.match(r"https?://", t["url"]):
            raise ConfigError(f"{where}: 'url' must start with http:// or https://")
        if "url" in t:
            check_url(t["url"], f"{where}: 'url'")
        if "url" in t and "api_key_env" in t and without_user_info(t["url"])[1] is not None:
            raise ConfigError(
                f"{where}: 'url' holds a user name and password (sent as Basic auth) and "
                "'api_key_env' a key (sent as a Bearer token): a request carries one "
                "Authorization header, so give one of them"
            )
        dtype = t.get("kv_cache_dtype", "auto")
        out[name] = TargetSpec(
            name=name,
            url=t.get("url"),
            api_key_env=t.get("api_key_env"),
            model=t.get("model"),
            kv_cache_dtype=dtype,
            args=tuple(args),
            env=dict(env),
            expect_cache_dtype=t.get(
                "expect_cache_dtype", dtype if "model" in t else expected_dtype_for(name, None)
            ),
            role=t.get("role"),
            rounding=t.get("rounding"),
        )
    return out
