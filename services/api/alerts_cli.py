"""``kvgate alerts tail``: follow managed alerts (``alerts.<severity>.<kind>``) on a terminal.

Reads the ALERTS JetStream stream with an ephemeral ordered consumer, so it can replay what
fired before it started (``--replay all`` or ``--since 1h``) and then follows new alerts.

Examples::

    kvgate alerts tail                          # new alerts from now on
    kvgate alerts tail --replay all             # everything kept (7 days), then follow
    kvgate alerts tail --since 30m --severity critical --kind circuit_open
    kvgate alerts tail --worker w3 --json       # one JSON object per line
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import UTC, datetime
from typing import Any

from services.common import settings as S
from services.common import stackfile
from services.common.embedded import nats_url_reachable
from services.common.redact import redact_url
from services.common.subjects import check_token

OPTIONS = (S.NATS_URL, *S.NATS_AUTH, S.SUBJECT_PREFIX, S.STATE_DIR)
SEVERITIES = ("info", "warning", "critical")
_COLORS = {"critical": "\033[31;1m", "warning": "\033[33m", "info": "\033[36m"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    S.add_options(parser, OPTIONS)
    sub = parser.add_subparsers(dest="action", metavar="{tail}", required=True)
    tail = sub.add_parser("tail", help="print alerts as they fire and resolve")
    S.add_options_after_subcommand(tail, OPTIONS)
    when = tail.add_mutually_exclusive_group()
    when.add_argument(
        "--replay",
        choices=["none", "all"],
        default="none",
        help="'all': replay every alert kept in the stream first",
    )
    when.add_argument(
        "--since",
        type=S.parse_duration,
        default=None,
        help="replay alerts newer than this (e.g. 30m, 2h)",
    )
    tail.add_argument(
        "--severity", choices=SEVERITIES, action="append", help="only these severities (repeatable)"
    )
    tail.add_argument("--kind", help="only this alert kind")
    tail.add_argument("--worker", help="only alerts about this worker")
    tail.add_argument("--state", choices=["firing", "resolved"], help="only this state")
    tail.add_argument("--json", action="store_true", help="one JSON object per line")
    tail.add_argument(
        "--count",
        type=int,
        default=0,
        help="exit after printing this many alerts (0: run until Ctrl-C)",
    )
    tail.add_argument("--color", choices=["auto", "always", "never"], default="auto")


def format_alert(a: Any, color: bool = False) -> str:
    """One readable line (plus an indented remedy line when there is one)."""
    ts = datetime.fromtimestamp(a.ts or 0, UTC).strftime("%Y-%m-%d %H:%M:%S")
    sev = a.severity.upper()
    if color:
        sev = f"{_COLORS.get(a.severity, '')}{sev:<8}\033[0m"
    else:
        sev = f"{sev:<8}"
    state = "RESOLVED" if a.state == "resolved" else "FIRING"
    worker = f" worker={a.worker_id}" if a.worker_id else ""
    line = f"{ts}Z {sev} {state:<8} {a.kind}{worker}  {a.summary}".rstrip()
    line += f"  [source={a.source} id={(a.alert_id or '-')[:8]}]"
    if a.remedy and a.state != "resolved":
        line += f"\n    remedy: {a.remedy}"
    return line


def matches(a: Any, args: argparse.Namespace) -> bool:
    if args.worker and a.worker_id != args.worker:
        return False
    if args.state and a.state != args.state:
        return False
    return not (args.severity and a.severity not in args.severity)


def following_line(nats_url: str, source: str, replay: str) -> str:
    """What an operator sees on stderr once the subscription is live: where, and from what."""
    return (
        f"kvgate alerts tail: connected to {redact_url(nats_url)} (from {source}); "
        f"following alerts{replay}; Ctrl-C to stop"
    )


async def tail(
    args: argparse.Namespace,
    nats_url: str,
    prefix: str,
    auth: Any = None,
    source: str = "--nats-url / KVGATE_NATS_URL",
) -> int:
    import nats.js.errors
    from nats.js.api import ConsumerConfig, DeliverPolicy

    from services.common.bus import Bus
    from services.common.schemas import Alert, SchemaError, decode, to_builtins
    from services.common.streams import require_alert_streams
    from services.common.subjects import Subjects

    subjects = Subjects(prefix)
    sev = args.severity[0] if args.severity and len(args.severity) == 1 else "*"
    kind = check_token(args.kind, "alert kind") if args.kind else "*"
    subject = subjects._s(f"alerts.{sev}.{kind}")
    if args.replay == "all":
        config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    elif args.since is not None:
        start = (datetime.now(UTC) - args.since).isoformat()
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start)
    else:
        config = ConsumerConfig(deliver_policy=DeliverPolicy.NEW)
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    bus = Bus(nats_url, "alerts-tail", subjects, auth=auth, role="operator")
    await bus.connect(max_wait_s=10)
    done = asyncio.Event()
    printed = 0

    async def on(msg) -> None:
        nonlocal printed
        try:
            a = decode(Alert, msg.data)
        except SchemaError as exc:
            print(f"(skipped a malformed alert: {exc})", file=sys.stderr)
            return
        if not matches(a, args) or done.is_set():
            return
        if args.json:
            print(json.dumps(to_builtins(a), sort_keys=True), flush=True)
        else:
            print(format_alert(a, color), flush=True)
        printed += 1
        if args.count and printed >= args.count:
            done.set()

    try:
        try:  # read-only first: an operator's credential may read the stream, not configure it
            await bus.js.stream_info(subjects.alerts_stream)
        except nats.js.errors.NotFoundError:
            await require_alert_streams(bus)
        sub = await bus.js.subscribe(
            subject, cb=on, stream=subjects.alerts_stream, ordered_consumer=True, config=config
        )
        if args.replay == "all":
            replay = " (replaying every alert kept first)"
        elif args.since is not None:
            replay = f" (replaying those newer than {args.since} first)"
        else:
            replay = " from now on"
        loop = asyncio.get_running_loop()
        import signal

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, done.set)
        # only now: a Ctrl-C after this line ends the tail cleanly
        print(following_line(nats_url, source, replay), file=sys.stderr, flush=True)
        await done.wait()
        await sub.unsubscribe()
    finally:
        await bus.close()
    return 0


def main(args: argparse.Namespace) -> int:
    from services.common.logging import configure_logging

    st = S.resolve(args, OPTIONS)
    configure_logging("alerts", "warning", "console")  # logs to stderr; stdout is the alerts
    if args.action == "tail":
        nats_url, prefix = st.nats_url, st.subject_prefix
        # said out loud: without a stack file the default URL may be some other NATS
        source = f"the default; no running 'kvgate up' stack in {st.state_dir}"
        stack_found = False
        if not stackfile.given(args, "nats_url", S.NATS_URL.env_var):
            stack = stackfile.running_stack(st.state_dir)
            stack_found = stack is not None
            if stack is not None:  # the embedded stack of `kvgate up`
                nats_url, source = stack.nats_url, f"{stackfile.stack_path(st.state_dir)}"
                if not stackfile.given(args, "subject_prefix", S.SUBJECT_PREFIX.env_var):
                    prefix = stack.subject_prefix
        else:
            source = "--nats-url / KVGATE_NATS_URL"
        if not nats_url_reachable(nats_url):
            print(
                f"kvgate alerts tail: no NATS server at {nats_url} (from {source}). "
                f"Start the stack with 'kvgate up' (its state file in {st.state_dir} is found "
                "by itself; --state-dir for another), or give --nats-url / KVGATE_NATS_URL.",
                file=sys.stderr,
            )
            return 1
        try:
            from services.common.bus import NatsAuth

            auth = NatsAuth.from_settings(st)
            if stack_found and auth.method == "none":
                auth = stackfile.operator_auth(st.state_dir)
            return asyncio.run(tail(args, nats_url, prefix, auth, source))
        except ConnectionError as exc:
            print(f"kvgate alerts tail: {exc}", file=sys.stderr)
            return 1
    return 2
