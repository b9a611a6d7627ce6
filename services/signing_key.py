"""``kvgate signing-key``: a new signing key for the api, printed as the two ``.env`` lines
compose reads (docs/deploy.md).

``API_SIGNING_SEED`` is the secret the api signs with (compose gives it to the api as a secret
file, ``KVGATE_SIGNING_SEED``); ``API_SIGNING_PUBLIC_KEY`` is what routers trust
(``KVGATE_TRUSTED_SIGNERS``). Both lines come from one seed, so they always match.
"""

from __future__ import annotations

import argparse

from services.common.signing import Signer, new_seed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "API_SIGNING_SEED is secret (the api's); API_SIGNING_PUBLIC_KEY is what the routers "
        "trust. e.g.: kvgate signing-key >> .env"
    )


def env_lines(seed: bytes) -> list[str]:
    return [
        f"API_SIGNING_SEED={seed.decode()}",
        f"API_SIGNING_PUBLIC_KEY={Signer(seed).public_key}",
    ]


def main(args: argparse.Namespace) -> int:
    print("\n".join(env_lines(new_seed())))
    return 0
