"""A user's attention module: its forward, core, gradients and decode path, observed and checked."""
