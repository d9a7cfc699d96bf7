"""What runbus shows or stores never holds a secret: values hidden by their name or their shape.

The producer applies `redact` to a run's config and `redact_argv` to its command line before they
leave the process; the store and the pages apply them again to what they hold and show, for
entries written by hand. `safe_url` and `redact_text` keep passwords out of log lines and errors;
`safe_remote` keeps tokens out of a git remote's URL.
Console lines and log texts go through `redact_line` (redact_text behind a cheap screen), a
stream's lines in order through a `LineRedactor`, which also hides a private key printed line by
line.

By name: a value whose key or option names a secret is shown as MARKER, unless it is null,
true/false or empty (those hold no secret). The name is split into lower-case words (at `_`, `-`,
`.`, spaces and camelCase humps) and is a secret's when
  - its words, joined, contain secret, password, passwd, passphrase, credential, signature,
    apikey, accesskey, privatekey, authtoken, accesstoken or refreshtoken
    (`DB_PASSWORD`, `aws_secret_access_key`, `X-Api-Key`, `apiKey`), or
  - its last word is key, token, pass, pwd, auth, authorization, sig or cookie, or ends in token or auth
    (`hf_token`, `HFTOKEN`, `api_key`, `db_pass`, `oauth`, `Authorization`).
So `max_tokens`, `pad_token_id`, `key_dim`, `num_passes`, `tokenizer` and `author` stay visible:
a secret word that is not the last word names a count, an id or a size, not the secret itself.
Harmless names that end in key or token (`sort_key`, `pad_token`) are hidden too: a false alarm
costs one value on a page, a miss costs a credential.

By shape, in any string, anywhere: a URL's password (userinfo or a secret query parameter, as
`safe_url` masks it), `NAME=VALUE` and `"NAME": "VALUE"` pairs with a secret NAME, `Bearer`
credentials (16 characters or more, or 6 or more that are not all letters: `Bearer abc.def.ghi`,
not "bearer bonds") and `Basic` ones, PEM private keys, and tokens with a known prefix (Hugging
Face `hf_`, OpenAI and Anthropic `sk-`, GitHub `ghp_`/`github_pat_`, GitLab `glpat-`, Slack
`xox?-`, AWS `AKIA`, JWTs). Long random strings without such a prefix are left alone: a 40-hex
string is as often a git commit as an API key.
"""

from __future__ import annotations

import base64
import binascii
import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple
from urllib.parse import quote, quote_plus, unquote, unquote_plus

MARKER = "***"
# The password in runbus's own hints (`redis://[USER]:PASSWORD@HOST`), left as written.
PLACEHOLDER = "PASSWORD"

_STRONG = (
    "secret",
    "password",
    "passwd",
    "passphrase",
    "credential",
    "signature",
    "apikey",
    "accesskey",
    "privatekey",
    "authtoken",
    "accesstoken",
    "refreshtoken",
)
_LAST_WORDS = frozenset({"key", "token", "pass", "pwd", "auth", "authorization", "sig", "cookie"})
_LAST_ENDINGS = ("token", "auth")

_HUMP = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_WORD_SEPARATORS = re.compile(r"[^A-Za-z0-9]+")


@functools.lru_cache(maxsize=4096)  # log lines name the same few keys (loss=, lr=) again and again
def secret_name(name: str) -> bool:
    """Whether a key or option called `name` holds a secret (the rule is in the module docstring)."""
    words = [w for w in _WORD_SEPARATORS.split(_HUMP.sub("_", name).lower()) if w]
    if not words:
        return False
    joined = "".join(words)
    if any(strong in joined for strong in _STRONG):
        return True
    return words[-1] in _LAST_WORDS or words[-1].endswith(_LAST_ENDINGS)


class _Url(NamedTuple):
    """A URL in its parts, read by hand rather than by urlsplit, which refuses some URLs (a `[`
    in the userinfo) that a message may still hold, and ends the userinfo at a `/` that a
    password typed unescaped may hold (base64 ones do)."""

    scheme: str
    userinfo: str | None  # None: no `@`
    rest: str  # host, port and path
    query: str | None  # without its `?`; None: no `?`
    fragment: str  # with its `#`

    @classmethod
    def read(cls, url: str) -> _Url | None:
        scheme, sep, rest = url.partition("://")
        if not sep:
            return None
        rest, hash_sign, fragment = rest.partition("#")
        rest, question, query = rest.partition("?")
        userinfo, at, rest = rest.rpartition("@")
        return cls(scheme, userinfo if at else None, rest, query if question else None, hash_sign + fragment)

    @property
    def password(self) -> str | None:
        if self.userinfo is None or ":" not in self.userinfo:
            return None
        password = self.userinfo.partition(":")[2]
        return None if password == PLACEHOLDER else password

    def fields(self) -> list[tuple[str, bool]]:
        """The query's `name=value` fields as written, each with whether it holds a secret. A
        field without `=` after a secret one is a piece of it: a password with an unescaped `&`."""
        fields: list[tuple[str, bool]] = []
        for field in (self.query or "").split("&"):
            if "=" not in field and fields and fields[-1][1]:
                fields[-1] = (fields[-1][0] + "&" + field, True)
            else:
                fields.append((field, secret_name(unquote_plus(field.partition("=")[0]))))
        return fields


