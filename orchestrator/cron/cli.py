"""`cellgate cron add | list | pause | resume | delete`: the operator's cron commands.

They work on the state database directly (the gateway need not run; a
running one picks a new job up within seconds). C1/C2 are decided with the
agents as the config file declares them: a job for an isolated agent, or a
command job for an app's agent, is refused with the rule and the reason.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from orchestrator.cron.jobs import CronJobs, JobRequest, facts_from_configs, job_state, job_view
from orchestrator.cron.schedule import utc_text

__all__ = ["register"]


def _jobs(config: str) -> tuple[CronJobs, Any]:
    from orchestrator.config import load_config
    from orchestrator.store import Store

    cfg = load_config(Path(config))
    store = Store.open(cfg.gateway.state_dir)
    return CronJobs(store, facts_from_configs(cfg.agents), clock=time.time), store


def _cmd_add(args: argparse.Namespace) -> int:
    kind = "command" if args.command is not None else "prompt"
    req = JobRequest(
        type=kind,
        payload=args.command if args.command is not None else args.prompt,
        cron=args.cron,
        every=args.every,
        at=args.at,
        timezone=args.tz,
        channel=args.channel,
        chat_id=args.chat,
        name=args.name or "",
        timeout_seconds=args.timeout,
    )
    jobs, store = _jobs(args.config)
    with store:
        job = jobs.create(args.agent, req, via="cli")
    print(f"created cron job {job.id} for {job.agent}: next run {utc_text(job.next_run_at)}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    jobs, store = _jobs(args.config)
    with store:
        found = jobs.list(args.agent)
    if args.json:
        print(json.dumps([job_view(j) for j in found], indent=2))
        return 0
    print(f"{'ID':22} {'AGENT':16} {'TYPE':8} {'STATE':8} {'SCHEDULE':28} {'NEXT RUN':24} TARGET")
    for j in found:
        sched = f"{j.schedule_kind.value} {j.schedule}" + (
            f" {j.timezone}" if j.schedule_kind.value == "cron" else ""
        )
        target = f"{j.channel}:{j.chat_id}" if j.channel else "host"
        print(f"{j.id:22} {j.agent[:16]:16} {j.type.value:8} {job_state(j)[:8]:8} "
              f"{sched[:28]:28} {utc_text(j.next_run_at):24} {target}")  # fmt: skip
    return 0


def _change(args: argparse.Namespace, what: str) -> int:
    jobs, store = _jobs(args.config)
    with store:
        if what == "delete":
            jobs.delete(args.id)
            print(f"deleted cron job {args.id}")
            return 0
        job = jobs.pause(args.id) if what == "pause" else jobs.resume(args.id)
    print(f"cron job {job.id} is {job_state(job)}; next run {utc_text(job.next_run_at)}")
    return 0


def register(sub: Any) -> None:
    """Add `cron` and its subcommands to the `cellgate` parser."""
    c = sub.add_parser("cron", help="scheduled jobs (kept in the state database)")
    csub = c.add_subparsers(dest="cron_command", required=True)

    a = csub.add_parser("add", help="schedule a prompt (a turn in a conversation) or a command")
    a.add_argument("--config", required=True)
    a.add_argument("--agent", required=True)
    a.add_argument("--name", default="")
    when = a.add_mutually_exclusive_group(required=True)
    when.add_argument("--cron", help="a cron expression, e.g. '0 9 * * 1-5'")
    when.add_argument("--every", help="seconds between runs (at least 60)")
    when.add_argument("--at", help="once: ISO 8601 time or '+15m'")
    a.add_argument("--tz", default=None, help="time zone of --cron / a bare --at (UTC)")
    what = a.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="the text the agent receives in --channel/--chat")
    what.add_argument("--command", help="a shell line run on the host (host agents only, C2)")
    a.add_argument("--channel", help="the prompt's conversation: channel (e.g. telegram, api)")
    a.add_argument("--chat", help="the prompt's conversation: chat id")
    a.add_argument("--timeout", type=float, default=60.0, help="a command's timeout (s)")
    a.set_defaults(func=_cmd_add)

    ls = csub.add_parser("list", help="list jobs")
    ls.add_argument("--config", required=True)
    ls.add_argument("--agent", default=None)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_cmd_list)

    for name, text in (("pause", "pause a job"), ("resume", "resume a paused job"),
                       ("delete", "delete a job")):  # fmt: skip
        p = csub.add_parser(name, help=text)
        p.add_argument("id")
        p.add_argument("--config", required=True)
        p.set_defaults(func=lambda args, what=name: _change(args, what))
