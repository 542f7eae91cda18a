"""The pure parts of :mod:`ckptkeeper.config_checks`: where a tier is, when two overlap, which
``CKPTKEEPER_*`` variables are settings. The CLI side is ``tests/test_config_safety.py``."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptkeeper.config import Settings
from ckptkeeper.config_checks import Place, env_problems, overlap, place_of


def same(path: str) -> str:
    return path  # a realpath for paths with no symlinks, no ".." and no trailing slash


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("/x/hot", "/x/hot", "same"),
        ("/x/hot/warm", "/x/hot", "a-inside-b"),
        ("/x/hot", "/x/hot/warm", "b-inside-a"),
        ("/x/hot", "/x/hot2", None),
        ("s3://b/ckpt", "s3://b/ckpt", "same"),
        ("s3://b/ckpt/", "s3://b//ckpt", "same"),
        ("s3a://b/ckpt", "s3://b/ckpt", "same"),
        ("s3://b/a", "s3://b/ab", None),
        ("s3://b/a/x", "s3://b/a", "a-inside-b"),
        ("s3://b", "s3://b/a", "b-inside-a"),
        ("s3://b/a", "s3://c/a", None),
        ("s3://b/a", "/b/a", None),
        ("gs://b/a", "s3://b/a", None),
    ],
)
def test_overlap(a: str, b: str, expected: str | None) -> None:
    pa, pb = place_of(a, {}, realpath=same), place_of(b, {}, realpath=same)
    assert pa is not None and pb is not None
    assert overlap(pa, pb) == expected


def test_endpoints_tell_stores_apart() -> None:
    here = place_of("s3://b/a", {"endpoint_url": "http://127.0.0.1:9000/"})
    there = place_of("s3://b/a", {"client_kwargs": {"endpoint_url": "http://10.0.0.1:9000"}})
    also_here = place_of("s3://b/a", {"client_kwargs": {"endpoint_url": "HTTP://127.0.0.1:9000"}})
    assert here is not None and there is not None and also_here is not None
    assert overlap(here, there) is None
    assert overlap(here, also_here) == "same"


@pytest.mark.parametrize("url", ["warm", "./warm", "~/warm", "file://warm", "file://./x"])
def test_relative_paths_have_no_place(url: str) -> None:
    assert place_of(url, {}) is None


components = st.lists(st.sampled_from(["a", "b", "ab", "a.b", "ckpt"]), max_size=4).map(tuple)


@given(components, components)
def test_nested_exactly_when_one_is_a_prefix_of_the_other(a: tuple[str, ...], b: tuple[str, ...]) -> None:
    how = overlap(Place("s3 ", a), Place("s3 ", b))
    assert (how == "same") == (a == b)
    assert (how == "a-inside-b") == (len(a) > len(b) and a[: len(b)] == b)
    assert (how == "b-inside-a") == (len(b) > len(a) and b[: len(a)] == a)
    assert overlap(Place("s3 ", b), Place("s3 ", a)) == {
        "a-inside-b": "b-inside-a",
        "b-inside-a": "a-inside-b",
    }.get(how or "", how)


@given(components.filter(bool), st.sampled_from(["x", "-old", "2"]))
def test_a_longer_last_component_is_never_nested(a: tuple[str, ...], suffix: str) -> None:
    """``s3://b/a`` and ``s3://b/ax``: a prefix of characters, not of components."""
    b = (*a[:-1], a[-1] + suffix)
    assert overlap(Place("s3 ", a), Place("s3 ", b)) is None


@given(components, components)
def test_url_spelling_does_not_matter(a: tuple[str, ...], b: tuple[str, ...]) -> None:
    """Trailing and doubled slashes never change where an object-store tier is."""
    plain = place_of("s3://bucket/" + "/".join(a), {})
    messy = place_of("s3://bucket//" + "//".join(a) + "/", {})
    other = place_of("s3://bucket/" + "/".join(b), {})
    assert plain is not None and messy is not None and other is not None
    assert overlap(plain, other) == overlap(messy, other)


def test_environment_names_come_from_the_model() -> None:
    env = {
        "CKPTKEEPER_MAX_DELETE": "1",
        "CKPTKEEPER_DAEMON__SETTLE_SECONDS": "1",
        "ckptkeeper_reaper__failed_after": "1h",
        "CKPTKEEPER_CONFIG": "/etc/x.toml",
        "CKPTKEEPER_FLEET": '{"lease_ttl": "5m"}',
        "OTHER": "x",
    }
    assert env_problems(env, Settings) == []
    bad = env_problems(
        {"CKPTKEEPER_MAX_DELET": "0", "CKPTKEEPER_FLEET": "{", "CKPTKEEPER_NODE__X": "y"}, Settings
    )
    assert [p.split(":", 1)[0] for p in bad] == [
        "CKPTKEEPER_FLEET",
        "CKPTKEEPER_MAX_DELET",
        "CKPTKEEPER_NODE__X",
    ]
    for name in Settings.model_fields:  # a new setting is allowed without touching the checks
        assert env_problems({f"CKPTKEEPER_{name.upper()}": "[]"}, Settings) == []


def test_the_slurm_hooks_and_a_jobs_variables_are_not_settings_but_allowed() -> None:
    env = {
        "CKPTKEEPER_DEFAULTS": "/etc/default/ckptkeeper",
        "CKPTKEEPER_HOOK_LOG": "/var/log/x",
        "CKPTKEEPER_PRESTAGE_TIMEOUT": "120",
        "CKPTKEEPER_RESUME": "exp",
    }
    assert env_problems(env, Settings) == []
