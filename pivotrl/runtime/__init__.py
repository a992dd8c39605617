"""Runtime driver: the parts that touch devices, processes and collectives (the control plane stays pure)."""
