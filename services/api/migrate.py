"""``kvgate migrate``: alembic upgrade / downgrade against KVGATE_DATABASE_URL.

Runs alembic in-process with a Config built here, so it works from any directory and in the
container image (the scripts ship inside the ``migrations`` package).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from services.common import settings as S
from services.common.embedded import ensure_database
from services.common.logging import configure_logging, get_logger

OPTIONS = (S.DATABASE_URL, S.DATABASE_PASSWORD_FILE, S.LOG_LEVEL, S.LOG_FORMAT)


def alembic_config(database_url: str):
    from alembic.config import Config

    import migrations

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    from alembic import command

    asyncio.run(ensure_database(database_url))
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str) -> None:
    from alembic import command

    command.downgrade(alembic_config(database_url), revision)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    S.add_options(parser, OPTIONS)
    parser.add_argument("direction", nargs="?", default="upgrade", choices=["upgrade", "downgrade"])
    parser.add_argument(
        "revision",
        nargs="?",
        default=None,
        help="target revision (default: head for upgrade, -1 for downgrade)",
    )


def main(args: argparse.Namespace) -> int:
    st = S.resolve(args, OPTIONS)
    configure_logging("migrate", st.log_level, st.log_format)
    log = get_logger("migrate")
    if args.direction == "upgrade":
        upgrade(st.database_url, args.revision or "head")
    else:
        downgrade(st.database_url, args.revision or "-1")
    log.info("migrations applied", direction=args.direction, revision=args.revision or "default")
    return 0