def safe_url(url: str) -> str:
    """`url` with any password, in its userinfo or a secret query parameter, replaced by MARKER."""
    parts = _Url.read(url)
    if parts is None:
        return url
    userinfo, query = parts.userinfo, parts.query
    if parts.password is not None and userinfo is not None:
        userinfo = f"{userinfo.partition(':')[0]}:{MARKER}"
    fields = parts.fields()
    if any(secret for _, secret in fields):
        query = "&".join(f"{f.partition('=')[0]}={MARKER}" if secret else f for f, secret in fields)
    if userinfo == parts.userinfo and query == parts.query:
        return url
    shown = "" if userinfo is None else userinfo + "@"
    return f"{parts.scheme}://{shown}{parts.rest}{'' if query is None else '?' + query}{parts.fragment}"


# URL schemes whose user name is a login rather than a place for a token (`ssh://git@host/x.git`).
_LOGIN_SCHEMES = ("ssh", "git+ssh", "ssh+git")


def safe_remote(url: str) -> str:
    """A git remote's URL fit to leave the process or be shown: what safe_url and redact_text
    hide, and the whole user part of a URL but an ssh one (`https://TOKEN@host/x.git` names no
    password, yet a token is what it holds); `git@host:x.git` and `ssh://git@host/x.git` stay."""
    shown = redact_text(safe_url(url))
    parts = _Url.read(shown)
    if parts is None or parts.userinfo is None or parts.scheme.lower() in _LOGIN_SCHEMES:
        return shown
    query = "" if parts.query is None else "?" + parts.query
    return f"{parts.scheme}://{MARKER}@{parts.rest}{query}{parts.fragment}"


def url_secrets(url: str) -> list[str]:
    """The secrets `url` holds (its password, secret query values), as written, decoded and in
    the pieces a driver may quote (split at `/` and `&`), longest first: to mask them wherever a
    driver's error text quotes them (`redact_text`)."""
    parts = _Url.read(url)
    if parts is None:
        return []
    written = [] if parts.password is None else [parts.password]
    written += [field.partition("=")[2] for field, secret in parts.fields() if secret]
    found = set()
    for value in written:
        for form in (value, unquote(value), unquote_plus(value)):
            found |= {form, quote(form, safe=""), quote_plus(form), *re.split("[/&]", form)}
    return sorted((s for s in found if len(s) >= MIN_SCRUBBED), key=len, reverse=True)


# Shorter known secrets are not scrubbed from free text: masking every "ab" would garble it.
MIN_SCRUBBED = 3

# Each pattern starts only where its first character does not continue a run of the characters
# it reads (a lookbehind), and bounds what it may read again, so that no text, however hostile,
# costs more than linear time.
_URL = re.compile(r"(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]{0,30}://[^\s'\"<>`]+")
_PAIR = re.compile(
    r"""(?<![\w.])(?P<name>[A-Za-z_][\w.\-]{0,100})(?P<sep>\s{0,10}=\s{0,10})"""
    r"""(?P<value>"[^"]{0,4096}"|'[^']{0,4096}'|[^\s&;,'"]+)"""
)
_QUOTED_PAIR = re.compile(
    r"""(?P<q>["'])(?P<name>[^"'\s]{1,100})(?P=q)(?P<sep>\s{0,10}:\s{0,10})"""
    r"""(?P<value>"(?:[^"\\]|\\.){0,4096}"|'(?:[^'\\]|\\.){0,4096}')"""
)
_TOKEN = re.compile(
    r"(?<![A-Za-z0-9_\-])(?:hf_[A-Za-z0-9]{30,}"
    r"|sk-(?=[A-Za-z0-9_\-]{0,100}[0-9])[A-Za-z0-9_\-]{20,}"
    r"|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}"
    r"|glpat-[A-Za-z0-9_\-]{20,}"
    r"|xox[abposr]-[A-Za-z0-9\-]{10,}"
    r"|AKIA[0-9A-Z]{16}"
    r"|eyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,})"
)
_BEARER = re.compile(r"\b(?P<scheme>Bearer)\s+(?P<value>[A-Za-z0-9._~+/\-]{6,}=*)", re.IGNORECASE)
_BASIC = re.compile(r"\b(?P<scheme>Basic)\s+(?P<value>[A-Za-z0-9+/]{8,}={0,2})", re.IGNORECASE)
_PEM = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)", re.DOTALL)


