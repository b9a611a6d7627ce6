from __future__ import annotations

import argparse

import pytest

from services.common import settings as S

OPT = S.option("example_port", 1234, "an example")
FLAG = S.option("example_flag", False, "a boolean")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    S.add_options(p, [OPT, FLAG])
    return p.parse_args(argv)


def test_default_env_flag_precedence() -> None:
    assert S.resolve(_parse([]), [OPT], environ={}).example_port == 1234
    assert S.resolve(_parse([]), [OPT], environ={"KVGATE_EXAMPLE_PORT": "99"}).example_port == 99
    st = S.resolve(_parse(["--example-port", "7"]), [OPT], environ={"KVGATE_EXAMPLE_PORT": "99"})
    assert st.example_port == 7


def test_bool_from_env() -> None:
    assert (
        S.resolve(_parse([]), [FLAG], environ={"KVGATE_EXAMPLE_FLAG": "yes"}).example_flag is True
    )
    assert S.resolve(_parse([]), [FLAG], environ={"KVGATE_EXAMPLE_FLAG": "0"}).example_flag is False


def test_bad_env_value_is_a_clear_error() -> None:
    with pytest.raises(SystemExit) as err:
        S.resolve(_parse([]), [OPT], environ={"KVGATE_EXAMPLE_PORT": "eighty"})
    assert "KVGATE_EXAMPLE_PORT" in str(err.value)


def test_registry_knows_common_env_vars() -> None:
    assert "KVGATE_NATS_URL" in S.ALL_OPTIONS
    assert "KVGATE_DATABASE_URL" in S.ALL_OPTIONS


def test_database_password_comes_from_a_secret_file(tmp_path) -> None:
    secret = tmp_path / "pg_password"
    secret.write_text("s3cret/with@odd:chars\n")
    st = S.resolve(
        None,
        [S.DATABASE_URL, S.DATABASE_PASSWORD_FILE],
        environ={
            "KVGATE_DATABASE_URL": "postgresql+asyncpg://kvgate@postgres:5432/kvgate",
            "KVGATE_DATABASE_PASSWORD_FILE": str(secret),
        },
    )
    assert st.database_url == (
        "postgresql+asyncpg://kvgate:s3cret%2Fwith%40odd%3Achars@postgres:5432/kvgate"
    )
    from sqlalchemy.engine import make_url

    assert make_url(st.database_url).password == "s3cret/with@odd:chars"
