"""Labelled secrets: a value under a label that names a secret (``password=…``, ``?token=…``,
``"client_secret": "…"``, ``Authorization: Token …``), the label kept and the value replaced,
and what is not a value (templates, references, paths, examples, names, code)."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator

from replay.tools.pii._random import word_share
from replay.tools.pii._reading import PLACEHOLDER, Hit

_LABEL = re.compile(
    r"(?:pass(?:word|wd|phrase|code)?|pwd|secrets?|token|key|auth(?:orization)?"
    r"|sig(?:nature)?|credentials?|creds|session(?:_?id)?|sid)"
    r"(?P<q>\\?[\"'])?[ \t]{0,3}(?P<sep>:=|=>|[:=](?![=:]))[ \t]{0,3}",
    re.I,
)
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}\Z")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_ALWAYS = frozenset(
    {
        "password",
        "passwd",
        "passphrase",
        "passcode",
        "pwd",
        "secret",
        "secrets",
        "credential",
        "credentials",
        "creds",
        "authorization",
    }
)
_SOMETIMES = frozenset(
    {"token", "key", "auth", "sig", "signature", "session", "sessionid", "sid", "pass"}
)
# A label glued into one word (apikey, clientsecret, csrftoken): its secret word is split off.
_GLUED = ("password", "passwd", "signature", "secret", "token", "key", "auth", "sig")
_SECRET_PREFIX = frozenset(
    {
        "access",
        "refresh",
        "auth",
        "session",
        "bearer",
        "api",
        "oauth",
        "oauth2",
        "csrf",
        "xsrf",
        "client",
        "app",
        "private",
        "secret",
        "master",
        "signing",
        "encryption",
        "license",
        "subscription",
        "account",
        "service",
        "personal",
        "admin",
        "user",
        "db",
        "database",
        "basic",
        "http",
        "proxy",
        "webhook",
        "jwt",
        "amz",
        "goog",
        "aws",
        "azure",
        "gcp",
        "github",
        "gitlab",
        "slack",
        "hf",
        "openai",
        "anthropic",
        "stripe",
        "twilio",
        "sendgrid",
        "deploy",
        "upload",
        "reset",
        "verify",
        "verification",
        "invite",
        "magic",
        "login",
        "sas",
        "storage",
        "consumer",
        "bot",
        "vault",
        "hmac",
        "shared",
        "smtp",
        "mail",
        "ftp",
        "ssh",
        "redis",
        "postgres",
        "mysql",
        "mongo",
        "ldap",
        "wifi",
    }
)
_SCHEME = re.compile(r"(?:bearer|basic|token|digest|apikey|key|bot|oauth|ssws|jwt)[ \t]+", re.I)
# An unquoted value ends at a separator; "=" only as base64 padding (key=key=... is no value).
_UNQUOTED = re.compile(r"[^\s\"'`<>&;,()\[\]{}\\=]{1,256}={0,2}")
_DUMMY = frozenset(
    {
        "none",
        "null",
        "nil",
        "true",
        "false",
        "undefined",
        "lambda",
        "self",
        "cls",
        "len",
        "str",
        "int",
        "bytes",
        "string",
        "object",
        "any",
        "optional",
        "required",
        "redacted",
        "hidden",
        "masked",
        "removed",
        "omitted",
        "censored",
        "value",
        "example",
        "placeholder",
        "your",
        "here",
        "env",
        "default",
        "empty",
        "unset",
        "not",
        "set",
        "n/a",
        "tbd",
        "todo",
        "foo",
        "bar",
        "baz",
        "test",
        "dummy",
        "secret",
        "password",
        "token",
        "key",
        "name",
        "bool",
        "dict",
        "list",
        "text",
        "char",
        "varchar",
        "yes",
        "no",
        "on",
        "off",
        "enabled",
        "disabled",
        "auto",
        "see",
        "xxx",
        "include",
        "omit",
        "same-origin",
        "bearer",
        "basic",
        "digest",
        "await",
        "yield",
        "async",
        "return",
        "if",
        "else",
        "in",
        "is",
        "and",
        "or",
        "new",
        "this",
    }
)
_TEMPLATE = re.compile(r"[$%{<*!]|.*?(?:\{\{|\$\{|%\()")
_PATH = re.compile(r"(?:/|~/|\.\.?/|[A-Za-z]:\\)")
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
_IDENT = re.compile(r"[A-Za-z_]\w*")
_NAME_VALUE = re.compile(r"[A-Za-z_][\w-]*")
_ELIDED = re.compile(r".*?(?:\.\.\.|…|\*\*\*)")  # sk-..., hf_***: an example, not a key
# Words that make a value without digits describe itself: my-secret, your-api-key, FOOBAR.
_EXAMPLE_WORDS = frozenset(
    {
        "secret",
        "secrets",
        "password",
        "passwd",
        "pass",
        "pwd",
        "key",
        "token",
        "apikey",
        "api",
        "example",
        "sample",
        "dummy",
        "fake",
        "test",
        "your",
        "my",
        "placeholder",
        "here",
        "value",
        "demo",
        "changeme",
        "foo",
        "bar",
        "xxx",
    }
)
_CAPS_WORD = re.compile(r"[A-Z]{2,12}")
_SNAKE = re.compile(r"_?[a-z]+(?:_[a-z0-9]+)+|[a-z]+(?:[A-Z][a-z]+)+")  # creds_file, inMemory
# A type in an annotation: private_key: PKCS7PrivateKeyTypes, password: SecretStr.
_TYPE_NAME = re.compile(r"_?(?:[A-Z][A-Z0-9]*[a-z0-9]*){2,}")
_LINE_HEAD = re.compile(r"(?:^|[\n{,])[ \t]*(?:- )?[\"']?\Z")
_ENV_NAME = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+")
_KEYLIKE = re.compile(r"[A-Za-z0-9+/=_.~%-]{8,}")
_LETTERS = re.compile(r"[^\W\d_]+")
_MORE_WORDS = re.compile(r"[ \t]+[^\s,;}\]]")  # the line goes on: prose, not a config value
_ALWAYS_SECRET, _SOMETIMES_SECRET = 2, 1


@functools.lru_cache(maxsize=4096)
def _label_words(name: str) -> tuple[str, ...]:
    words = [w for w in re.split(r"[_.\-]+", _CAMEL.sub("_", name).lower()) if w]
    if len(words) >= 2 and words[-2:] == ["session", "id"]:
        words[-2:] = ["sessionid"]
    if words and words[-1] not in _ALWAYS | _SOMETIMES:
        glued = next((g for g in _GLUED if words[-1].endswith(g)), None)
        head = words[-1][: -len(glued)] if glued else ""
        if glued and (glued in _ALWAYS or head in _SECRET_PREFIX):  # not monkey, oauth
            words[-1:] = [head, glued]
    return tuple(words)


@functools.lru_cache(maxsize=4096)
def _label_strength(name: str, in_query: bool = False) -> int:
    """How surely a value under this name is a secret: always (``password``, ``client_secret``,
    ``?token=``), sometimes (``token``, ``eos_token``: only a key-like value) or not (0)."""
    words = _label_words(name)
    if not words:
        return 0
    last, prefix = words[-1], words[:-1]
    if last in _ALWAYS:
        return _ALWAYS_SECRET
    if last not in _SOMETIMES:
        return 0
    if prefix:
        return _ALWAYS_SECRET if _SECRET_PREFIX.intersection(prefix) else _SOMETIMES_SECRET
    return _ALWAYS_SECRET if in_query else _SOMETIMES_SECRET


def _keylike(v: str) -> bool:
    return (
        bool(_KEYLIKE.fullmatch(v))
        and any(c.isdigit() for c in v)
        and any(c.isalpha() for c in v)
        and word_share(v) < 0.6
    )


def _value_is_secret(value: str, strength: int, code_like: bool = False) -> bool:
    """A labelled value that is a secret, not a template, a reference, a path or a word;
    ``code_like``: unquoted outside a URL, so it may be an expression (a variable passed on)."""
    v = value.strip()
    if len(v) < 3 or PLACEHOLDER.fullmatch(v) or len(set(v)) == 1:
        return False
    if _TEMPLATE.match(v) or _PATH.match(v) or v.lower() in _DUMMY or _ENV_NAME.fullmatch(v):
        return False
    if _ELIDED.match(v) or (v.isdigit() and len(v) < 6) or v.startswith("__"):
        return False
    if not any(c.isdigit() for c in v) and (
        _CAPS_WORD.fullmatch(v)
        or _EXAMPLE_WORDS.intersection(_label_words(v))
        or (_NAME_VALUE.fullmatch(v) and _label_strength(v))
    ):
        return False  # FOOBAR, my-secret, GRANT_TYPE = "refresh_token": a name, not a value
    if strength < _ALWAYS_SECRET:
        return _keylike(v)
    # key=str.lower, password=auth_from_netrc, creds=in_memory: an expression or a variable
    return not (code_like and (_DOTTED.fullmatch(v) or _SNAKE.fullmatch(v)))


def _value_start(text: str, pos: int, name: str) -> int:
    """Past an authorization scheme (``Bearer``, ``Basic``, ``Token``...), which is no secret."""
    m = _SCHEME.match(text, pos)
    return m.end() if m and _label_words(name)[-1:] in (("authorization",), ("auth",)) else pos


def label_hit(text: str, label: str) -> Iterator[Hit]:
    """The whole string, when it is the value of a secret-labelled key of a JSON object."""
    strength = _label_strength(label)
    a = _value_start(text, len(text) - len(text.lstrip()), label)
    b = len(text.rstrip())
    if strength and a < b and _value_is_secret(text[a:b], strength):
        yield Hit(a, b, "credential", text[a:b])


def _quoted_end(text: str, pos: int, quote: str) -> int | None:
    """The closing quote of a value, or the end of a text cut off inside it; not past a line."""
    close = text.find(quote, pos, pos + 513)
    stop = close if close >= 0 else min(len(text), pos + 513)
    if "\n" in text[pos:stop]:
        return None
    if close < 0:
        return len(text) if len(text) - pos <= 512 else None
    return close


def _labelled_value(text: str, m: re.Match[str]) -> tuple[int, int] | None:
    word_end = m.start("q") if m.group("q") else m.start("sep")
    while word_end > m.start() and text[word_end - 1] in " \t":
        word_end -= 1
    nm = _NAME.search(text, max(0, word_end - 64), word_end)
    if nm is None:
        return None
    name = nm.group(0).lstrip(".-_")
    start = word_end - len(name)
    in_query = start > 0 and text[start - 1] in "?&;#" and m.group("sep") == "="
    strength = _label_strength(name, in_query)
    if not strength:
        return None
    pos = _value_start(text, m.end(), name)
    quote = next((q for q in ('\\"', "\\'", '"', "'", "`") if text.startswith(q, pos)), None)
    if quote:
        pos += len(quote)
        end = _quoted_end(text, pos, quote)
        if end is None:
            return None
        code_like = False
    else:
        um = _UNQUOTED.match(text, pos)
        if um is None:
            return None
        end = um.end()
        if _ELIDED.match(text, pos, end):
            return None  # OPENAI_API_KEY=sk-...: an example
        while end > pos and text[end - 1] in ".:":
            end -= 1
        if text[end : end + 1] in ("(", "[") and not in_query:
            return None  # a call or a subscript
        code_like = not in_query
        if m.group("sep") == ":" and not in_query and _colon_prose(text, start, pos, end):
            return None
        spaced = m.group(0)[-1:] in " \t" or text[m.start("sep") - 1 : m.start("sep")] in " \t"
        if (
            code_like
            and spaced
            and m.group("sep") != ":"
            and _IDENT.fullmatch(text, pos, end)
            and not any(c.isdigit() for c in text[pos:end])
        ):
            return None  # credential = configuration: an assignment from a variable
    if not _value_is_secret(text[pos:end], strength, code_like):
        return None
    return pos, end


def _colon_prose(text: str, start: int, pos: int, end: int) -> bool:
    """``label: value`` that is prose or a type, not a config line: a lone word that is not a
    whole line's value ("Password: see the guide", "standing credential: polling"), or a
    type name (``private_key: PKCS7PrivateKeyTypes``)."""
    v = text[pos:end]
    if _TYPE_NAME.fullmatch(v) and word_share(v) >= 0.75:
        return True
    if not _LETTERS.fullmatch(v):
        return False
    return bool(_MORE_WORDS.match(text, end)) or not _LINE_HEAD.search(
        text, max(0, start - 8), start
    )


def credential(text: str) -> Iterator[Hit]:
    for m in _LABEL.finditer(text):
        span = _labelled_value(text, m)
        if span:
            yield Hit(span[0], span[1], "credential", text[span[0] : span[1]])
