"""``kvgate bridge``: KV event bridges for real engines (lands with its issue)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rest", nargs="*", help="arguments (not implemented yet)")


def main(args: argparse.Namespace) -> int:
    print("kvgate bridge: not implemented yet", file=sys.stderr)
    return 2
