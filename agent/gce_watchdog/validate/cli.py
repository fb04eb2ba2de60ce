"""``gce-watchdog validate``: prove the recovery chain on the user's own project (docs/validate.md).
argparse code only: the plan is made in plan.py, the run in run.py."""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from pathlib import Path

from gce_watchdog.lib.cli import EX_NOPERM, EX_OK, EX_UNAVAILABLE, EX_USAGE, CommandError

STARTUP_IN_TREE = Path(__file__).resolve().parents[3] / "startup" / "startup-script.sh"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from gce_watchdog.validate.plan import DEFAULT_MACHINE, MACHINE_PRICES
    from gce_watchdog.validate.scenarios import SCENARIOS

    p = sub.add_parser(
        "validate",
        help="create small VMs, break them on purpose, check the watchdog recovers (costs money)",
        description="Create one small VM per scenario on your project (the real start-up script, "
        "the agent from a pinned source), run the scenarios with the poller in-process, print a "
        "verdict per scenario, delete everything. --plan shows what and what it costs; the run "
        "needs --yes.",
    )
    p.add_argument("--project", required=True, help="the GCP project the VMs are created in")
    p.add_argument("--zone", default=None, help="the zone, e.g. us-central1-a (not for --cleanup)")
    p.add_argument(
        "--scenario",
        action="append",
        choices=sorted(SCENARIOS),
        help="run only this scenario (repeatable; default: all of " + ", ".join(SCENARIOS) + ")",
    )
    p.add_argument("--plan", action="store_true", help="print what would be created and exit")
    p.add_argument("--yes", action="store_true", help="create the VMs (the run costs money)")
    p.add_argument(
        "--cleanup",
        nargs="?",
        const="",
        default=None,
        metavar="RUN",
        help="delete the VMs labelled with RUN (without RUN: of every validation run) and exit",
    )
    p.add_argument("--deb-url", default="", help="the agent's .deb (https)")
    p.add_argument("--deb-sha256", default="", help="its sha256")
    p.add_argument("--wheel-url", default="", help="a wheelhouse tarball (https)")
    p.add_argument("--wheel-sha256", default="", help="its sha256")
    p.add_argument("--image", default="", help="a baked image with the agent (bake-image.sh)")
    p.add_argument(
        "--machine-type",
        default=DEFAULT_MACHINE,
        choices=sorted(MACHINE_PRICES),
        help=f"machine type (default {DEFAULT_MACHINE})",
    )
    p.add_argument("--allow-gpu", action="store_true", help="allow a machine type with a GPU")
    p.add_argument("--spot", action="store_true", help="Spot VMs (cheaper; may be preempted)")
    p.add_argument("--startup-script", default=None, help="the start-up script to use")
    p.add_argument("--out", default=None, help="output folder (default ./validate-RUN)")
    p.add_argument("--run-id", default=None, help="the run's id (default: random)")
    p.add_argument("--json", action="store_true", help="--plan as JSON")
    p.add_argument("--api-base", default=None, help=argparse.SUPPRESS)  # the fake, in tests
    p.add_argument("--access-token-file", default=None, help="a bearer token file (else ADC)")
    # Pacing, for tests against the fake with a simulated guest.
    p.add_argument("--poll-every", type=float, default=10.0, help=argparse.SUPPRESS)
    p.add_argument("--agent-interval", type=float, default=30.0, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=1800.0, help=argparse.SUPPRESS)
    p.add_argument("--op-poll", type=float, default=2.0, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_validate)


def _say(msg: str) -> None:
    print(f"gce-watchdog validate: {msg}", file=sys.stderr, flush=True)


def _failed(status: int, msg: str) -> CommandError:
    """``validate``'s failure: its exit status, its message as :func:`_say` writes it."""
    return CommandError(status, f"gce-watchdog validate: {msg}")


def _api(args: argparse.Namespace) -> object:
    from gce_watchdog.lib.compute import DEFAULT_API_BASE, ComputeClient, ComputeRetry
    from gce_watchdog.validate.gce import ValidateApi

    creds = None
    if args.access_token_file:
        from google.oauth2.credentials import Credentials

        token = Path(args.access_token_file).read_text().strip()
        if not token:
            raise ValueError(f"{args.access_token_file} is empty")
        creds = Credentials(token)  # type: ignore[no-untyped-call]
    client = ComputeClient.create(
        creds, args.api_base or DEFAULT_API_BASE, retry=ComputeRetry(attempts=4)
    )
    return ValidateApi(client, op_poll_s=args.op_poll)


def cmd_validate(args: argparse.Namespace) -> int:
    from gce_watchdog.lib.compute import AuthError, ComputeAPIError
    from gce_watchdog.validate import run as runmod
    from gce_watchdog.validate.gce import ValidateApi
    from gce_watchdog.validate.plan import RUN_RE, AgentSource, make_plan
    from gce_watchdog.validate.scenarios import DEFAULT_SCENARIOS, select

    if args.cleanup is not None:
        if args.cleanup and not RUN_RE.match(args.cleanup):
            raise _failed(EX_USAGE, f"--cleanup {args.cleanup!r} is not a run id")
        try:
            api = _api(args)
            assert isinstance(api, ValidateApi)
            return runmod.cleanup_label(api, args.project, args.cleanup or None, _say)
        except (OSError, ValueError) as e:
            raise _failed(EX_NOPERM, str(e)) from None
        except AuthError as e:
            raise _failed(EX_NOPERM, str(e)) from None
        except ComputeAPIError as e:
            raise _failed(EX_UNAVAILABLE, str(e)) from None
    if not args.zone:
        raise _failed(EX_USAGE, "--zone is required (e.g. --zone us-central1-a)")
    script_path = Path(args.startup_script) if args.startup_script else STARTUP_IN_TREE
    try:
        script = script_path.read_text()
    except OSError as e:
        why = e.strerror or e
        raise _failed(
            EX_USAGE,
            f"cannot read the start-up script {script_path}: {why} "
            "(give --startup-script PATH: startup/startup-script.sh of the release)",
        ) from None
    run_id = args.run_id or ("v" + secrets.token_hex(4))
    try:
        plan = make_plan(
            run_id, args.project, args.zone,
            select(args.scenario or list(DEFAULT_SCENARIOS)),
            AgentSource(args.deb_url, args.deb_sha256, args.wheel_url, args.wheel_sha256,
                        args.image),
            script, args.machine_type, args.spot, args.allow_gpu, args.agent_interval,
            require_source=args.yes and not args.plan,  # a plan to look at needs none
        )  # fmt: skip
    except ValueError as e:
        raise _failed(EX_USAGE, str(e)) from None
    if args.plan or not args.yes:
        if args.json:
            print(json.dumps(plan.to_json(), sort_keys=True))
        else:
            for line in plan.render():
                print(line)
        if not args.plan:
            raise _failed(
                EX_USAGE, "nothing created: add --yes to create these VMs (or --plan to only look)"
            )
        return EX_OK
    try:
        api = _api(args)
    except (OSError, ValueError, AuthError) as e:
        raise _failed(EX_NOPERM, str(e)) from None
    assert isinstance(api, ValidateApi)
    timing = runmod.Timing(
        poll_every_s=args.poll_every,
        agent_interval_s=args.agent_interval,
        scenario_deadline_s=args.deadline,
        boot_deadline_s=min(args.deadline, runmod.BOOT_DEADLINE_S),
    )
    out = Path(args.out or f"validate-{run_id}")
    _say(f"run {run_id}: output in {out}/ (`validate --cleanup {run_id}` removes leftovers)")
    return runmod.Run(plan, api, out, timing).execute()
