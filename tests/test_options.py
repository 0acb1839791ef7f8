"""Options: validation, derived settings, and the README kept in step with them."""

import re
from pathlib import Path

import pytest

from turnguard_core import identity, options

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_defaults_are_valid_and_derive_seconds():
    s = options.settings_from(options.DEFAULTS)
    assert s.hold_timeout_s == 30 and s.request_budget_s == 120
    assert s.guard.replay and s.guard.replay_window_s == 300 and s.guard.retention_s == 86400
    assert (s.circuit.threshold, s.circuit.cooldown_s, s.circuit.cooldown_max_s) == (2, 60, 600)
    assert s.recovery_mode == "fail_closed" and s.response_created_timeout_s == 60


@pytest.mark.parametrize(
    "change, message",
    [
        ({"turnguard_credential_headers": ["x-ok", "bad name"]},
         "turnguard_credential_headers: 'bad name' is not a header name"),
        ({"turnguard_hold_timeout_ms": -1}, "turnguard_hold_timeout_ms must be >= 0"),
        ({"turnguard_request_budget_ms": 0}, "turnguard_request_budget_ms must be >= 1"),
        ({"turnguard_failure_threshold": 0}, "turnguard_failure_threshold must be >= 1"),
        ({"turnguard_retention_ms": 10}, "turnguard_retention_ms must be >= turnguard_replay"),
        ({"turnguard_cooldown_max_ms": 5}, "turnguard_cooldown_max_ms must be >= turnguard_cool"),
    ],
)
def test_invalid_values_name_the_option(change, message):
    with pytest.raises(ValueError, match=message):
        options.settings_from({**options.DEFAULTS, **change})


def test_readme_documents_every_option_with_its_default():
    section = README.split("\n## Options\n", 1)[1].split("\n## ", 1)[0]  # not the metrics table
    rows = dict(re.findall(r"^\| `(turnguard_\w+)` \| (.*?) \|", section, re.M))
    assert set(rows) == {spec.name for spec in options.OPTIONS}
    for spec in options.OPTIONS:
        if spec.name in ("turnguard_ledger", "turnguard_filter", "turnguard_events",
                         "turnguard_credential_headers", "turnguard_metrics"):
            continue  # shown as words, not as the raw default
        assert rows[spec.name].strip("`").lower() == str(spec.default).lower(), spec.name


@pytest.mark.parametrize(
    "name, raw, message",
    [
        ("turnguard_hold_timeout_ms", ["abc"], "turnguard_hold_timeout_ms=abc is not an integer"),
        ("turnguard_hold_timeout_ms", [], "turnguard_hold_timeout_ms=(no value) is not an integer"),
        ("turnguard_replay", ["maybe"], "turnguard_replay=maybe is not true or false"),
        ("turnguard_replay", ["yes"], "turnguard_replay=yes is not true or false"),
        ("turnguard_ledger", ["a", "b"], "turnguard_ledger was set 2 times (a, b); set it once"),
        ("turnguard_hold_timeout_ms", "30000", "turnguard_hold_timeout_ms='30000' is not an integer"),
        ("turnguard_replay", 1, "turnguard_replay=1 is not bool"),
        ("turnguard_holdtimeout_ms", ["5"],
         "unknown option turnguard_holdtimeout_ms=5 (did you mean turnguard_hold_timeout_ms?)"),
        ("turnguard_zzz", ["1"], "unknown option turnguard_zzz=1"),
        # a PostgreSQL password is never shown, whatever the problem
        ("turnguard_ledger", ["postgres://u:pw@h/l", "x"],
         "turnguard_ledger was set 2 times (postgres://u:***@h/l, x); set it once"),
        ("turnguard_ledgr", ["postgresql://u:pw@h/l"],
         "unknown option turnguard_ledgr=postgresql://u:***@h/l (did you mean turnguard_ledger?)"),
        ("turnguard_ledgr", "postgresql://u:pw@h/l",
         "unknown option turnguard_ledgr='postgresql://u:***@h/l' (did you mean turnguard_ledger?)"),
    ],
)
def test_deferred_problems_name_the_option_and_the_value(name, raw, message):
    assert options.deferred_problems({name: raw}) == {name: message}


@pytest.mark.parametrize(
    "deferred",
    [
        {"turnguard_hold_timeout_ms": ["5"], "turnguard_replay": ["false"], "turnguard_events": ["x"]},
        {"turnguard_replay": [], "turnguard_replay_max_bytes": 5},
        {"turnguard_credential_headers": ["x-a", "x-b"]},
        {"turnguard_credential_headers": ["x-a"]},
        {"stream_large_bodies": ["nonsense"], "other_addon_option": ["x"]},  # not ours
    ],
)
def test_good_deferred_values_and_other_addons_options_are_no_problem(deferred):
    assert options.deferred_problems(deferred) == {}

def test_credential_headers_are_lower_cased_and_deduplicated():
    s = options.settings_from({**options.DEFAULTS,
                               "turnguard_credential_headers": ["X-Tenant", "x-tenant", "K"]})
    assert s.credential_headers == ("x-tenant", "k")


def test_the_default_filter_guards_the_known_routes_at_the_start_of_the_path_only():
    from mitmproxy import flowfilter
    from mitmproxy.test import tflow

    guarded = flowfilter.parse(options.DEFAULT_FILTER)

    def post(url: str) -> bool:
        f = tflow.tflow()
        f.request.method = "POST"
        f.request.url = url
        f.request.headers["host"] = f.request.host_header or f.request.host
        return guarded(f)

    for route in identity.KNOWN_ROUTES:
        assert post(f"https://api.example{route}")
        assert post(f"http://127.0.0.1:8080{route}/?stream=true")
        assert not post(f"https://api.example/sk-SECRET{route}")
        assert not post(f"https://api.example{route}x")
        assert not post(f"https://api.example{route}/resp_1")


def _readme_row(name: str) -> str:
    section = README.split("\n## Options\n", 1)[1].split("\n## ", 1)[0]
    (row,) = [line for line in section.splitlines() if line.startswith(f"| `{name}` |")]
    return row


@pytest.mark.parametrize("spec", [s for s in options.OPTIONS if s.type is int], ids=lambda s: s.name)
def test_the_help_and_the_readme_say_what_an_int_option_refuses(spec):
    """A value ``configure`` refuses is one its ``--help`` text (mitmdump --options) and its
    README row warn of: a least value above 1 (a user who sets a short lease for a test meets
    it), and a bound set by another option (named, so the user knows which to change)."""
    row, help_text = _readme_row(spec.name), spec.help
    if spec.minimum is not None and spec.minimum > 1:
        assert str(spec.minimum) in help_text and str(spec.minimum) in row, spec.minimum
    for value in (spec.minimum or 0, 10**12):
        try:
            options.settings_from({**options.DEFAULTS, spec.name: value})
        except ValueError as e:
            others = set(re.findall(r"turnguard_\w+", str(e))) - {spec.name}
            for other in others:
                assert other in re.findall(r"turnguard_\w+", help_text), f"--help of {spec.name} does not name {other}"
                assert other in re.findall(r"turnguard_\w+", row), f"README row of {spec.name} does not name {other}"
