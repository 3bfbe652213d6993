"""The NIXL agent that exposes the export region to decode workers (nixl is an optional extra)."""

from __future__ import annotations

from service.kv_transfer.export import ExportRegion

INSTALL_HINT = ("pip install '.[kv-transfer]' (nixl 1.5.1), then "
                "pip install --no-deps nixl_cu12==1.5.1")
MEM_TYPES = ("DRAM", "VRAM")


class NixlUnavailable(RuntimeError):
    """NIXL (or its UCX backend) cannot be loaded in this environment."""


def _nixl():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise NixlUnavailable(f"KV_TRANSFER=nixl needs NIXL: {INSTALL_HINT} ({e})") from e
    return nixl_agent, nixl_agent_config


class NixlAgent:
    """A NIXL agent (UCX) with each layer of the export region registered as one descriptor."""

    def __init__(self, name: str, region: ExportRegion, mem_type: str = "DRAM",
                 device_id: int = 0, num_threads: int = 2):
        if mem_type not in MEM_TYPES:
            raise ValueError(f"mem_type must be one of {MEM_TYPES}, got {mem_type!r}")
        on_gpu = region.data.device.type == "cuda"
        if on_gpu != (mem_type == "VRAM"):
            raise ValueError(f"mem_type {mem_type} does not match the region's device "
                             f"{region.data.device}")
        nixl_agent, nixl_agent_config = _nixl()
        self.name = name
        self._agent = nixl_agent(name, nixl_agent_config(backends=["UCX"],
                                                         num_threads=num_threads))
        if "UCX" not in self._agent.backends:
            raise NixlUnavailable(f"NIXL has no UCX backend here; {INSTALL_HINT}")
        descs = [(t.data_ptr(), t.numel() * t.element_size(), device_id, "")
                 for t in region.layers]
        self._reg = self._agent.register_memory(descs, mem_type)

    def metadata(self) -> bytes:
        """The agent's NIXL metadata, with the registered regions (vLLM's `agent_metadata`)."""
        return self._agent.get_agent_metadata()

    def notifications(self) -> list[bytes]:
        """Notifications received since the last call, from every remote agent."""
        return [m for msgs in self._agent.get_new_notifs().values() for m in msgs]

    def close(self) -> None:
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None
