"""The redaction and terminal rules as pure functions: which names and shapes are secrets, which
harmless names stay visible, every argv form, and every control character a terminal obeys."""

from __future__ import annotations

import argparse

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runbus.redact import (
    MARKER,
    MAX_DEPTH,
    LineRedactor,
    redact,
    redact_argv,
    redact_line,
    redact_text,
    safe_url,
    secret_name,
    url_secrets,
)
from runbus.terminal import json_printable, printable

SECRET_NAMES = [
    "api_key", "API_KEY", "apiKey", "X-Api-Key", "wandb.api_key", "hf_token", "HF_TOKEN", "hfToken",
    "HFTOKEN", "token", "auth_token", "db_password", "DB_PASSWORD", "password", "passwd", "pass",
    "db_pass", "pwd", "secret", "client_secret", "aws_secret_access_key", "aws_access_key_id",
    "credentials", "GOOGLE_APPLICATION_CREDENTIALS", "auth", "http_auth", "oauth", "Authorization",
    "Proxy-Authorization", "private_key", "passphrase", "key", "X-Amz-Signature", "sig", "Cookie",
    "use_auth_token", "--api-key", "--pass", "--auth", "sslpassword",
]  # fmt: skip
HARMLESS_NAMES = [
    "lr", "max_tokens", "num_tokens", "max_new_tokens", "pad_token_id", "bos_token_id", "tokenizer",
    "tokenizer_name", "key_dim", "num_key_value_heads", "keys", "passes", "num_passes", "bypass",
    "compass", "author", "authors", "authority", "auth_type", "monkey", "hotkey", "redis_url",
    "hf_token_path", "keys-file", "ssl_keyfile", "sslkey", "", "---",
]  # fmt: skip


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_secret_names(name):
    assert secret_name(name)


@pytest.mark.parametrize("name", HARMLESS_NAMES)
def test_harmless_names_stay_visible(name):
    assert not secret_name(name)


def test_config_is_redacted_by_name_at_any_depth_and_by_shape_anywhere():
    config = {
        "lr": 3e-4,
        "max_tokens": 2048,
        "use_auth_token": True,  # true/false, null and empty hold no secret: shown
        "hf_token": None,
        "api_key": "",
        "wandb": {"api_key": "wandb-sekrit", "project": "p", "entity": {"token": 12345}},
        "headers": [{"Authorization": "Bearer tok-sekrit"}, {"Accept": "json"}],
        "credentials": {"user": "u", "password": "cred-sekrit"},
        "redis": "redis://u:url-sekrit@h:6379/0",
        "cache": "redis://h:6379/0?password=query-sekrit&db=2",
        "dsn": "host=db user=u password=dsn-sekrit",
        "note": "Authorization: Bearer abcdefghijklmnopqrstuvwxyz012345",
        "openai": ["sk-proj-abcdef0123456789ABCDEF", "hf_" + "x" * 34],
        "basic": "Basic " + "dXNlcjpiYXNpYy1zZWtyaXQ=",
        "basic_training": "basic settings here",
        "commit": "9d8e2c7" * 5 + "abcde",
        "pem": "-----BEGIN RSA PRIVATE KEY-----\nMIIE\n-----END RSA PRIVATE KEY-----",
    }
    shown = redact(config)
    assert shown == {
        "lr": 3e-4,
        "max_tokens": 2048,
        "use_auth_token": True,
        "hf_token": None,
        "api_key": "",
        "wandb": {"api_key": MARKER, "project": "p", "entity": {"token": MARKER}},
        "headers": [{"Authorization": MARKER}, {"Accept": "json"}],
        "credentials": MARKER,
        "redis": "redis://u:***@h:6379/0",
        "cache": "redis://h:6379/0?password=***&db=2",
        "dsn": "host=db user=u password=***",
        "note": "Authorization: Bearer ***",
        "openai": [MARKER, MARKER],
        "basic": "Basic ***",
        "basic_training": "basic settings here",
        "commit": config["commit"],
        "pem": MARKER,
    }
    assert "sekrit" not in orjson.dumps(shown).decode()
    assert config["wandb"]["api_key"] == "wandb-sekrit"  # a new value: the argument is unchanged


def test_a_namespace_like_object_config_goes_through_vars():
    from runbus.producer.metadata import plain_values

    args = argparse.Namespace(api_key="ns-sekrit", lr=0.1, redis_url="redis://:ns-pw@h/0")
    assert plain_values(args, "config") == {"api_key": MARKER, "lr": 0.1, "redis_url": "redis://:***@h/0"}


