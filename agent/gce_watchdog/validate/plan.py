"""What a validation run creates, pure: the VMs (one per scenario), their ``instances.insert``
bodies, the estimated cost at list prices and the IAM permissions the run needs. No clock, no
network: ``--plan`` prints this and ``run.py`` sends exactly these bodies.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from gce_watchdog.validate.scenarios import Scenario

LABEL = "gcewd-validate"  # every resource of a run carries LABEL=<run id>
SCENARIO_LABEL = "gcewd-scenario"
RUN_RE = re.compile(r"[a-z][a-z0-9]{2,15}\Z")  # a label value and a name part
DEFAULT_MACHINE = "e2-small"
DEFAULT_IMAGE = "projects/debian-cloud/global/images/family/debian-12"
DISK_GB = 10
# A VM of a run deletes itself this long after it started, whatever happens to `validate`
# (Scheduling.maxRunDuration with instanceTerminationAction DELETE): the last line of defence
# against a leftover that `validate --cleanup` was never run for.
MAX_RUN_S = 3 * 3600
# Agent settings of the validation VMs (the gce-watchdog-config drop-in): faults through
# metadata on (only these VMs), and obeyed although their service account (cloud-platform, below)
# can write their metadata: nothing but the test workload runs on them (trust_metadata,
# docs/actions.md "Who may disarm through metadata"); the default ladder.
AGENT_INTERVAL_S = 30.0
AGENT_THRESHOLD = 10


def dropin(agent_interval_s: float) -> str:
    """The gce-watchdog-config drop-in of a validation VM."""
    return (
        f'[agent]\ninterval = "{agent_interval_s:g}s"\n'
        "[watch]\nfaults_from_metadata = true\ntrust_metadata = true\n"
    )


LINGER = "75s"  # the end-of-life linger (two reads of a 30 s poller plus the read itself)

# List prices, us-central1, USD per hour (on-demand; Spot in the second column). Not fetched at
# run time. Checked on 2026-12-02 against what could be read of Google's pages (stored copies; this
# machine has no internet access):
# - https://cloud.google.com/compute/vm-instance-pricing (no date on the copy): the page's billing
#   text (per-second billing after a 1-minute minimum) was readable, its per-machine-type price
#   tables were not (the copies hold none of their numbers), so no row below is confirmed by it.
# - https://cloud.google.com/spot-vms/pricing?hl=en (no date on the copy): "Spot prices are
#   variable and can change up to once every day, but provide discounts of up to 91% off of the
#   corresponding default price"; an older copy said "up to once every 30 days" (60-91% off).
# - https://cloud.google.com/compute/disks-image-pricing (no date on the copy): "based off US
#   pricing, a 200 GB standard Persistent Disk volume would cost $8.00 for the whole month"
#   ($0.04/GB-month, pd-standard) and 200 GB SSD $34.00 ($0.17); the pd-balanced row was not in
#   the copies.
# The numbers themselves are therefore from a third-party export of Google's Cloud Billing Catalog
# API: pricing.yml of github.com/Cyclenerd/google-cloud-pricing-cost-calculator, "generated: Thu
# Jul 30 06:13:17 2026" (commit fd66b26), `compute.instance.<type>.cost.us-central1.hour` and
# `.hour_spot`, and `compute.storage.balanced.cost.us-central1.month` ($0.10), rounded to 6
# places. Its on-demand rows agree with the 2024 values this table had (within 0.02%); its Spot
# rows do not (e2-small Spot was 0.005025 here, 0.010053 there): Spot prices move.
# Other regions cost up to ~40% more. An estimate, never a bill: `--plan` says so, with this date.
PRICES_DATE = "2026-07-30"
PRICES_SOURCE = (
    "us-central1, from a Cloud Billing Catalog export (github.com/Cyclenerd/"
    "google-cloud-pricing-cost-calculator pricing.yml) of "
    "https://cloud.google.com/compute/vm-instance-pricing"
)
MACHINE_PRICES: dict[str, tuple[float, float]] = {
    "e2-micro": (0.008376, 0.005027),
    "e2-small": (0.016753, 0.010053),
    "e2-medium": (0.033506, 0.020106),
    "e2-standard-2": (0.067011, 0.040212),
    "n2-standard-2": (0.097118, 0.046060),
    "g2-standard-4": (0.706832, 0.397336),  # one NVIDIA L4
}
GPU_MACHINES = frozenset({"g2-standard-4"})
DISK_PRICE_GB_MONTH = 0.10  # pd-balanced, us-central1 (the export above; Google's page unread)
HOURS_PER_MONTH = 730.0

# What a run calls, and the permission each needs (roles/compute.instanceAdmin.v1 holds all the
# compute ones; roles/iam.serviceAccountUser the actAs, for the VM's service account).
PERMISSIONS: tuple[tuple[str, str], ...] = (
    ("compute.instances.create", "instances.insert"),
    ("compute.instances.setMetadata", "insert with metadata; the fault request (setMetadata)"),
    ("compute.instances.setLabels", "insert with the run label"),
    ("compute.instances.setServiceAccount", "insert with the default service account"),
    ("compute.disks.create", "the boot disk"),
    ("compute.images.useReadOnly", "the boot image"),
    ("compute.subnetworks.use", "the default network"),
    ("compute.subnetworks.useExternalIp", "an external IP (the agent's package download)"),
    ("compute.instances.get", "status reads"),
    ("compute.instances.getSerialPortOutput", "the console lines"),
    ("compute.instances.list", "validate --cleanup (aggregatedList by label)"),
    ("compute.instances.delete", "deleting the VMs"),
    ("compute.zoneOperations.get", "waiting for operations"),
    ("compute.zoneOperations.list", "the poller's end-of-life evidence"),
    ("compute.instances.simulateMaintenanceEvent", "the maintenance scenario"),
    ("iam.serviceAccounts.actAs", "the VMs run as the default Compute service account"),
)
ROLES = ("roles/compute.instanceAdmin.v1", "roles/iam.serviceAccountUser")
# Minutes each scenario's VM is expected to exist (boot and install ~3, the scenario, the end).
MINUTES = {
    "wedge": 15, "done": 8, "setup-failed": 7, "setup-failed-infra": 7, "maintenance": 9,
    "flap": 13,
}  # fmt: skip


@dataclass(frozen=True)
class AgentSource:
    """Where the VMs get the agent: a .deb or a wheelhouse (URL + sha256), or a baked image."""

    deb_url: str = ""
    deb_sha256: str = ""
    wheel_url: str = ""
    wheel_sha256: str = ""
    image: str = ""  # a baked image: the agent is already in it

    def problems(self, required: bool = True) -> list[str]:
        """What is wrong with the source; ``required`` False: none at all is fine (a plan)."""
        errs = []
        given = [bool(self.deb_url), bool(self.wheel_url), bool(self.image)]
        if sum(given) > 1 or (required and sum(given) != 1):
            errs.append("give exactly one agent source: --deb-url, --wheel-url or --image")
        for url, sha, what in (
            (self.deb_url, self.deb_sha256, "deb"),
            (self.wheel_url, self.wheel_sha256, "wheel"),
        ):
            if url and not url.startswith("https://"):
                errs.append(f"--{what}-url must be an https:// URL")
            if url and not re.fullmatch(r"[0-9a-f]{64}", sha):
                errs.append(f"--{what}-sha256 must be the 64 hex digits of the file's sha256")
        return errs

    def describe(self) -> str:
        """The source in words, for the plan."""
        if self.deb_url:
            return f"the .deb {self.deb_url}"
        if self.wheel_url:
            return f"the wheelhouse {self.wheel_url}"
        if self.image:
            return f"the baked image {self.image}"
        return "none given yet (the run needs --deb-url, --wheel-url or --image)"

    def metadata(self) -> dict[str, str]:
        out = {}
        if self.deb_url:
            out["gce-watchdog-deb-url"] = self.deb_url
            out["gce-watchdog-deb-sha256"] = self.deb_sha256
        if self.wheel_url:
            out["gce-watchdog-wheel-url"] = self.wheel_url
            out["gce-watchdog-wheel-sha256"] = self.wheel_sha256
        return out


@dataclass(frozen=True)
class VMPlan:
    scenario: str
    name: str
    body: dict[str, object]  # the instances.insert body


@dataclass(frozen=True)
class Plan:
    run: str
    project: str
    zone: str
    machine_type: str
    spot: bool
    vms: tuple[VMPlan, ...]
    cost_usd: float
    minutes: int
    source: str = ""  # AgentSource.describe()

    def render(self) -> list[str]:
        kind = "Spot" if self.spot else "on-demand"
        lines = [
            f"validation run {self.run} in project {self.project}, zone {self.zone}:",
            f"  {len(self.vms)} VM(s), {self.machine_type} ({kind}), {DISK_GB} GB pd-balanced "
            f"boot disk each, label {LABEL}={self.run}:",
        ]
        lines += [f"    {v.name}  ({v.scenario})" for v in self.vms]
        if self.source:
            lines.append(f"  agent source: {self.source}")
        lines += [
            f"  estimated cost: ${self.cost_usd:.4f} for about {self.minutes} VM-minutes, at "
            f"list prices of {PRICES_DATE} ({PRICES_SOURCE}); an estimate, not a bill: "
            "your bill may differ" + ("; Spot prices can change once a day" if self.spot else ""),
            f"  every VM deletes itself after {MAX_RUN_S // 3600} h at the latest "
            "(scheduling.maxRunDuration), and `validate --cleanup` deletes by label",
            "  the VMs accept faults through metadata (watch.faults_from_metadata and "
            "watch.trust_metadata, on these VMs only: docs/fault-injection.md)",
            f"  IAM roles: {', '.join(ROLES)}; permissions:",
        ]
        lines += [f"    {p:40} {why}" for p, why in PERMISSIONS]
        return lines

    def to_json(self) -> dict[str, object]:
        """``validate --plan --json`` (docs/json.md, schemas/validate-plan.schema.json)."""
        return {
            "v": PLAN_JSON_VERSION,
            "run": self.run,
            "project": self.project,
            "zone": self.zone,
            "machine_type": self.machine_type,
            "spot": self.spot,
            "instances": [{"name": v.name, "scenario": v.scenario} for v in self.vms],
            "estimated_cost_usd": round(self.cost_usd, 4),
            "vm_minutes": self.minutes,
            "prices": {"date": PRICES_DATE, "source": PRICES_SOURCE},
            "roles": list(ROLES),
            "permissions": [p for p, _ in PERMISSIONS],
        }


# `validate --plan --json`'s version: 1 is its first versioned form (the fields are unchanged).
PLAN_JSON_VERSION = 1


def vm_name(run: str, scenario: str) -> str:
    return f"gcewd-{run}-{scenario}"


def estimate(machine_type: str, spot: bool, minutes: int) -> float:
    """USD at list prices for ``minutes`` VM-minutes of the machine and its boot disk."""
    hourly = MACHINE_PRICES[machine_type][1 if spot else 0]
    disk = DISK_PRICE_GB_MONTH * DISK_GB / HOURS_PER_MONTH
    return (hourly + disk) * minutes / 60.0


def make_plan(
    run: str,
    project: str,
    zone: str,
    scenarios: Sequence[Scenario],
    source: AgentSource,
    startup_script: str,
    machine_type: str = DEFAULT_MACHINE,
    spot: bool = False,
    allow_gpu: bool = False,
    agent_interval_s: float = AGENT_INTERVAL_S,
    require_source: bool = True,
) -> Plan:
    """The plan; ValueError lists every problem with the inputs. ``require_source`` False (a
    plan that is only looked at): no agent source is fine, its VMs' bodies then have none."""
    errs = source.problems(require_source)
    if not RUN_RE.match(run):
        errs.append(f"run id {run!r}: 3-16 lowercase letters and digits, starting with a letter")
    if machine_type not in MACHINE_PRICES:
        errs.append(
            f"--machine-type {machine_type!r}: one of {', '.join(MACHINE_PRICES)} (priced here)"
        )
    elif machine_type in GPU_MACHINES and not allow_gpu:
        errs.append(f"--machine-type {machine_type} has a GPU: add --allow-gpu to pay for it")
    if not scenarios:
        errs.append("no scenario selected")
    if not startup_script.startswith("#!"):
        errs.append("the start-up script does not start with #!")
    if errs:
        raise ValueError("; ".join(errs))
    vms = tuple(
        VMPlan(s.name, vm_name(run, s.name), insert_body(run, zone, s, source, startup_script,
                                                          machine_type, spot, agent_interval_s))
        for s in scenarios
    )  # fmt: skip
    minutes = sum(MINUTES.get(s.name, 15) for s in scenarios)
    return Plan(run, project, zone, machine_type, spot, vms, estimate(machine_type, spot, minutes),
                minutes, source.describe())  # fmt: skip


