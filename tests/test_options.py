"""Every command-line option is also a RAWSERVE_* variable, and the two read the same.

parse_config only (no server): an option given as its variable leaves exactly the same
configuration as the flag would; a flag given beside its variable wins; the model list, which
is repeatable, takes its variable comma-separated.
"""

from __future__ import annotations

import os

import pytest

from rawserve.config import ServerConfig
from rawserve.options import OPTIONS, Option, ignored_by_the_handler, parse_config
from rawserve.shared.messages import Engine

# A valid value per option whose type alone does not give one (validated strings).
SAMPLES = {
    "--device": "cpu,cpu",
    "--engine": "onnx",
    "--dtype": "float32",
    "--batching": "count",
    "--generation": "static",
    "--log-level": "debug",
    "--log-format": "json",
    "--handler": "tests.handlers:echo",
    "--revision": "v1.0",
    "--task": "text-classification",
    "--pooling": "cls",
    "--api-key": "secret",
    "--cors-allow-origin": "https://app.example",
    "--chat-template": __file__,  # a file that exists: its text is read at parse time
    "--loop": "asyncio",
    "--host": "localhost",  # a name this machine resolves
    "--max-timeout": "600",  # not below --timeout's 30
}
# Each needs a real certificate file; tests/test_tls_cors.py serves TLS from them.
NEEDS_FILES = {"--ssl-certfile", "--ssl-keyfile"}
BY_TYPE: dict[type, str] = {int: "7", float: "2.5", str: "a-value"}


def clear_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for option in OPTIONS:
        monkeypatch.delenv(option.env, raising=False)


def flag_and_variable(option: Option) -> tuple[list[str], str]:
    """The argv that sets the option, and the variable's value that should do the same."""
    if option.type is bool:
        return [option.flag], "1"
    value = SAMPLES.get(option.flag, BY_TYPE.get(option.type, "a-value"))
    return [option.flag, value], value


@pytest.mark.parametrize(
    "option", [o for o in OPTIONS if o.flag not in NEEDS_FILES], ids=lambda o: o.env
)
def test_an_option_as_its_variable_reads_as_its_flag(monkeypatch, option):
    clear_environment(monkeypatch)
    # --http-processes 7 fits the cores
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    argv, value = flag_and_variable(option)
    from_flag = parse_config(argv)
    monkeypatch.setenv(option.env, value)
    from_variable = parse_config([])
    assert from_variable == from_flag
    assert from_variable != defaults(monkeypatch)  # the sample does change the setting


def defaults(monkeypatch: pytest.MonkeyPatch) -> ServerConfig:
    """The configuration with no flag and no variable: what the option must change."""
    with monkeypatch.context() as scoped:
        clear_environment(scoped)
        return parse_config([])


def test_the_model_list_is_comma_separated_and_given_flags_replace_it(monkeypatch):
    clear_environment(monkeypatch)
    listed = "emb=BAAI/bge-small-en-v1.5@main, cls=/models/sst2:text-classification"
    monkeypatch.setenv("RAWSERVE_MODEL", listed)
    monkeypatch.setenv("RAWSERVE_REVISION", "v2")
    monkeypatch.setenv("RAWSERVE_TASK", "feature-extraction")
    config = parse_config([])
    assert config.models == (
        "emb=BAAI/bge-small-en-v1.5@main",
        "cls=/models/sst2:text-classification",
    )
    assert (config.revision, config.task) == ("v2", "feature-extraction")
    assert parse_config(["--model", "org/name"]).models == ("org/name",)
    assert parse_config(["--revision", "abc123"]).revision == "abc123"


@pytest.mark.parametrize(
    ("listed", "says"),
    [
        (",", "entry 1 of its comma list (of 2) is empty"),
        ("org/a,,org/b", "entry 2 of its comma list (of 3) is empty"),
        ("org/a, ", "entry 2 of its comma list (of 2) is empty"),
    ],
)
def test_an_empty_entry_in_the_model_list_is_refused_as_an_empty_flag_is(
    monkeypatch, capsys, listed, says
):
    """RAWSERVE_MODEL="," served the packaged default model without a word."""
    clear_environment(monkeypatch)
    monkeypatch.setenv("RAWSERVE_MODEL", listed)
    with pytest.raises(SystemExit) as stopped:
        parse_config([])
    assert stopped.value.code == 2
    assert f"RAWSERVE_MODEL: {says}" in capsys.readouterr().err
    monkeypatch.setenv("RAWSERVE_MODEL", "  ")  # blank: none given
    assert parse_config([]).models == defaults(monkeypatch).models


