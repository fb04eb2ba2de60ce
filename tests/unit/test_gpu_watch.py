"""The GPU watch (gpu/watch.py) with scripted kernel records and probe answers: which lines a
GPU's troubles give, a flood that is one line, forgeries that are none, and a soak of healthy
GPUs and application errors that never gives a ``gpu_fault``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
from gce_watchdog.gpu.kmsg import KmsgRecord, ReadBatch
from gce_watchdog.gpu.probe import ProbeResult
from gce_watchdog.gpu.watch import GpuWatch, GpuWatchConfig
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.pure

BUS = ["00000000:00:04.0", "00000000:00:05.0"]
XID_BUS = ["0000:00:04", "0000:00:05"]


class Records:
    def __init__(self) -> None:
        self.queue: list[KmsgRecord] = []
        self.seq = 0

    def add(self, message: str, facility: int = 0, times: int = 1) -> None:
        for _ in range(times):
            self.seq += 1
            self.queue.append(KmsgRecord(facility, 4, self.seq, self.seq, message))

    def drain(self) -> ReadBatch:
        out, self.queue = tuple(self.queue), []
        return ReadBatch(out, 0, 0)

    def close(self) -> None:
        return None


class Answers:
    def __init__(self) -> None:
        self.next: list[ProbeResult] = []

    def poll(self, now: float) -> ProbeResult:
        return self.next.pop(0) if self.next else ProbeResult()

    def close(self) -> None:
        return None


def gpus(**per_gpu: Any) -> ProbeResult:
    out = []
    for i, bus in enumerate(BUS):
        g: dict[str, Any] = {
            "index": i,
            "bus": bus,
            "lost": False,
            "remap": [0, 0, 0, 0],
            "ecc_uncorrected": 0,
            "recovery_action": 0,
        }
        g.update(per_gpu.get(f"g{i}", {}))
        out.append(g)
    return ProbeResult(sample={"count": len(out), "gpus": out})


def xid(n: int, gpu: int = 0, text: str = "x") -> str:
    return f"NVRM: Xid (PCI:{XID_BUS[gpu]}): {n}, pid=7, name=python, {text}"


class Said(list[tuple[str, dict[str, str], str]]):
    def __call__(self, event: str, fields: dict[str, str], text: str) -> None:
        self.append((event, fields, text))

    def events(self) -> list[str]:
        return [e for e, _, _ in self]

    def of(self, event: str) -> list[dict[str, str]]:
        return [f for e, f, _ in self if e == event]


def watch(cfg: GpuWatchConfig | None = None) -> tuple[GpuWatch, Records, Answers, Said]:
    rec, ans, said = Records(), Answers(), Said()
    return GpuWatch(cfg or GpuWatchConfig(), said, rec, ans), rec, ans, said


def steps(w: GpuWatch, times: Iterable[float]) -> None:
    for t in times:
        w.step(t)


def test_xid_79_with_the_gpu_lost_is_a_fault_on_that_gpu() -> None:
    w, rec, ans, said = watch()
    ans.next = [gpus()]
    w.step(0.0)
    rec.add(xid(79, gpu=1, text="GPU has fallen off the bus."))
    ans.next = [gpus(g1={"lost": True})]
    w.step(10.0)
    faults = said.of("gpu_fault")
    assert {"xid": "79", "pci": "0000:00:05", "gpu": "1", "sig": "handle_lost"} in faults
    assert all(f["gpu"] == "1" for f in faults)


def test_a_lost_gpu_without_its_pci_id_is_still_matched_to_its_xid() -> None:
    w, rec, ans, said = watch()
    ans.next = [gpus()]
    w.step(0.0)
    lost = gpus(g1={"lost": True})
    assert lost.sample is not None
    del lost.sample["gpus"][1]["bus"]  # NVML cannot read a lost GPU's PCI info
    ans.next = [lost]
    rec.add(xid(79, gpu=1))
    w.step(1.0)
    assert {"xid": "79", "pci": "0000:00:05", "gpu": "1", "sig": "handle_lost"} in said.of(
        "gpu_fault"
    )


def test_a_hardware_xid_alone_is_an_event_until_a_second_signal() -> None:
    w, rec, ans, said = watch()
    ans.next = [gpus()]
    w.step(0.0)
    rec.add(xid(48))
    w.step(10.0)
    assert said.events() == ["gpu_event"]
    assert said.of("gpu_event")[0]["cls"] == "hardware"
    ans.next = [gpus(g0={"remap": [0, 1, 1, 0]})]  # a pending remap on the same GPU
    w.step(20.0)
    assert said.of("gpu_fault") == [
        {"xid": "48", "pci": "0000:00:04", "gpu": "0", "sig": "remap_pending"}
    ]
    steps(w, [30.0, 40.0])
    assert len(said.of("gpu_fault")) == 1  # said once


def test_a_second_signal_on_another_gpu_confirms_nothing() -> None:
    w, rec, ans, said = watch()
    ans.next = [gpus(g1={"remap": [0, 1, 1, 0]})]
    w.step(0.0)
    rec.add(xid(48, gpu=0))
    steps(w, [10.0, 20.0])
    assert said.of("gpu_fault") == []


def test_application_xids_never_fault_even_with_a_signal() -> None:
    w, rec, ans, said = watch()
    ans.next = [gpus(g0={"remap": [0, 1, 1, 0]})]
    w.step(0.0)
    for n in (13, 31, 43, 45, 68):
        rec.add(xid(n))
    steps(w, [1.0, 2.0])
    assert said.events() == ["gpu_event"] * 5
    assert {f["cls"] for f in said.of("gpu_event")} == {"application"}


def test_800000_repeated_records_give_one_line() -> None:
    w, rec, _ans, said = watch()
    for i in range(80):
        rec.add(xid(95), times=10_000)
        w.step(float(i))
    assert said.events() == ["gpu_event"]


def test_a_user_space_xid_is_forged_and_says_nothing() -> None:
    w, rec, ans, said = watch()
    ans.next = [gpus(g0={"lost": True})]
    w.step(0.0)
    said.clear()
    rec.add(xid(79), facility=1)
    w.step(1.0)
    assert said == [] and w.forged == 1


def test_a_stall_is_said_once_then_a_fault_past_the_window() -> None:
    w, _rec, ans, said = watch(GpuWatchConfig(unanswered_window=60.0))
    ans.next = [gpus(), ProbeResult(stalled_for=5.0)]
    steps(w, [0.0, 10.0])
    assert said.events() == ["gpu_stall"]
    steps(w, [20.0, 30.0, 60.0])
    assert said.events() == ["gpu_stall"]  # 55 s unanswered: inside the window
    w.step(65.0)
    assert said.events() == ["gpu_stall", "gpu_fault"]
    assert said.of("gpu_fault")[0]["sig"] == "nvml_unanswered"
    steps(w, [70.0, 500.0])
    assert said.events() == ["gpu_stall", "gpu_fault"]


def test_an_answer_ends_the_unanswered_time() -> None:
    w, _rec, ans, said = watch(GpuWatchConfig(unanswered_window=60.0))
    ans.next = [gpus(), ProbeResult(stalled_for=5.0), gpus()]
    steps(w, [0.0, 10.0, 40.0, 100.0, 200.0])
    assert said.events() == ["gpu_stall"]


def test_progress_stopped_confirms_a_hardware_xid() -> None:
    w, rec, ans, said = watch()
    ans.next = [gpus()]
    w.step(0.0)
    rec.add(xid(119))
    w.step(1.0)
    w.step(2.0, progress_stopped=True)
    assert said.of("gpu_fault")[0]["sig"] == "progress_stopped"


def test_fewer_gpus_than_at_boot_is_a_fault() -> None:
    w, _rec, ans, said = watch()
    one = gpus()
    assert one.sample is not None
    ans.next = [one, ProbeResult(sample={"count": 1, "gpus": one.sample["gpus"][:1]})]
    steps(w, [0.0, 1.0])
    assert said.of("gpu_fault") == [{"xid": "0", "pci": "-", "gpu": "-", "sig": "handle_lost"}]


@given(
    st.lists(
        st.tuples(
            st.sampled_from([None, 13, 31, 43, 45, 68, 94, 8, 999]),  # never a hardware Xid
            st.integers(0, 1),
            st.booleans(),  # a fresh healthy sample this step
            st.integers(0, 50),  # ECC counts stay flat; utilisation and memory move
        ),
        max_size=200,
    )
)
def test_soak_of_healthy_gpus_and_application_errors_never_faults(
    script: list[tuple[int | None, int, bool, int]],
) -> None:
    w, rec, ans, said = watch(GpuWatchConfig(unanswered_window=60.0, episode_quiet=30.0))
    t = 0.0
    for n, gpu, sample, used in script:
        if n is not None:
            rec.add(xid(n, gpu=gpu))
        if sample:
            ans.next = [gpus(g0={"used": used}, g1={"used": used})]
        t += 7.0
        w.step(t)
    assert said.of("gpu_fault") == []
