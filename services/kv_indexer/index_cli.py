"""``kvgate index verify``: is the global KV index equal to what the workers really hold?

Asks the running indexer (``kv.index.verify``) to fetch each worker's own full dump and compare
it with the index at exactly the dump's batch seq, then prints the difference per worker:
``missing`` blocks the worker holds that the index lacks, ``extra`` blocks the index holds that
the worker does not. A worker behind a bridge (``kvgate bridge``) is checked against what the
bridge can prove of its engine: a bridge that lost engine history (it started after the engine
had published, or a gap outlived the engine's replay buffer) cannot vouch that the engine holds
nothing more, so an index equal to its view is ``unknown``, with the lost engine batches and
the blocks seen stored on lost parents, never ``equal``. Exit status: 0 all equal, 1 some
worker divergent, 2 some worker could not be checked (unreachable / inconclusive / unknown)
and none divergent, 3 no indexer answered.

Examples::

    kvgate index verify                       # every registered worker
    kvgate index verify --worker w0 --worker w3
    kvgate index verify --repair              # resync the divergent workers
    kvgate index verify --json                # the reply as one JSON object
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import TYPE_CHECKING

from services.common import settings as S
from services.common.redact import redact_url

if TYPE_CHECKING:
    from services.common.bus import NatsAuth
    from services.common.schemas import IndexVerifyReply

OPTIONS = (S.NATS_URL, *S.NATS_AUTH, S.SUBJECT_PREFIX, S.STATE_DIR)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    S.add_options(parser, OPTIONS)
    sub = parser.add_subparsers(dest="action", metavar="{verify}", required=True)
    verify = sub.add_parser(
        "verify",
        help="compare the index with each worker's own dump; print the difference per worker",
        description=__doc__.split("Examples::", 1)[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    S.add_options_after_subcommand(verify, OPTIONS)
    verify.add_argument(
        "--worker", action="append", default=[], help="check only this worker (repeatable)"
    )
    verify.add_argument("--repair", action="store_true", help="resync every worker found divergent")
    verify.add_argument(
        "--sample", type=int, default=5, help="keys of each difference to print (default 5)"
    )
    verify.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to wait for the indexer's answer"
    )
    verify.add_argument("--json", action="store_true", help="print the reply as JSON")


def format_reply(reply: IndexVerifyReply) -> str:
    lines = [
        f"{'worker':<24} {'status':<13} {'kv_seq':>8} {'worker':>9} {'index':>9} "
        f"{'missing':>8} {'extra':>8}"
    ]
    for r in reply.workers:
        lines.append(
            f"{r.worker_id:<24} {r.status:<13} {r.kv_seq:>8} {r.worker_blocks:>9} "
            f"{r.index_blocks:>9} {r.missing:>8} {r.extra:>8}"
            + ("  (repair started)" if r.repaired else "")
        )
        if r.missing_sample:
            lines.append("    missing e.g. " + " ".join(f"{k:#018x}" for k in r.missing_sample))
        if r.extra_sample:
            lines.append("    extra   e.g. " + " ".join(f"{k:#018x}" for k in r.extra_sample))
        if r.detail:
            lines.append(f"    {r.detail}")
    if not reply.workers:
        lines.append("(no workers registered)")
    lines.append(f"divergent blocks: {reply.divergent_blocks}")
    unknown = [r.worker_id for r in reply.workers if r.status == "unknown"]
    if unknown:
        lines.append(
            f"unknown: {len(unknown)} bridged worker(s) lost engine history, so the index "
            "cannot be verified against the engine (restarting the engine, or clearing its "
            "cache, makes them verifiable again): " + ", ".join(unknown)
        )
    return "\n".join(lines)


def exit_code(reply: IndexVerifyReply) -> int:
    statuses = {r.status for r in reply.workers}
    if "divergent" in statuses:
        return 1
    if statuses - {"equal"}:
        return 2
    return 0


def no_answer_hint(error: str, nats_url: str, prefix: str, timeout_s: float) -> str:
    """The next thing to check, by why the indexer did not answer."""
    if error.startswith("no responder"):
        return (
            f"  hint: NATS at {redact_url(nats_url)} has no indexer subscribed under subject "
            f"prefix {prefix!r}: is 'kvgate indexer' (or 'kvgate up') running against this "
            "NATS, with the same --subject-prefix / KVGATE_SUBJECT_PREFIX? 'kvgate status' "
            "shows a local stack."
        )
    if error.startswith("no reply"):
        return (
            f"  hint: an indexer is subscribed but did not answer within {timeout_s:g}s "
            "(many workers, or slow dumps): retry with a larger --timeout, or --worker to "
            "check fewer workers."
        )
    return "  hint: the indexer answered with an error; its log has the details."


async def verify(
    args: argparse.Namespace, nats_url: str, prefix: str, auth: NatsAuth | None = None
) -> int:
    from services.common.bus import Bus, RemoteError
    from services.common.schemas import IndexVerifyReply, IndexVerifyRequest, to_builtins
    from services.common.subjects import Subjects, check_token

    for w in args.worker:
        check_token(w, "worker id")
    bus = Bus(nats_url, "index-verify", Subjects(prefix), auth=auth, role="operator")
    await bus.connect(max_wait_s=10)
    try:
        req = IndexVerifyRequest(
            workers=args.worker, repair=args.repair, max_sample=max(0, args.sample)
        )
        try:
            reply = await bus.request(
                bus.subjects.kv_index_verify, req, IndexVerifyReply, timeout=args.timeout
            )
        except (TimeoutError, RemoteError) as exc:
            print(f"kvgate index verify: no answer from the indexer: {exc}", file=sys.stderr)
            print(no_answer_hint(str(exc), nats_url, prefix, args.timeout), file=sys.stderr)
            return 3
    finally:
        await bus.close()
    if args.json:
        print(json.dumps(to_builtins(reply), sort_keys=True))
    else:
        print(format_reply(reply))
    return exit_code(reply)


def main(args: argparse.Namespace) -> int:
    from services.common import stackfile
    from services.common.embedded import nats_url_reachable
    from services.common.logging import configure_logging

    st = S.resolve(args, OPTIONS)
    configure_logging("index", "warning", "console")  # logs to stderr; stdout is the result
    if args.action == "verify":
        from services.common.bus import NatsAuth

        nats_url, prefix, source = st.nats_url, st.subject_prefix, "the default"
        auth = NatsAuth.from_settings(st)
        if not stackfile.given(args, "nats_url", S.NATS_URL.env_var):
            stack = stackfile.running_stack(st.state_dir)
            if stack is not None:
                if auth.method == "none":  # the stack's operator credential, found by itself
                    auth = stackfile.operator_auth(
                        st.state_dir
                    )  # the embedded stack of `kvgate up`, found by itself
                nats_url, source = stack.nats_url, str(stackfile.stack_path(st.state_dir))
                if not stackfile.given(args, "subject_prefix", S.SUBJECT_PREFIX.env_var):
                    prefix = stack.subject_prefix
        else:
            source = "--nats-url / KVGATE_NATS_URL"
        if not nats_url_reachable(nats_url):
            print(
                f"kvgate index verify: no NATS server at {nats_url} (from {source}); start the "
                "stack ('kvgate up') or give --nats-url / KVGATE_NATS_URL",
                file=sys.stderr,
            )
            return 3
        try:
            return asyncio.run(verify(args, nats_url, prefix, auth))
        except (ConnectionError, ValueError) as exc:
            print(f"kvgate index verify: {exc}", file=sys.stderr)
            return 3
    return 2