def insert_body(
    run: str,
    zone: str,
    s: Scenario,
    source: AgentSource,
    startup_script: str,
    machine_type: str,
    spot: bool,
    agent_interval_s: float = AGENT_INTERVAL_S,
) -> dict[str, object]:
    """The ``instances.insert`` body of one scenario's VM (fields of the ``Instance`` schema)."""
    md = {
        "startup-script": startup_script,
        "gce-watchdog-config": dropin(agent_interval_s),
        "gce-watchdog-linger": LINGER,
        "gce-watchdog-done-action": "poweroff",
        **source.metadata(),
    }
    if s.workload is not None:
        md["gce-watchdog-workload"] = json.dumps(list(s.workload))
    if s.bootstrap:
        md["gce-watchdog-bootstrap"] = json.dumps([list(b) for b in s.bootstrap])
    scheduling: dict[str, object] = {
        "provisioningModel": "SPOT" if spot else "STANDARD",
        "instanceTerminationAction": "DELETE",
        "maxRunDuration": {"seconds": str(MAX_RUN_S)},
        "automaticRestart": False,
        "onHostMaintenance": "TERMINATE",
    }
    return {
        "name": vm_name(run, s.name),
        "machineType": f"zones/{zone}/machineTypes/{machine_type}",
        "labels": {LABEL: run, SCENARIO_LABEL: s.name},
        "scheduling": scheduling,
        "disks": [
            {
                "boot": True,
                "autoDelete": True,
                "initializeParams": {
                    "sourceImage": source.image or DEFAULT_IMAGE,
                    "diskSizeGb": str(DISK_GB),
                    "diskType": f"zones/{zone}/diskTypes/pd-balanced",
                    "labels": {LABEL: run},
                },
            }
        ],
        "networkInterfaces": [
            {
                "network": "global/networks/default",
                "accessConfigs": [{"type": "ONE_TO_ONE_NAT", "name": "External NAT"}],
            }
        ],
        "serviceAccounts": [
            {"email": "default", "scopes": ["https://www.googleapis.com/auth/cloud-platform"]}
        ],
        "metadata": {"items": [{"key": k, "value": v} for k, v in md.items()]},
    }