def test_every_argv_form():
    argv = [
        "train.py",
        "--api-key", "s1",
        "--api-key=s2",
        "--token", "s3",
        "--TOKEN=s4",
        "--redis-url", "redis://u:s5@h:6379/0",
        "--redis-url=redis://:s6@h:6379/0",
        "-p", "s7",
        "-ps8",
        "--pass", "s9",
        "--auth", "s10",
        "--auth=s11",
        "-db-password=s12",
        "redis://:s13@127.0.0.1:6379/0",
        "postgresql://root@h/db?password=s14&sslmode=disable",
        "db.password=s15",
        "--header", "Authorization: Bearer abcdefghijklmnop0123",
        "--use-auth-token", "--lr", "0.1",
        "--keys-file", "keys.txt",
        "--num-passes", "3",
    ]  # fmt: skip
    assert redact_argv(argv) == [
        "train.py",
        "--api-key", MARKER,
        "--api-key=***",
        "--token", MARKER,
        "--TOKEN=***",
        "--redis-url", "redis://u:***@h:6379/0",
        "--redis-url=redis://:***@h:6379/0",
        "-p", MARKER,
        "-p***",
        "--pass", MARKER,
        "--auth", MARKER,
        "--auth=***",
        "-db-password=***",
        "redis://:***@127.0.0.1:6379/0",
        "postgresql://root@h/db?password=***&sslmode=disable",
        "db.password=***",
        "--header", "Authorization: Bearer ***",
        "--use-auth-token", "--lr", "0.1",  # a flag followed by an option hides nothing
        "--keys-file", "keys.txt",
        "--num-passes", "3",
    ]  # fmt: skip


def test_an_argv_list_in_a_start_event_is_read_as_a_command_line():
    start = {"hardware": {"argv": ["t.py", "--hf-token", "hf-sekrit", "-p", "pw"], "host": "h"}}
    assert redact(start) == {"hardware": {"argv": ["t.py", "--hf-token", MARKER, "-p", MARKER], "host": "h"}}


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://u:pw@h:6379/0", "redis://u:***@h:6379/0"),
        ("redis://:pw@h", "redis://:***@h"),
        ("rediss://h:6380/0?password=pw&ssl_cert_reqs=none", "rediss://h:6380/0?password=***&ssl_cert_reqs=none"),
        ("postgresql://u@h/db?sslpassword=a&passfile=p&sslmode=require", "postgresql://u@h/db?sslpassword=***&passfile=p&sslmode=require"),
        ("https://b.s3.amazonaws.com/o?X-Amz-Signature=abc&X-Amz-Date=1", "https://b.s3.amazonaws.com/o?X-Amz-Signature=***&X-Amz-Date=1"),
        ("redis://u:p@ss@h/0", "redis://u:***@h/0"),  # an unescaped '@' in the password
        ("redis://u:pw@h:notaport/0", "redis://u:***@h:notaport/0"),
        ("postgres://u:pw@[::1]:5432/db#x", "postgres://u:***@[::1]:5432/db#x"),
        ("redis://u:pw@[::1/0", "redis://u:***@[::1/0"),  # urlsplit refuses this one
        ("redis+cluster://:pw@a:1,b:2/0", "redis+cluster://:***@a:1,b:2/0"),
        ("redis://[USER]:PASSWORD@HOST:PORT/DB", "redis://[USER]:PASSWORD@HOST:PORT/DB"),  # the hint
        ("redis://u@h:6379/0", "redis://u@h:6379/0"),
        ("sqlite:////tmp/runbus.db", "sqlite:////tmp/runbus.db"),
    ],
)  # fmt: skip
def test_safe_url(url, shown):
    assert safe_url(url) == shown


def test_a_driver_error_quoting_the_urls_secrets_is_masked():
    url = "postgresql://u:p%40ss-word@h/db?sslpassword=key+pass"
    # Decoded or not, inside the URL or alone: a driver's text may quote them any way.
    said = "bad login p@ss-word for postgresql://u:p%40ss-word@h/db; cannot decrypt with key pass"
    shown = redact_text(said, url_secrets(url))
    assert shown == "bad login *** for postgresql://u:***@h/db; cannot decrypt with ***"


@pytest.mark.parametrize(
    "text",
    [
        "=" + "a" * 200_000,
        "a" * 200_000 + "://",
        "-" * 200_000 + "=x",
        "x." * 100_000 + "=",
        '"k": "' * 50_000,
        "'password': '" * 50_000,
        "-----BEGIN RSA PRIVATE KEY-----" * 10_000,
        "Bearer " * 50_000,
        "sk-" + "a" * 200_000,
        "sk-" * 70_000,
        "eyJ-" * 50_000,
        "hf_" * 70_000,
        'a="' * 70_000,
        "redis://" + "@" * 100_000,
    ],
    ids=lambda text: repr(text[:12]),
)
def test_hostile_text_takes_linear_time(text):
    """Each of these took quadratic time or more with unbounded patterns: minutes, not
    milliseconds, for one start entry. Here they return (the suite's per-test timeout guards)."""
    redact_text(text, url_secrets(text))
    redact({"a": [text]})


def test_a_config_nested_deeper_than_the_stack_is_redacted_without_error():
    deep = orjson.loads('{"a":' * 1000 + '{"api_key": "deep-sekrit"}' + "}" * 1000)
    shown = redact(deep)
    for _ in range(MAX_DEPTH):
        shown = shown["a"]
    assert shown == MARKER


