"""Compiled CPU kernels (numba), registered as variants beside the array-module reference kernels.

Each module here registers its variants when imported (the kernels package imports them all) but
imports numba only when a plan first binds one of its kernels: a model without batch norm or
pooling never pays numba's import or a compile. See jit.py for how they are compiled and run.
"""
