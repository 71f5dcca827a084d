"""Device memory (torch): the Mamba state pool, the hybrid layout's raw tensors and views, the
host arena that mirrors them (:class:`HostArena`), and the export of block tables to kernels.
Nothing in ``mambakv.core`` or the coordinator imports this package."""

from mambakv.device.host_arena import HostArena

__all__ = ["HostArena"]