HOSTILE = "a\x1b[2Jb\x1b]52;c;aGFja2Vk\x07c\x9b31md\u202eevil\u2066e\x00f\x7fg\th"


def test_printable_shows_every_control_but_tab_and_newline():
    shown = printable(HOSTILE + "\nnext")
    assert shown == ("a\\x1b[2Jb\\x1b]52;c;aGFja2Vk\\x07c\\x9b31md\\u202eevil\\u2066e\\x00f\\x7fg\th\nnext")
    assert not any((ord(c) < 0x20 and c not in "\t\n") or 0x7F <= ord(c) <= 0x9F for c in shown)
    assert printable("plain text, ünïcödé, 中文, emoji 🎉") == "plain text, ünïcödé, 中文, emoji 🎉"


def test_json_printable_is_the_same_json_value():
    text = orjson.dumps({"text": HOSTILE}).decode()
    escaped = json_printable(text)
    assert orjson.loads(escaped) == {"text": HOSTILE}
    assert not any(0x7F <= ord(c) <= 0x9F or c in "\u202e\u2066" for c in escaped)


def test_a_secret_used_as_a_key_is_hidden_by_its_shape():
    token = "hf_" + "AbCdEfGh12" * 4
    assert redact({token: 1, "nested": {"url redis://u:pw-sekrit@h/0": 2}, "lr": 0.1}) == {
        MARKER: 1,
        "nested": {"url redis://u:***@h/0": 2},
        "lr": 0.1,
    }


# Pieces of log lines: whole secret words, shapes' marks, separators and plain words.
FRAGMENTS = [
    "password", "pass", "word", "api", "key", "Key", "token", "hf", "secret", "auth", "Bearer ",
    "Basic ", "dXNlcjpwdw==", "abc.def.ghi", "sig", "cookie", "pwd", "credential", "private",
    "_", "-", ".", "=", ":", " ", "/", "@", "://", "?", "&", '"', "'", "redis", "u", "x", "0",
    "loss", "step", "-----BEGIN RSA PRIVATE KEY-----", "AKIA", "ABCDEFGHIJKLMNOP", "eyJ", "sk-",
    "abcdefghijklmnopqrstuvwxyz0123", "\u00e9", "\t",
]  # fmt: skip


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join))
def test_redact_line_is_redact_text_for_any_line(text):
    """redact_line's screen rules out only lines that redact_text leaves as they are."""
    assert redact_line(text) == redact_text(text)


@pytest.mark.parametrize(
    ("line", "shown"),
    [
        (
            "redis://:hunter2pw@h Authorization: Bearer abc.def.ghi",
            "redis://:***@h Authorization: Bearer ***",
        ),
        ("password=pw-in-log-42 token=t0k api_key=k3y", "password=*** token=*** api_key=***"),
        ("psycopg: postgresql://alice:secret@db/x refused", "psycopg: postgresql://alice:***@db/x refused"),
        ("epoch 3 loss=0.25 lr=1e-4 tokens/s=1200", "epoch 3 loss=0.25 lr=1e-4 tokens/s=1200"),
        ("Bearer token expired; bearer bonds", "Bearer token expired; bearer bonds"),
    ],
)
def test_redact_line(line, shown):
    assert redact_line(line) == shown


def test_a_private_key_printed_line_by_line_is_hidden_line_by_line():
    redactor = LineRedactor()
    lines = [
        "before",
        "[rank0]: -----BEGIN OPENSSH PRIVATE KEY-----",
        "[rank0]: b3BlbnNzaC1rZXktdjEAAAAABG5vbmU=",
        "[rank0]: ",
        "[rank0]: -----END OPENSSH PRIVATE KEY----- password=x",
        "after",
        "-----BEGIN PRIVATE KEY-----",
        "Proc-Type: 4,ENCRYPTED",
        "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC",
        "a key cut short: this line is not the key's",
        "-----BEGIN EC PRIVATE KEY-----\nMHcCAQEEI\n-----END EC PRIVATE KEY-----",
        "the whole key in one line, and after it:",
    ]
    assert [redactor(line) for line in lines] == [
        "before",
        "[rank0]: ***",
        MARKER,
        MARKER,
        "*** password=***",
        "after",
        MARKER,
        MARKER,
        MARKER,
        "a key cut short: this line is not the key's",
        MARKER,
        "the whole key in one line, and after it:",
    ]


def test_a_key_over_multi_line_texts_is_hidden_to_its_end():
    redactor = LineRedactor()
    assert redactor("a record:\n-----BEGIN RSA PRIVATE KEY-----\nMIIE") == "a record:\n***"
    assert redactor("MIIEbody\n-----END RSA PRIVATE KEY-----\nnext line") == "***\nnext line"
    assert redactor("MIIEnot a key") == "MIIEnot a key"