@pytest.mark.parametrize(
    ("named", "says"),
    [
        ("bad alias=some/model", "'bad alias' is not a model alias"),
        ("_x=some/model", "'-', a letter or digit first, at most 96 of them"),
        ("shout=", "the model alias 'shout' names no folder or Hub id"),
        (":fill-mask", "a model name has an alias or a task but no folder or Hub id"),
        ("some/model@", "ends with '@' but names no revision"),
        ("org/tiny-bge:Not-A-Task", "'Not-A-Task' (after ':') is not a task name"),
    ],
)
def test_a_model_name_that_cannot_be_read_is_a_usage_error(monkeypatch, capsys, named, says):
    """Exit 2 with the usage line, as any flag's bad value, before any model is looked
    for: it was exit 1 after the model look-up (and the imports it needs)."""
    clear_environment(monkeypatch)
    with pytest.raises(SystemExit) as stopped:
        parse_config(["--model", named])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith(f"rawserve: error: --model {named!r}: ") and says in error


def test_a_batch_delay_longer_than_any_deadline_is_refused(monkeypatch, capsys):
    clear_environment(monkeypatch)
    assert parse_config(["--max-batch-delay-ms", "60000", "--timeout", "60"])
    with pytest.raises(SystemExit):
        parse_config(["--max-batch-delay-ms", "1e308"])
    assert (
        "--max-batch-delay-ms (1e+308) must not be above --max-timeout" in capsys.readouterr().err
    )


def test_given_origins_replace_the_variables_list_as_given_models_do(monkeypatch):
    clear_environment(monkeypatch)
    monkeypatch.setenv("RAWSERVE_CORS_ALLOW_ORIGIN", "https://a.example, https://b.example")
    assert parse_config([]).app.cors_allow_origins == ("https://a.example", "https://b.example")
    given = parse_config(["--cors-allow-origin", "https://c.example"])
    assert given.app.cors_allow_origins == ("https://c.example",)


SWITCHES = {
    "RAWSERVE_NO_WARMUP": lambda config: not config.model.warmup,
    "RAWSERVE_DOWNLOAD_ONLY": lambda config: config.download_only,
    "RAWSERVE_NO_ACCESS_LOG": lambda config: not config.access_log,
}


@pytest.mark.parametrize(
    "option", [o for o in OPTIONS if o.env != "RAWSERVE_API_KEY"], ids=lambda o: o.env
)
@pytest.mark.parametrize("empty", ["", " "])
def test_an_empty_variable_reads_as_unset(monkeypatch, option, empty):
    """`RAWSERVE_PORT=` in a compose or unit file, as click reads a variable: an empty
    number was an error and an empty --host refused, while empty switches and lists
    read as unset."""
    clear_environment(monkeypatch)
    monkeypatch.setenv(option.env, empty)
    assert parse_config([]) == defaults(monkeypatch)


def test_help_never_shows_the_api_key_its_variable_holds(monkeypatch, capsys):
    """--help showed each variable's value as the option's default, the key's too: output
    pasted into a ticket or a CI log gave the key away."""
    clear_environment(monkeypatch)
    monkeypatch.setenv("RAWSERVE_API_KEY", "s3cret-value")
    monkeypatch.setenv("RAWSERVE_PORT", "9001")
    with pytest.raises(SystemExit):
        parse_config(["--help"])
    shown = capsys.readouterr().out
    assert "s3cret-value" not in shown and "RAWSERVE_API_KEY" in shown
    assert "(default: 9001)" in shown  # another variable's value is still shown


