"""``kvgate bus``: the admin steps of the bus's JetStream streams.

- ``provision``: create each of kvgate's streams (and the HA indexers' lease bucket) or bring it
  to its provisioned config: retention, subjects, size budget, replicas. Run it once per deploy
  and after changing the budget or the cluster size, with the ``provisioner`` NATS credential
  (services.common.permissions); no long-running service holds that credential, so no service
  can re-point, republish or delete a stream.
- ``check``: compare every stream's live config with the provisioned one (what services do at
  start) and print the differences; exit status 1 when a stream is missing or differs. Needs
  only the ``operator`` credential (read-only).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from services.common import settings as S


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        choices=("provision", "check"),
        help="provision: create / update kvgate's streams (provisioner credential);"
        " check: compare each stream with its provisioned config",
    )
    S.add_options(parser, S.COMMON)


async def run(action: str, st: S.Settings) -> int:
    import nats.js.errors

    from services.common.bus import Bus, NatsAuth
    from services.common.streams import all_specs, config_drift, provision
    from services.common.subjects import Subjects

    role = "provisioner" if action == "provision" else "operator"
    bus = Bus(
        st.nats_url,
        f"bus-{action}",
        Subjects(st.subject_prefix),
        auth=NatsAuth.from_settings(st),
        role=role,
    )
    await bus.connect(max_wait_s=10)
    try:
        if action == "provision":
            for name, what in await provision(bus):
                print(f"{name}: {what}")
            return 0
        bad = 0
        for spec in all_specs(bus.subjects):
            try:
                cfg = (await bus.js.stream_info(spec.name)).config
            except nats.js.errors.NotFoundError:
                print(f"{spec.name}: MISSING (run `kvgate bus provision`)")
                bad += 1
                continue
            drift = config_drift(spec, cfg)
            print(f"{spec.name}: " + ("as provisioned" if not drift else "DIFFERS"))
            for d in drift:
                print(f"  {d}")
            bad += bool(drift)
        return 1 if bad else 0
    finally:
        await bus.close()


def main(args: argparse.Namespace) -> int:
    from services.common.logging import configure_logging

    st = S.resolve(args, S.COMMON)
    configure_logging("bus", "warning", "console")
    try:
        return asyncio.run(run(args.action, st))
    except ConnectionError as exc:
        print(f"kvgate bus {args.action}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # a refused JetStream call: say which, without a traceback
        print(f"kvgate bus {args.action}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
