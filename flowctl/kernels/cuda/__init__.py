"""What a GPU step needs beyond cupy's array operations: products through cuBLAS that a CUDA-graph
capture accepts (`blas`), kernels of our own written once in numba-cuda (`jit`: the CUDA simulator
runs the same source on a CPU), and the device array module that puts them beside cupy's names
(`xp`). Every module here imports cupy, numba or ctypes libraries lazily: a machine without a GPU
imports the package and never touches them."""