def test_help_tells_of_the_sagemaker_word(monkeypatch, capsys):
    """`rawserve serve` (SageMaker's start) was served but never named by --help."""
    clear_environment(monkeypatch)
    with pytest.raises(SystemExit):
        parse_config(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "`rawserve serve [OPTIONS]`" in shown and "SAGEMAKER_BIND_TO_PORT" in shown


def test_an_empty_api_key_variable_is_refused_not_read_as_no_key(monkeypatch, capsys):
    """Unset, the key is none at all: a secret that expanded to nothing must not open
    every route."""
    clear_environment(monkeypatch)
    monkeypatch.setenv("RAWSERVE_API_KEY", "")
    with pytest.raises(SystemExit) as exit:
        parse_config([])
    assert exit.value.code == 2
    assert "--api-key must not be empty" in capsys.readouterr().err


@pytest.mark.parametrize("env", SWITCHES)
@pytest.mark.parametrize(("value", "on"), [("1", True), ("yes", True), ("0", False), ("", False)])
def test_the_switches_read_their_variables(monkeypatch, env, value, on):
    clear_environment(monkeypatch)
    monkeypatch.setenv(env, value)
    assert SWITCHES[env](parse_config([])) is on


def test_a_switch_variable_of_another_word_names_the_words_it_takes(monkeypatch, capsys):
    clear_environment(monkeypatch)
    monkeypatch.setenv("RAWSERVE_NO_WARMUP", "maybe")
    with pytest.raises(SystemExit) as exit:
        parse_config([])
    assert exit.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith(
        "RAWSERVE_NO_WARMUP must be one of 1, true, yes, on, 0, false, no, off, or empty"
    )
    # beside its flag, the variable is not read, as a value option's is not (it was refused)
    assert SWITCHES["RAWSERVE_NO_WARMUP"](parse_config(["--no-warmup"])) is True
    # --help and --version are answered whatever the environment holds (they were not)
    for asked in ("--help", "--version"):
        with pytest.raises(SystemExit) as exit:
            parse_config([asked])
        assert exit.value.code == 0, asked
        assert capsys.readouterr().out.strip(), asked


@pytest.mark.parametrize(
    ("env", "value", "reason"),
    [
        ("RAWSERVE_PORT", "abc", "not a whole number"),
        ("RAWSERVE_MAX_QUEUE", "1.5", "not a whole number"),
        ("RAWSERVE_TIMEOUT", "nan", "must be a finite number"),
    ],
)
def test_a_bad_variable_is_named_in_its_error(monkeypatch, capsys, env, value, reason):
    clear_environment(monkeypatch)
    monkeypatch.setenv(env, value)
    with pytest.raises(SystemExit) as exit:
        parse_config([])
    assert exit.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{env}={value!r}: {reason}" in error


def test_a_flag_replaces_a_bad_variable(monkeypatch):
    clear_environment(monkeypatch)
    monkeypatch.setenv("RAWSERVE_PORT", "abc")
    assert parse_config(["--port", "9001"]).port == 9001


@pytest.mark.parametrize("variable", ["8001", "abc"])
def test_a_bad_flag_beside_its_variable_is_named_as_the_flag(monkeypatch, capsys, variable):
    """The flag's value is the one refused, whatever the variable holds: blaming the
    variable would send the operator to fix what the flag replaces anyway."""
    clear_environment(monkeypatch)
    monkeypatch.setenv("RAWSERVE_PORT", variable)
    with pytest.raises(SystemExit) as exit:
        parse_config(["--port", "x1"])
    assert exit.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "--port" in line and "'x1'" in line and "RAWSERVE_PORT" not in line, line


@pytest.mark.parametrize(
    "argv",
    [
        ["--port", "abc"],
        ["--engine", "foo"],
        ["--engine", "handler"],  # what a handler's workers say they run, not an option
        ["--device", "gpu"],
        ["--bogus"],
    ],
)
def test_an_invalid_option_is_one_error_line(monkeypatch, capsys, argv):
    clear_environment(monkeypatch)
    with pytest.raises(SystemExit) as exit:
        parse_config(argv)
    assert exit.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("rawserve: error: ")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--device", "cpu", "--device", "cpu"], "one comma list"),  # one worker, two meant
        (["--api-key", "a", "--api-key=b"], "the server takes one key"),  # a refused, unsaid
    ],
)
def test_a_device_or_a_key_given_twice_is_refused_not_its_last_kept(
    monkeypatch, capsys, argv, says
):
    clear_environment(monkeypatch)
    with pytest.raises(SystemExit) as exit:
        parse_config(argv)
    assert exit.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"rawserve: error: {argv[0]} is given 2 times: ") and says in line
    # another option's last value wins, as a wrapper's defaults overridden by its user's;
    # what is given several times by design stays so
    config = parse_config(["--port", "5", "--model", "a=x", "--model", "b=y", "--port", "9"])
    assert config.port == 9 and len(config.models) == 2


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        # asyncio would read "" as every interface: a variable left empty must not do that
        (["--host", ""], "--host must be an address or a host name"),
        (["--host", " "], "--host must be an address or a host name"),
        (["--host", "a..b"], "--host 'a..b' is not an address or a host name"),
        # 1000 Python processes on 8 cores: only contention, and minutes to start
        (["--http-processes", "1000"], "--http-processes must be from 1 to 8"),
        (["--http-processes", "9"], "--http-processes must be from 1 to 8"),
        # the warm-up runs one batch of it: a million items of a tiny model never got ready
        (["--max-batch-size", "1000000"], "--max-batch-size must be at most 65,536"),
        # it was "answered 404", or "[Errno 21] Is a directory" once the repo was cached
        (["--revision", ""], "--revision is empty: name a branch, tag or commit"),
        # a client can send none of these: every request would be 401 "not valid"
        (["--api-key", "secret\n"], "--api-key holds a control character"),
        (["--api-key", " secret"], "--api-key begins or ends in whitespace"),
        (["--api-key", "secret "], "--api-key begins or ends in whitespace"),
        (["--api-key", "sec\x00ret"], "--api-key holds a control character"),
        # curl sent it in UTF-8, requests in Latin-1, the openai SDK not at all
        (["--api-key", "clé-secrète"], "--api-key holds a character beyond ASCII"),
    ],
)
def test_an_address_a_process_count_or_a_key_that_cannot_serve_is_refused_before_loading(
    monkeypatch, capsys, argv, says
):
    clear_environment(monkeypatch)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    with pytest.raises(SystemExit) as exit:
        parse_config(["--handler", "tests.handlers:echo", *argv])
    assert exit.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"rawserve: error: {says}")


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (["--task", "fill-mask"], "--task"),
        (["--revision", "v2"], "--revision"),
        (["--chat-template", "chat.jinja", "--revision", "v2"], "--revision, --chat-template"),
    ],
)
def test_options_a_handler_does_not_read_are_refused_not_ignored(monkeypatch, capsys, given, named):
    """A handler serves its own callable: a task, revision or chat template given beside it
    was silently ignored, as though honoured. (An engine is left: tests and deployments
    set RAWSERVE_ENGINE for every server.)"""
    clear_environment(monkeypatch)
    with pytest.raises(SystemExit) as exit:
        parse_config(["--handler", "tests.handlers:echo", *given])
    assert exit.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == f"rawserve: error: --handler serves its own callable: {named} would not apply"
    assert parse_config(["--handler", "tests.handlers:echo", "--engine", "torch"]).handler


