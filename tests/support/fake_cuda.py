"""CUDA's driver API (libcuda) stood in for, so that CudaDevice's host registration runs on a
machine without a GPU: which ranges get registered, under which GPU's context, and what is left
registered after a failure."""

from __future__ import annotations

CONTEXT_BASE = 0x1000  # a GPU's primary context handle, in this stand-in: CONTEXT_BASE + its index


class FakeLibcuda:
    """The calls CudaDriver makes, with ctypes arguments as libcuda gets them. fail_at: the
    registration call (0 for the first) that returns status instead of succeeding."""

    def __init__(self, fail_at: int | None = None, status: int = 2):
        self.fail_at = fail_at
        self.status = status
        self.calls: list[tuple] = []         # ("register", address, nbytes, gpu) or ("unregister", address, gpu)
        self.registered: dict[int, int] = {}  # address -> bytes, registered now
        self.current: list[int] = []          # the thread's context stack, as GPU indices, innermost last
        self.opened: set[int] = set()         # GPUs whose primary context was ever retained
        self.held = 0                         # retains not yet released

    def cuInit(self, flags) -> int:
        return 0

    def cuDeviceGet(self, device, ordinal) -> int:
        device._obj.value = ordinal
        return 0

    def cuDevicePrimaryCtxRetain(self, context, device) -> int:
        context._obj.value = CONTEXT_BASE + device.value
        self.opened.add(device.value)
        self.held += 1
        return 0

    def cuDevicePrimaryCtxRelease_v2(self, device) -> int:
        self.held -= 1
        return 0

    def cuCtxPushCurrent_v2(self, context) -> int:
        self.current.append(context.value - CONTEXT_BASE)
        return 0

    def cuCtxPopCurrent_v2(self, popped) -> int:
        self.current.pop()
        return 0

    def cuMemHostRegister_v2(self, address, nbytes, flags) -> int:
        assert self.current, "registered with no current context"
        attempt = sum(call[0] == "register" for call in self.calls)
        self.calls.append(("register", address.value, nbytes.value, self.current[-1]))
        if attempt == self.fail_at:
            return self.status
        self.registered[address.value] = nbytes.value
        return 0

    def cuMemHostUnregister(self, address) -> int:
        assert self.current, "unregistered with no current context"
        self.calls.append(("unregister", address.value, self.current[-1]))
        del self.registered[address.value]
        return 0
