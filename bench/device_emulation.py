"""The device, emulated on a CPU: what the host does when a GPU does the math.

On a GPU a step's forward pass costs the host a launch, and the device then
works on its own; on a CPU the model's compute takes the host's cores and
hides the host's own work. The benchmarks that ask what the host costs a step
(bench/schema_emulated.py, bench/serve_emulated.py) replace the model's
forward pass with this emulation, one of two models of the device:

- "sleep": each forward pass sleeps `device_ms` on the device thread (no CPU,
  no GIL), so the device thread's own CPU work (masking and sampling, on the
  CPU here) adds to every step.
- "deadline": a forward pass only moves the time at which the device would be
  done with everything queued so far, as a kernel launched on a CUDA stream
  does; reading a step's tokens on the host (`SamplerOutput.host`) waits until
  then. The device thread's own work overlaps the device's time, as kernel
  launches do on a GPU, instead of adding to it.

`forward`: "zeros" returns zeros without computing (host work alone, as with a
GPU fast enough that the host sets the pace), the logits too (the LM head of
zero hidden states is zeros: the same tokens, without a [batch, hidden] x
[hidden, vocab] product on the CPU that a GPU would run inside its step), or
"real" keeps the model's compute before the emulated device time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

MODELS = ("sleep", "deadline")
FORWARDS = ("zeros", "real")


def install(device_ms: float, model: str = "sleep", forward: str = "zeros") -> Callable[[], None]:
    """Emulate the device in this process from now on; returns what undoes it."""
    if model not in MODELS or forward not in FORWARDS:
        raise ValueError(f"device model {model!r} / forward {forward!r}: use one of {MODELS} / {FORWARDS}")
    import torch

    from engine.models.llama import LlamaFamilyModel
    from engine.sampler import SamplerOutput

    delay = device_ms / 1000
    real_forward, real_logits = LlamaFamilyModel.forward, LlamaFamilyModel.logits
    to_host_async, host = SamplerOutput.to_host_async, SamplerOutput.host
    device_free = 0.0  # deadline: when the emulated device has done all it was given
    ready: dict[int, float] = {}  # deadline: when each queued copy of tokens lands

    def emulated(self, input_ids, *args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal device_free
        if forward == "zeros":
            out = torch.zeros(input_ids.shape[0], self.config.hidden_size, dtype=self.dtype,
                              device=input_ids.device)
        else:
            out = real_forward(self, input_ids, *args, **kwargs)
        if model == "deadline":  # queued behind what the device already has, as on a CUDA stream
            device_free = max(time.perf_counter(), device_free) + delay
        else:
            time.sleep(delay)  # the device's share of the step: no CPU, no GIL
        return out

    def zero_logits(self, hidden):  # type: ignore[no-untyped-def]
        return torch.zeros(hidden.shape[0], self.lm_head.out_features, dtype=torch.float32, device=hidden.device)

    def queued(self):  # type: ignore[no-untyped-def]
        to_host_async(self)
        ready[id(self)] = max(device_free, time.perf_counter())

    def read(self):  # type: ignore[no-untyped-def]
        wait = ready.pop(id(self), 0.0) - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return host(self)

    LlamaFamilyModel.forward = emulated  # type: ignore[method-assign]
    if forward == "zeros":
        LlamaFamilyModel.logits = zero_logits  # type: ignore[method-assign]
    if model == "deadline":
        SamplerOutput.to_host_async = queued  # type: ignore[method-assign]
        SamplerOutput.host = read  # type: ignore[method-assign]

    def uninstall() -> None:
        LlamaFamilyModel.forward, LlamaFamilyModel.logits = real_forward, real_logits  # type: ignore[method-assign]
        SamplerOutput.to_host_async, SamplerOutput.host = to_host_async, host  # type: ignore[method-assign]

    return uninstall