@pytest.mark.parametrize("spec", [":", ":make", ".relative:make", "a b:c", "m:f:g", "m.:f"])
def test_a_handler_that_names_no_module_and_factory_is_refused_before_loading(
    monkeypatch, capsys, spec
):
    """It started a worker, which spent its imports (seconds) to fail on the name, exit 1."""
    clear_environment(monkeypatch)
    with pytest.raises(SystemExit) as exit:
        parse_config(["--handler", spec])
    assert exit.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == f"rawserve: error: --handler {spec!r} is not MODULE or MODULE:FACTORY " + (
        "(a dotted module name, and a name in it)"
    )
    for good in ("shout", "my_pkg.handlers:make", "tests.handlers:echo"):
        assert parse_config(["--handler", good]).handler == good
    assert parse_config(["--handler", "shout:"]).handler == "shout"  # its default factory


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "0.0.0.0", "localhost"])
def test_an_address_or_a_name_of_this_machine_is_taken(monkeypatch, host):
    clear_environment(monkeypatch)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    config = parse_config(["--handler", "tests.handlers:echo", "--host", host])
    assert config.host == host
    assert parse_config(["--handler", "tests.handlers:echo", "--http-processes", "8"])


@pytest.mark.parametrize(
    "origin",
    [
        "app.example",  # no scheme
        "https://app.example/ui",  # a path
        "https://app.example/",
        "https://a.example,https://app.example",  # two in one flag
        "https://*.example.com",  # no wildcards
        "http://a b",
        "http://[fe80::1%25eth0]",
        "https://user@app.example",
        "https://",
        "https://app.example:99999",
        "",
    ],
)
def test_a_cors_origin_no_browser_could_send_is_refused_at_start(monkeypatch, capsys, origin):
    """Each was taken, then matched no browser's Origin: every call from the page refused
    403, with nothing to say why."""
    clear_environment(monkeypatch)
    with pytest.raises(SystemExit) as exit:
        parse_config(["--handler", "tests.handlers:echo", "--cors-allow-origin", origin])
    assert exit.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("rawserve: error: --cors-allow-origin") and "not an origin" in line


