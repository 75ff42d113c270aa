"""Host staging of a worker's tensors: device tensors go through pinned host memory.

The wire codec works on 1-D CPU tensors. :class:`HostStaging` gives it those: a view of a CPU
tensor, or a pinned host buffer (one per key, reused across steps) that a device tensor is copied
into with ``non_blocking=True``; pulled values are copied back to the device the same way.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ps_common.plan import Plan


class HostStaging:
    """Pinned host buffers of one client, one per key (made on first use, remade when the size or
    dtype changes)."""

    def __init__(self) -> None:
        self._host: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        """Forget the buffers (a new plan)."""
        self._host = {}

    def host_flat(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """A 1-D CPU tensor holding ``t``'s values (a view for CPU tensors, pinned staging otherwise;
        the copy is asynchronous: :meth:`stage` synchronizes)."""
        if t.device.type == "cpu":
            return t.detach().reshape(-1)
        buf = self._host.get(key)
        if buf is None or buf.numel() != t.numel() or buf.dtype != t.dtype:
            buf = torch.empty(t.numel(), dtype=t.dtype, pin_memory=torch.cuda.is_available())
            self._host[key] = buf
        buf.copy_(t.detach().reshape(-1), non_blocking=True)
        return buf

    def stage(
        self, plan: Plan, tensors: Mapping[str, torch.Tensor], keys: frozenset[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Every key of ``plan`` (``keys``: those only) -> a 1-D CPU tensor of ``tensors[key]``'s
        values, copied to host.

        Raises:
            KeyError: a key of the plan is missing from ``tensors``.
        """
        specs = [s for s in plan.specs if keys is None or s.key in keys]
        missing = [s.key for s in specs if s.key not in tensors]
        if missing:
            raise KeyError(f"push/pull needs every parameter of the plan; missing {missing[:4]}")
        flats = {s.key: self.host_flat(s.key, tensors[s.key]) for s in specs}
        if any(t.device.type == "cuda" for t in tensors.values()):
            torch.cuda.synchronize()
        return flats

    def pull_targets(
        self, plan: Plan, out: Mapping[str, torch.Tensor], keys: frozenset[str] | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(key -> 1-D CPU tensor a pull writes, key -> device tensor to copy it into after), for
        every key of the plan (``keys``: those only; a diloco round of one fragment).

        Raises:
            ValueError: a CPU tensor of ``out`` is not contiguous (a pull writes in place).
        """
        device_out = {k: t for k, t in out.items() if t.device.type != "cpu" and (keys is None or k in keys)}
        flats = {
            s.key: (self.host_flat(s.key, out[s.key]) if s.key in device_out else out[s.key].data.reshape(-1))
            for s in plan.specs
            if keys is None or s.key in keys
        }
        if any(flat.data_ptr() != out[k].data_ptr() and k not in device_out for k, flat in flats.items()):
            raise ValueError("pull() writes in place and needs contiguous CPU tensors or device tensors.")
        return flats, device_out

    @staticmethod
    def unstage(device_out: Mapping[str, torch.Tensor], flats: Mapping[str, torch.Tensor]) -> None:
        """Copy pulled values back into the device tensors of ``device_out``."""
        for key, t in device_out.items():
            t.copy_(flats[key].view(t.shape), non_blocking=True)
        if device_out:
            torch.cuda.synchronize()
