"""Cron jobs (C1, C2): durable in the store, run by the gateway's scheduler.

Modules: `schedule` (cron expression with a time zone, interval, once-at;
pure), `jobs` (create, list, pause, resume, delete, with the C1/C2
refusals; used by the CLI, the admin API and the `cron_*` bridge tools),
`scheduler` (runs due jobs: a prompt through `Intake`, a command on the host),
`command` (the host command runner: timeout, output cap).
"""

from orchestrator.cron.jobs import AgentFacts, AgentLookup, CronJobs, JobRequest, facts_from_configs
from orchestrator.cron.schedule import Schedule, due_after, first_due, parse_schedule
from orchestrator.cron.scheduler import CronScheduler, RunRecord, cron_message_id

__all__ = [
    "AgentFacts",
    "AgentLookup",
    "CronJobs",
    "CronScheduler",
    "JobRequest",
    "RunRecord",
    "Schedule",
    "cron_message_id",
    "due_after",
    "facts_from_configs",
    "first_due",
    "parse_schedule",
]
