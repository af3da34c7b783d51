"""The one compiled part: the scheduler plugin's transition hook in C
(``producers/_hotpath.c``). Optional: without a C compiler the install goes on and
the plugin uses its Python hook (the same items, more of the scheduler's CPU; see
``bench/transition_hotpath.py``). Everything else is configured in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("dask_blackbox.producers._hotpath", ["producers/_hotpath.c"], optional=True),
])
