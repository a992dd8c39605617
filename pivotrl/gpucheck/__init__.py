"""Checks of pivotrl on a CUDA GPU: parity, the engines, GPS loads, shifts, the trainers, a short job.

Each section is a function of the device and its sizes returning a dict of findings (``pass`` where it checks
something). ``tests/gpu`` asserts their checks on a GPU (``make gpu-check``); ``benchmarks/gpu_check.py``
reports their timings; the CPU tests run them at tiny sizes.
"""