def test_null_is_refused_as_an_origin_since_any_page_can_send_it(monkeypatch, capsys):
    """`--cors-allow-origin null` was taken: `Access-Control-Allow-Origin: null` then let
    any site read the answers (a sandboxed frame of its own, a data: URL sends null),
    where the operator meant file:// pages alone (a security review)."""
    clear_environment(monkeypatch)
    with pytest.raises(SystemExit) as exit:
        parse_config(["--handler", "tests.handlers:echo", "--cors-allow-origin", "null"])
    assert exit.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "any page can send Origin: null" in line and "allow *" in line


@pytest.mark.parametrize(
    ("given", "as_browsers_send_it"),
    [
        ("https://App.Example", "https://app.example"),
        ("https://app.example:443", "https://app.example"),
        ("http://localhost:80", "http://localhost"),
        ("http://localhost:3000", "http://localhost:3000"),
        ("HTTP://[::1]:8080", "http://[::1]:8080"),
        ("http://[0:0:0:0:0:0:0:1]:3000", "http://[::1]:3000"),
        ("http://127.1:3000", "http://127.0.0.1:3000"),
        ("https://bücher.example", "https://xn--bcher-kva.example"),
        # what file:// pages, extensions and app frameworks send: taken as they are
        ("chrome-extension://abcdefgh", "chrome-extension://abcdefgh"),
        ("capacitor://localhost", "capacitor://localhost"),
        ("app://.", "app://."),
        ("*", "*"),
    ],
)
def test_a_cors_origin_is_kept_as_browsers_send_it(monkeypatch, given, as_browsers_send_it):
    clear_environment(monkeypatch)
    config = parse_config(["--handler", "tests.handlers:echo", "--cors-allow-origin", given])
    assert config.app.cors_allow_origins == (as_browsers_send_it,)


def test_an_empty_chat_template_file_is_refused(monkeypatch, capsys, tmp_path):
    """It replaced the model's own template, and every chat was then told to start the
    server with --chat-template, which it had been."""
    clear_environment(monkeypatch)
    empty = tmp_path / "chat.jinja"
    empty.write_text("\n", "utf-8")
    with pytest.raises(SystemExit) as exit:
        parse_config(["--chat-template", str(empty)])
    assert exit.value.code == 2
    assert f"--chat-template: {empty} is empty" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--max-queue", "--max-client-batch-size", "--max-batch-size"])
def test_a_whole_number_too_large_to_hold_is_refused(monkeypatch, capsys, option):
    """10**20 was taken, then /info answered 500 (JSON holds no such number), or the first
    batch failed in an overflow."""
    clear_environment(monkeypatch)
    with pytest.raises(SystemExit) as exit:
        parse_config(["--handler", "tests.handlers:echo", option, str(10**20)])
    assert exit.value.code == 2
    most = 65536 if option == "--max-batch-size" else 2**53  # (a warm-up batch of it runs)
    assert f"{option} must be at most {most}" in capsys.readouterr().err.replace(",", "")
    assert parse_config(["--handler", "tests.handlers:echo", option, str(most)])


@pytest.mark.parametrize("variable", ["HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT"])
@pytest.mark.parametrize("value", ["-5", "0", "9999999999"])
def test_a_hub_timeout_the_client_cannot_hold_is_refused_naming_its_variable(
    monkeypatch, capsys, variable, value
):
    """-5 stopped a start the cache could serve, with only "ValueError" to say why; 1e10
    with "OverflowError"."""
    clear_environment(monkeypatch)
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit:
        parse_config([])
    assert exit.value.code == 2
    said = capsys.readouterr().err
    assert f"{variable}={value!r}: not a whole number of seconds from 1 to 2147483647" in said


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("http://127.0.0.1:99999", "not an address (Port out of range"),
        ("http://[::1", "not an address ("),
        ("http://127.0.0.1:8080\n", "blanks around the address"),
        ("hub.example", "not an http:// or https:// address"),
    ],
)
def test_a_hub_endpoint_that_is_no_address_is_refused_at_start(monkeypatch, capsys, value, says):
    """Read as huggingface_hub is imported: a port out of range ended the start in its
    traceback, though the model was cached."""
    clear_environment(monkeypatch)
    monkeypatch.setenv("HF_ENDPOINT", value)
    with pytest.raises(SystemExit) as exit:
        parse_config([])
    assert exit.value.code == 2
    assert f"HF_ENDPOINT={value!r}: {says}" in capsys.readouterr().err
    monkeypatch.setenv("HF_ENDPOINT", "https://hf-mirror.example:8443/")
    assert parse_config([])


