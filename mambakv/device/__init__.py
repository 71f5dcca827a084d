"""Device memory (torch): the Mamba state pool, the hybrid layout's raw tensors and views, and
the export of block tables to kernels. Nothing in ``mambakv.core`` or the coordinator imports
this package."""
