"""The control plane: controller, scheduler and allocation policies.

Pure logic. It consumes events and emits commands and imports neither torch
nor Ray, so the runtime driver (real devices) and the simulator (modeled
devices on a virtual clock) run it unchanged.
"""
