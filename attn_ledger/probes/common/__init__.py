"""What the kernel, module and model probes share: calling a forward, observing its core."""