def redact_text(text: str, known: Iterable[str] = ()) -> str:
    """`text` with every secret of a recognisable shape replaced by MARKER (the shapes are in
    the module docstring), and every string in `known` too (see `url_secrets`)."""
    for secret in known:
        text = text.replace(secret, MARKER)
    return _redacted_shapes(text, every_pair=True)


def redact_line(text: str) -> str:
    """`text` as redact_text shows it, for a log line: NAME=VALUE and "NAME": "VALUE" pairs are
    read only where a secret word stands whole in the line once `_`, `-` and `.` are taken out
    (a word broken by another character, `pass/word=x`, is not looked for in log lines)."""
    return _redacted_shapes(text, every_pair=False)


# Substrings each pattern needs: most lines hold none, and a few substring checks cost far less
# than running the patterns over them.
_TOKEN_MARKS = (
    "hf_", "sk-", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "glpat-", "xox", "AKIA", "eyJ",
)  # fmt: skip
# Every _STRONG word, last word and ending holds one of these.
_NAME_STEMS = ("secret", "pass", "credential", "sig", "key", "token", "auth", "pwd", "cookie")


def _may_name_a_secret(text: str) -> bool:
    joined = text.lower().replace("_", "").replace("-", "").replace(".", "")
    return any(stem in joined for stem in _NAME_STEMS)


def _redacted_shapes(text: str, every_pair: bool) -> str:
    """`text` through each pattern whose marks it holds; its pairs only where a secret word
    stands whole (_may_name_a_secret) unless `every_pair`."""
    if "://" in text:
        text = _URL.sub(lambda m: safe_url(m[0]), text)
    equals = "=" in text
    quoted = ":" in text and ('"' in text or "'" in text)
    if (equals or quoted) and (every_pair or _may_name_a_secret(text)):
        if equals:
            text = _PAIR.sub(_masked_pair, text)
        if quoted:
            text = _QUOTED_PAIR.sub(_masked_pair, text)
    for mark in _TOKEN_MARKS:
        if mark in text:
            text = _TOKEN.sub(MARKER, text)
            break
    low = text.lower()
    if "bearer" in low:
        text = _BEARER.sub(_masked_bearer, text)
    if "basic" in low:
        text = _BASIC.sub(_masked_basic, text)
    if "-----BEGIN" in text:
        text = _PEM.sub(MARKER, text)
    return text


_PEM_BEGIN = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")
_PEM_END = re.compile(r"-----END [A-Z ]*PRIVATE KEY-----")
# What a line of a PEM key's body can be: base64, an RFC 1421 header, blank.
_PEM_BODY = re.compile(r"\s*(?:[A-Za-z0-9+/=]*|(?:Proc-Type|DEK-Info|Comment):.*)\s*")


class LineRedactor:
    """Redacts one stream's lines in their order (`redact_line`), and hides a PEM private key that
    the stream writes over several lines: every line from its BEGIN line through its END line, or
    up to the first line that cannot be a key's (a key cut short). Not thread-safe: one per stream."""

    __slots__ = ("_key_prefix",)

    def __init__(self) -> None:
        # Inside a key: what preceded its BEGIN on that line (`[rank0]: `, repeated on each line).
        self._key_prefix: str | None = None

    def __call__(self, text: str) -> str:
        if self._key_prefix is not None:
            rest = self._past_key(text, self._key_prefix)
            if rest is None:
                return MARKER
            text = rest
        self._key_prefix = _open_key(text)
        return redact_line(text)

    def _past_key(self, text: str, prefix: str) -> str | None:
        """`text` with the key's lines it starts with as MARKER; None when it is all the key's."""
        lines = text.split("\n")
        for index, line in enumerate(lines):
            end = _PEM_END.search(line)
            if end:
                self._key_prefix = None
                return "\n".join([MARKER + line[end.end() :], *lines[index + 1 :]])
            body = line[len(prefix) :] if prefix and line.startswith(prefix) else line
            if not _PEM_BODY.fullmatch(body):
                self._key_prefix = None
                return text if index == 0 else "\n".join([MARKER, *lines[index:]])
        return None