def test_a_hub_endpoint_refused_at_start_is_quoted_without_its_password(monkeypatch, capsys):
    clear_environment(monkeypatch)
    monkeypatch.setenv("HF_ENDPOINT", "https://user:SECRETpw@mirror.example:99999")
    with pytest.raises(SystemExit):
        parse_config([])
    said = capsys.readouterr().err
    assert "HF_ENDPOINT='https://<credentials>@mirror.example:99999'" in said
    assert "SECRETpw" not in said


def test_a_hub_endpoint_set_empty_is_read_as_unset(monkeypatch):
    """As compose files leave a variable: huggingface_hub took "" as the address."""
    clear_environment(monkeypatch)
    monkeypatch.setenv("HF_ENDPOINT", " ")
    assert parse_config([])
    assert "HF_ENDPOINT" not in os.environ


@pytest.mark.parametrize("variable", ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"])
@pytest.mark.parametrize("token", ["hf_bad\u200b", "hf_göod", "hf_a\tb"])
def test_a_hub_token_of_characters_no_token_has_is_refused_at_start(
    monkeypatch, capsys, variable, token
):
    """It said "could not resolve org/tiny: UnicodeEncodeError", even with the model
    cached (a refused token serves the cache)."""
    clear_environment(monkeypatch)
    monkeypatch.setenv(variable, token)
    with pytest.raises(SystemExit):
        parse_config([])
    assert f"{variable} holds a character no token has" in capsys.readouterr().err
    # huggingface_hub's own cleaning: a newline from a secret's file, blanks around it
    monkeypatch.setenv(variable, " hf_AbC123\r\n")
    assert parse_config([])


def test_model_options_set_beside_a_handler_are_named_as_not_applying(monkeypatch):
    """Left to a warning, not refused: deployments set RAWSERVE_ENGINE for every server."""
    clear_environment(monkeypatch)
    handler = ["--handler", "tests.handlers:echo"]
    assert ignored_by_the_handler(parse_config(handler)) == []
    given = [*handler, "--engine", "onnx", "--generation", "static", "--max-sequences", "3"]
    assert ignored_by_the_handler(parse_config(given)) == [
        "--engine",
        "--generation",
        "--max-sequences",
    ]
    given = [*handler, "--dtype", "float16", "--join-wait-steps", "2"]
    assert ignored_by_the_handler(parse_config(given)) == ["--dtype", "--join-wait-steps"]


def test_a_refusal_blames_the_option_at_fault_not_another_whose_variable_is_set(
    monkeypatch, capsys
):
    """The four connection timeouts shared one message, which blamed the first of them
    whose variable was set, a valid one: `RAWSERVE_HEAD_TIMEOUT=10 --body-timeout 0`
    said "(set by RAWSERVE_HEAD_TIMEOUT='10')"."""
    clear_environment(monkeypatch)
    monkeypatch.setenv("RAWSERVE_HEAD_TIMEOUT", "10")
    monkeypatch.setenv("RAWSERVE_WRITE_TIMEOUT", "0")
    with pytest.raises(SystemExit):
        parse_config(["--body-timeout", "0"])
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == "rawserve: error: --body-timeout must be positive", line
    with pytest.raises(SystemExit):
        parse_config([])
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.endswith("--write-timeout must be positive (set by RAWSERVE_WRITE_TIMEOUT='0')")


@pytest.mark.parametrize(
    ("env", "value", "argv", "says"),
    [
        ("RAWSERVE_MODEL", "/models/x", ["--handler", "tests.handlers:echo"], "give no --model"),
        ("RAWSERVE_MAX_BATCH_SIZE", "0", [], "--max-batch-size must be positive"),
        ("RAWSERVE_ENGINE", "Torhc", [], "--engine must be torch, onnx or auto"),
    ],
)
def test_a_refusal_of_a_value_its_variable_set_names_the_variable(
    monkeypatch, capsys, env, value, argv, says
):
    """A user who typed no --model was told to give no --model (a deployment's
    RAWSERVE_MODEL); the same value typed as the flag is told as before."""
    clear_environment(monkeypatch)
    monkeypatch.setenv(env, value)
    with pytest.raises(SystemExit):
        parse_config(argv)
    [line] = capsys.readouterr().err.strip().splitlines()
    assert says in line and line.endswith(f" (set by {env}={value!r})"), line
    flag = "--" + env.removeprefix("RAWSERVE_").lower().replace("_", "-")
    with pytest.raises(SystemExit):
        parse_config([*argv, flag, value])
    [line] = capsys.readouterr().err.strip().splitlines()
    assert says in line and "set by" not in line, line


def test_a_shortened_flag_is_refused_not_read_as_the_option_it_starts(monkeypatch, capsys):
    clear_environment(monkeypatch)
    with pytest.raises(SystemExit) as exit:
        parse_config(["--handler", "tests.handlers:echo", "--max-queu", "5"])
    assert exit.value.code == 2
    assert "unrecognized arguments: --max-queu" in capsys.readouterr().err


def test_a_choice_is_read_whatever_its_case_and_blanks(monkeypatch):
    clear_environment(monkeypatch)
    monkeypatch.setenv("RAWSERVE_LOG_FORMAT", "JSON ")
    monkeypatch.setenv("RAWSERVE_LOG_LEVEL", "debug ")  # (was refused: exit 2)
    argv = ["--engine", "Torch", "--dtype", "FLOAT32", "--generation", "Static"]
    config = parse_config(argv)
    assert (config.model.engine, config.model.dtype) == (Engine.TORCH, "float32")
    assert (config.model.generation, config.log_format) == ("static", "json")
    assert config.log_level == "debug"
    assert parse_config(["--log-level", " Warning"]).log_level == "warning"


def test_a_stream_keepalive_of_0_sends_no_keep_alive_comment(monkeypatch):
    """0 is "never", as --help says: a stream waiting 0 seconds between comments would
    be sent one at every turn of the event loop."""
    clear_environment(monkeypatch)
    assert parse_config(["--stream-keepalive", "0"]).app.stream_keepalive is None
    assert parse_config(["--stream-keepalive", "2.5"]).app.stream_keepalive == 2.5
    assert defaults(monkeypatch).app.stream_keepalive == 15.0


@pytest.mark.parametrize(
    ("flag", "taken", "refused", "says"),
    [
        ("--max-batch-size", "1", "0", "--max-batch-size must be positive"),
        ("--max-queue", "1", "0", "--max-queue must be positive"),
        ("--max-client-batch-size", "1", "0", "--max-client-batch-size must be positive"),
        ("--max-body-bytes", "1", "0", "--max-body-bytes must be positive"),
        ("--port", "65535", "65536", "--port must be from 0 (any free port) to 65535"),
        ("--keepalive-timeout", "0.001", "0", "--keepalive-timeout must be positive"),
        ("--head-timeout", "0.001", "0", "--head-timeout must be positive"),
        ("--body-timeout", "0.001", "-1", "--body-timeout must be positive"),
        ("--write-timeout", "0.001", "0", "--write-timeout must be positive"),
        ("--stream-keepalive", "0", "-0.5", "--stream-keepalive must be 0 (no keep-alive"),
        ("--stream-keepalive", "0.1", "0.09", "--stream-keepalive must be 0 (no keep-alive"),
        ("--threads", "8", "9", "--threads must be from 1 to 8"),
        ("--http-processes", "1", "0", "--http-processes must be from 1 to 8"),
        ("--grace", "0", "-1", "--grace must not be negative"),
        ("--max-connections", "0", "-1", "--max-connections must not be negative"),
        # no longer than the longest deadline a request may ask for (300 s by default)
        ("--max-batch-delay-ms", "300000", "300001", "--max-batch-delay-ms (300001) must not"),
    ],
)
def test_each_bound_takes_its_last_value_and_refuses_the_next(
    monkeypatch, capsys, flag, taken, refused, says
):
    """Each option's range, at its edge: a bound that slipped by one (a port that wraps
    to any free one, a timeout of 0 that times every connection out at once) passed
    the tests that tried values far outside it alone."""
    clear_environment(monkeypatch)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    parse_config(["--handler", "tests.handlers:echo", flag, taken])
    with pytest.raises(SystemExit) as exit:
        parse_config(["--handler", "tests.handlers:echo", flag, refused])
    assert exit.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"rawserve: error: {says}")
