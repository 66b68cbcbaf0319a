"""retain_freed_memory: glibc's mmap and trim thresholds, and what they change in this process."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any

import pytest

from pl_pipedream.runtime.memory import retain_freed_memory

MiB = 2**20


class FakeMallopt:
    def __init__(self, result: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.result = result
        self.argtypes: list[Any] = []
        self.restype: Any = None

    def __call__(self, option: int, value: int) -> int:
        self.calls.append((option, value))
        return self.result


class FakeGlibc:
    def __init__(self, result: int = 1) -> None:
        self.mallopt = FakeMallopt(result)
        self.gnu_get_libc_version = lambda: b"2.36"


class FakeMusl:
    def __init__(self) -> None:
        self.mallopt = FakeMallopt()


def use_libc(monkeypatch: pytest.MonkeyPatch, libc: object) -> list[str]:
    opened: list[str] = []

    def cdll(name: str) -> object:
        opened.append(name)
        if isinstance(libc, Exception):
            raise libc
        return libc

    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(ctypes, "CDLL", cdll)
    return opened


def test_sets_glibcs_mmap_then_trim_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = FakeGlibc()
    opened = use_libc(monkeypatch, libc)
    assert retain_freed_memory() is True
    assert len(opened) == 1
    # <malloc.h>: M_TRIM_THRESHOLD is -1, M_MMAP_THRESHOLD is -3; 32 MiB is glibc's largest
    # mmap threshold on 64-bit systems.
    assert libc.mallopt.calls == [(-3, 32 * MiB), (-1, 2**31 - 1)]
    assert libc.mallopt.argtypes == [ctypes.c_int, ctypes.c_int]
    assert libc.mallopt.restype is ctypes.c_int


def test_a_refused_setting_reports_false(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = FakeGlibc(result=0)  # mallopt returns 0 on error
    use_libc(monkeypatch, libc)
    assert retain_freed_memory() is False


def test_musl_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = FakeMusl()
    use_libc(monkeypatch, libc)
    assert retain_freed_memory() is False
    assert libc.mallopt.calls == []


def test_no_c_library_reports_false(monkeypatch: pytest.MonkeyPatch) -> None:
    use_libc(monkeypatch, OSError("libc.so.6: cannot open shared object file"))
    assert retain_freed_memory() is False


@pytest.mark.parametrize("platform", ["darwin", "win32"])
def test_other_systems_are_left_alone(monkeypatch: pytest.MonkeyPatch, platform: str) -> None:
    opened = use_libc(monkeypatch, FakeGlibc())
    monkeypatch.setattr(sys, "platform", platform)
    assert retain_freed_memory() is False
    assert opened == []


# ----- the real glibc ---------------------------------------------------------------------------


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",  # bytes the heap holds from the system
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",  # bytes in mmap-ed blocks
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def real_glibc() -> Any:
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc runs on Linux only")
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallinfo2"):
        pytest.skip("needs glibc 2.33 or later (mallinfo2)")
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def test_blocks_stay_in_the_heap_and_the_heap_keeps_its_top() -> None:
    """After the call a 16 MiB block comes from the heap (no new mmap-ed bytes), a block of 48
    MiB or more that no free heap space can serve is still mmap-ed, and freeing 96 MiB from the
    top of the heap gives nothing back. glibc's own adaptive trim threshold never exceeds 64
    MiB, so without the call the heap shrinks (checked in a process that first raised glibc's
    adaptive thresholds as far as they go)."""
    libc = real_glibc()
    assert retain_freed_memory() is True
    mapped = libc.mallinfo2().hblkhd
    block = libc.malloc(16 * MiB)
    assert block and libc.mallinfo2().hblkhd == mapped
    libc.free(block)
    # larger than every free byte the heap holds (earlier tests in this process freed some
    # into it, which a smaller request would reuse): only a new mapping can serve it
    large = max(48 * MiB, libc.mallinfo2().fordblks + 16 * MiB)
    block = libc.malloc(large)
    assert block and libc.mallinfo2().hblkhd >= mapped + large
    libc.free(block)
    blocks = [libc.malloc(16 * MiB) for _ in range(6)]
    assert all(blocks) and libc.mallinfo2().hblkhd == mapped
    held = libc.mallinfo2().arena
    for block in reversed(blocks):
        libc.free(block)
    assert libc.mallinfo2().arena == held
