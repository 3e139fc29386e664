from torchtitan_xla.parallelisms.parallel_dims import BATCH_AXES, MESH_AXES, ParallelDims
from torchtitan_xla.parallelisms.parallelize_llama import parallelize_llama

__all__ = ["BATCH_AXES", "MESH_AXES", "ParallelDims", "parallelize_llama"]