def _open_key(text: str) -> str | None:
    """What precedes, on its line, a PEM private key's BEGIN that `text` does not END; else None."""
    if "-----BEGIN" not in text:
        return None
    last = None
    for match in _PEM_BEGIN.finditer(text):
        last = match
    if last is None or _PEM_END.search(text, last.end()):
        return None
    return text[text.rfind("\n", 0, last.start()) + 1 : last.start()]


def _masked_pair(match: re.Match[str]) -> str:
    if not secret_name(match["name"]) or match["value"].strip("\"'") in ("", MARKER):
        return match[0]
    mark = match["value"][0] if match["value"][0] in "\"'" else ""
    return match[0][: match.start("value") - match.start()] + f"{mark}{MARKER}{mark}"


def _masked_bearer(match: re.Match[str]) -> str:
    # A credential is long, or more than a word ("Bearer abc.def.ghi"): "bearer bonds" is prose.
    value = match["value"]
    return f"{match['scheme']} {MARKER}" if len(value) >= 16 or not value.isalpha() else match[0]


def _masked_basic(match: re.Match[str]) -> str:
    # Only what decodes to `user:password` is a credential: "basic settings" is not.
    try:
        decoded = base64.b64decode(match["value"] + "=" * (-len(match["value"]) % 4), validate=True)
    except (binascii.Error, ValueError):
        return match[0]
    return f"{match['scheme']} {MARKER}" if b":" in decoded else match[0]


def redact(value: Any) -> Any:
    """`value` (JSON-like: dicts, lists, strings, numbers) with secrets replaced by MARKER: by
    name in every dict at any depth, by shape in every string (dict keys included); a list
    under a key named `argv` is read as a command line (`redact_argv`); a dict or list nested
    deeper than MAX_DEPTH is MARKER whole. A new value: the argument is not changed."""
    return _redacted(value, 0)


# No config nests this deep; a hand-written entry that does would exhaust Python's stack.
MAX_DEPTH = 100


def _redacted(value: Any, depth: int) -> Any:
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, Mapping | list | tuple) and depth >= MAX_DEPTH:
        return MARKER
    if isinstance(value, Mapping):
        return {_redacted_key(key): _redacted_item(str(key), item, depth + 1) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_redacted(item, depth + 1) for item in value]
    return value


def _redacted_key(key: Any) -> Any:
    # A secret used as a name (`{"hf_…": 1}`) is hidden by its shape, as it would be in a value.
    return redact_text(key) if isinstance(key, str) else key


def _redacted_item(name: str, value: Any, depth: int) -> Any:
    if secret_name(name) and _holds_secret(value):
        return MARKER
    if name == "argv" and isinstance(value, list) and all(isinstance(a, str) for a in value):
        return redact_argv(value)
    return _redacted(value, depth)


def _holds_secret(value: Any) -> bool:
    return not (
        value is None or isinstance(value, bool) or value in ("", MARKER) or value == {} or value == []
    )


# Short options that take a password (`mysql -p PW`, `-pPW`); short options are too terse to
# read by name, so only this one is hidden.
_SHORT_SECRET = "-p"  # noqa: S105 - an option's name, not a password


def redact_argv(argv: Sequence[str]) -> list[str]:
    """A command line with its secrets as MARKER: the value of an option named as a secret
    (`--api-key X`, `--api-key=X`, `-api-key=X`, `--pass X`, `--auth X`), of `-p X` and `-pX`,
    `NAME=VALUE` arguments with a secret NAME (`db.password=X`), and every secret by shape
    (URLs with a password, known tokens) in any argument. The argument after a secret option is
    taken as its value unless it starts with `--`."""
    redacted: list[str] = []
    hide_next = False
    for arg in map(str, argv):
        if hide_next and not arg.startswith("--"):
            redacted.append(MARKER)
            hide_next = False
            continue
        hide_next = False
        if arg == _SHORT_SECRET:
            hide_next = True
        elif arg.startswith(_SHORT_SECRET) and not arg.startswith("--") and len(arg) > len(_SHORT_SECRET):
            arg = _SHORT_SECRET + MARKER
        elif arg.startswith("-") and "=" not in arg and secret_name(arg):
            hide_next = True
        elif arg.startswith("-") and secret_name(arg.partition("=")[0]):
            arg = arg.partition("=")[0] + "=" + MARKER
        redacted.append(redact_text(arg))
    return redacted
